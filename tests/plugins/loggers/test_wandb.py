"""WandbLogger in W&B's offline mode (no network), read back from the offline run files
with W&B's own inspector (``wandb leet inspect --json``) and compared with the put
records."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from loopbus import MisconfigurationError, PutRecord, Trainer
from loopbus.plugins import Checkpoint, WandbLogger
from tests.helpers import TinyModule, make_loader
from tests.plugins.loggers.tracking_helpers import Captured

pytest.importorskip("wandb")

from loopbus.plugins.loggers._wandb import BEST_CHECKPOINT_KEY, LAST_CHECKPOINT_KEY


@pytest.fixture(autouse=True)
def _wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No network, and nothing written outside ``tmp_path``."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))


class HparamsModule(TinyModule):
    @property
    def hparams(self) -> dict[str, Any]:
        return {"lr": self.lr, "optim": {"name": "sgd", "momentum": 0.9}}

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        loss = super().training_step(batch, ctx)
        step = self.trainer.global_step
        self.put("train/flag", step % 2 == 0)
        self.put("train/count", step)
        self.put("_step", 7.0)  # W&B's own key: logged as put/_step
        if step == 1:
            self.put("train/nan", math.nan)
            self.put("train/inf", math.inf)
        return loss


@dataclass
class OfflineRun:
    """What the offline run files of one run id hold (all its resumptions, in order)."""

    ids: list[str] = field(default_factory=list)
    history: dict[int, dict[str, Any]] = field(default_factory=lambda: defaultdict(dict))
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    exit_codes: list[int] = field(default_factory=list)
    artifacts: list[dict[str, Any]] = field(default_factory=list)


def read_offline(wandb_dir: Path) -> OfflineRun:
    out = OfflineRun()
    for path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        result = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(path)],
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        for line in result.stdout.splitlines():
            record = json.loads(line)
            kind = record["type"]
            body = record[kind]
            if kind == "run":
                out.ids.append(body["run_id"])
                out.config.update(body.get("config", {}).get("update", {}))
            elif kind == "config":
                out.config.update(body.get("update", {}))
            elif kind == "history":
                out.history[body["step"]["num"]].update(body["item"])
            elif kind == "summary":
                out.summary.update(body.get("update", {}))
            elif kind == "exit":
                out.exit_codes.append(body.get("exit_code", 0))
            elif kind == "artifact":
                out.artifacts.append(body)
    return out


def number(value: Any) -> float:
    """A history value as W&B's inspector prints it (NaN and infinities as text)."""
    return float({"NaN": "nan", "Infinity": "inf", "-Infinity": "-inf"}.get(value, value))


def expected_rows(records: list[PutRecord]) -> dict[int, dict[str, float]]:
    """One row per step, a name's last value at that step."""
    rows: dict[int, dict[str, float]] = defaultdict(dict)
    for r in records:
        name = f"put/{r.name}" if r.name.startswith("_") else r.name
        rows[r.step][name] = float(r.value)
    return rows


def assert_history_equal(run: OfflineRun, records: list[PutRecord]) -> None:
    expected = expected_rows(records)
    assert sorted(run.history) == sorted(expected)
    for step, row in expected.items():
        logged = {k: number(v) for k, v in run.history[step].items() if not k.startswith("_")}
        assert set(logged) == set(row), step
        for name, value in row.items():
            got = logged[name]
            assert got == value or (math.isnan(got) and math.isnan(value)), (step, name)
        assert run.history[step]["_step"] == step


@pytest.mark.external
async def test_history_config_and_checkpoints_are_in_the_offline_run(tmp_path: Path) -> None:
    captured = Captured()
    logger = WandbLogger(
        project="tiny", name="first", dir=tmp_path, mode="offline", log_checkpoints=True
    )
    checkpoint = Checkpoint(tmp_path / "ckpt", every_n_steps=2, keep_last=1)
    trainer = Trainer(max_epochs=2, plugins=[captured, checkpoint, logger], device="cpu")
    await trainer.fit(HparamsModule(), make_loader(n=64), make_loader(n=32))
    await trainer.test(HparamsModule(), make_loader(n=32))

    run = read_offline(tmp_path)
    assert logger.run_id is not None
    assert run.ids == [logger.run_id, logger.run_id]  # fit, then test resumed it
    assert run.exit_codes == [0, 0]
    assert {"train/loss", "val/loss", "test/loss", "_step"} <= {r.name for r in captured.records}
    assert_history_equal(run, captured.records)

    assert run.config["lr"] == 0.1
    assert run.config["optim/name"] == "sgd"
    assert run.config["trainer/max_epochs"] == 2
    assert run.config["trainer/max_steps"] is None

    last = checkpoint.last_checkpoint_path
    assert last is not None
    assert run.summary[LAST_CHECKPOINT_KEY] == str(last)
    assert BEST_CHECKPOINT_KEY not in run.summary
    assert run.artifacts  # at least the newest checkpoint, as a model artifact
    assert all(a["type"] == "model" for a in run.artifacts)
    logged_files = {
        Path(entry["path"]).name for a in run.artifacts for entry in a["manifest"]["contents"]
    }
    assert last.name in logged_files
    assert logged_files <= {Path(e.path).name for e in captured.saved}


@pytest.mark.external
async def test_resume_continues_the_same_run(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    first = Captured()
    logger = WandbLogger(project="tiny", dir=tmp_path, mode="offline")
    trainer = Trainer(
        max_steps=4, plugins=[first, Checkpoint(ckpt_dir, every_n_steps=2), logger], device="cpu"
    )
    await trainer.fit(TinyModule(), make_loader(n=64))
    run_id = logger.run_id
    assert run_id is not None

    second = Captured()
    resumed = WandbLogger(project="tiny", dir=tmp_path, mode="offline")
    trainer = Trainer(
        max_steps=8,
        plugins=[second, Checkpoint(ckpt_dir, every_n_steps=2), resumed],
        device="cpu",
    )
    await trainer.fit(TinyModule(), make_loader(n=64), ckpt_path="last")

    assert resumed.run_id == run_id
    run = read_offline(tmp_path)
    assert run.ids == [run_id, run_id]
    assert sorted(run.history) == [1, 2, 3, 4, 5, 6, 7, 8]  # continues, once each
    assert_history_equal(run, first.records + second.records)


@pytest.mark.external
async def test_a_failed_fit_exits_the_run_with_code_1(tmp_path: Path) -> None:
    class Boom(TinyModule):
        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            if self.trainer.global_step == 2:
                raise ValueError("boom")
            return super().training_step(batch, ctx)

    logger = WandbLogger(dir=tmp_path, mode="offline")
    trainer = Trainer(max_epochs=1, plugins=[logger], device="cpu")
    with pytest.raises(ValueError, match="boom"):
        await trainer.fit(Boom(), make_loader(n=64))

    run = read_offline(tmp_path)
    assert run.exit_codes == [1]
    assert sorted(run.history) == [1, 2]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"project": ""}, r"project=\.\.\.\) must be a non-empty string or None, got ''"),
        ({"mode": "online-ish"}, r"mode"),
        ({"tags": "a"}, r"tags=\.\.\.\) must be a list of strings"),
        ({"init_kwargs": {"resume": "must"}}, r"cannot set \['resume'\]"),
        ({"dir": 3}, r"dir=\.\.\.\) must be a directory path"),
    ],
)
def test_bad_options_are_named(options: dict[str, Any], message: str) -> None:
    with pytest.raises(MisconfigurationError, match=message):
        WandbLogger(**options)
