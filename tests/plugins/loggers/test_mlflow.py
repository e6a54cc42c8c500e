"""MLflowLogger against a real SQLite tracking store in a temporary directory, read back
with MLflow's own client and compared with the put records."""

from __future__ import annotations

import math
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch

from loopbus import MisconfigurationError, PutRecord, Trainer
from loopbus.plugins import Checkpoint, MLflowLogger
from tests.helpers import TinyModule, make_loader
from tests.plugins.loggers.tracking_helpers import Captured

pytest.importorskip("mlflow")
pytest.importorskip("sqlalchemy")

from mlflow.tracking import MlflowClient

from loopbus.plugins.loggers._mlflow import (
    BEST_CHECKPOINT_TAG,
    LAST_CHECKPOINT_TAG,
    mlflow_key,
)

pytestmark = [
    # MLflow's SQLAlchemy models use a loader strategy that SQLAlchemy 2.1 deprecates.
    pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated"),
]


class HparamsModule(TinyModule):
    """Has hyperparameters and puts values of every kind put accepts."""

    @property
    def hparams(self) -> dict[str, Any]:
        return {"lr": self.lr, "n_in": 4, "optim": {"name": "sgd", "momentum": 0.9}}

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        loss = super().training_step(batch, ctx)
        step = self.trainer.global_step
        self.put("train/flag", step % 2 == 0)
        self.put("train/count", step)
        self.put("odd: name (%)", 1.5)
        self.put("../escape", 2.5)
        self.put("big", 2**64 - 1)
        if step == 1:
            self.put("train/nan", math.nan)
            self.put("train/inf", -math.inf)
        return loss


def store(tmp_path: Path) -> tuple[str, str]:
    """A tracking URI (SQLite) and an artifact location, both in ``tmp_path``."""
    return f"sqlite:///{tmp_path / 'mlflow.db'}", (tmp_path / "artifacts").as_uri()


def history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float, int]]:
    return sorted((m.step, m.value, m.timestamp) for m in client.get_metric_history(run_id, key))


def same(logged: float, put: float) -> bool:
    """MLflow's database keeps NaN, and stores an infinity as the largest finite float."""
    if math.isinf(put):
        put = math.copysign(sys.float_info.max, put)
    return logged == put or (math.isnan(logged) and math.isnan(put))


def expected_history(records: list[PutRecord]) -> dict[str, list[tuple[int, float, int]]]:
    out: dict[str, list[tuple[int, float, int]]] = defaultdict(list)
    for r in records:
        out[mlflow_key(r.name)].append((r.step, float(r.value), int(r.time * 1000)))
    return {k: sorted(v) for k, v in out.items()}


def assert_histories_equal(
    client: MlflowClient, run_id: str, expected: dict[str, list[tuple[int, float, int]]]
) -> None:
    logged = set(client.get_run(run_id).data.metrics)
    assert logged == set(expected)
    for key, points in expected.items():
        got = history(client, run_id, key)
        assert len(got) == len(points), key
        for (s1, v1, t1), (s2, v2, t2) in zip(got, points, strict=True):
            assert (s1, t1) == (s2, t2), key
            assert same(v1, v2), (key, v1, v2)


async def test_metrics_params_and_checkpoints_are_in_the_mlflow_run(tmp_path: Path) -> None:
    uri, artifacts = store(tmp_path)
    captured = Captured()
    logger = MLflowLogger(
        tracking_uri=uri,
        experiment_name="tiny",
        run_name="first",
        tags={"team": "loop"},
        artifact_location=artifacts,
        log_checkpoints=True,
    )
    checkpoint = Checkpoint(tmp_path / "ckpt", every_n_steps=2, keep_last=1)
    trainer = Trainer(max_epochs=2, plugins=[captured, checkpoint, logger], device="cpu")
    await trainer.fit(HparamsModule(), make_loader(n=64), make_loader(n=32))
    await trainer.test(HparamsModule(), make_loader(n=32))

    assert logger.run_id is not None
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(logger.run_id)
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "first"
    assert client.get_experiment(run.info.experiment_id).name == "tiny"

    # Metrics: every put record of fit and test, at its step and time, names made valid.
    records = captured.records
    assert {r.name for r in records} >= {"train/loss", "val/loss", "test/loss", "big"}
    assert_histories_equal(client, logger.run_id, expected_history(records))
    assert mlflow_key("odd: name (%)") == "odd_ name ___"
    assert mlflow_key("../escape") == "_/escape"

    # Params: the module's hyperparameters (nested ones flattened) and trainer options.
    params = run.data.params
    assert params["lr"] == "0.1"
    assert params["optim/name"] == "sgd"
    assert params["optim/momentum"] == "0.9"
    assert params["trainer/max_epochs"] == "2"
    assert params["trainer/max_steps"] == "None"
    assert params["trainer/accumulate_grad_batches"] == "1"

    # Checkpoints: the newest file's path as a tag, every saved file as an artifact.
    assert run.data.tags["team"] == "loop"
    last = checkpoint.last_checkpoint_path
    assert last is not None
    assert run.data.tags[LAST_CHECKPOINT_TAG] == str(last)
    assert BEST_CHECKPOINT_TAG not in run.data.tags  # no monitor, no best
    uploaded = {Path(a.path).name for a in client.list_artifacts(logger.run_id, "checkpoints")}
    assert uploaded <= {Path(e.path).name for e in captured.saved}
    assert last.name in uploaded
    assert {e.step for e in captured.saved} == {2, 4, 6, 8}  # every 2 steps of 8


async def test_the_best_checkpoint_is_tagged(tmp_path: Path) -> None:
    uri, artifacts = store(tmp_path)
    logger = MLflowLogger(tracking_uri=uri, artifact_location=artifacts)
    checkpoint = Checkpoint(tmp_path / "ckpt", monitor="val/loss", mode="min")
    trainer = Trainer(max_epochs=3, plugins=[checkpoint, logger], device="cpu")
    await trainer.fit(TinyModule(), make_loader(n=64), make_loader(n=32))

    assert logger.run_id is not None
    tags = MlflowClient(tracking_uri=uri).get_run(logger.run_id).data.tags
    assert tags[BEST_CHECKPOINT_TAG] == str(checkpoint.best_checkpoint_path)


async def test_resume_continues_the_same_run(tmp_path: Path) -> None:
    uri, artifacts = store(tmp_path)
    ckpt_dir = tmp_path / "ckpt"

    first = Captured()
    logger = MLflowLogger(tracking_uri=uri, artifact_location=artifacts)
    trainer = Trainer(
        max_steps=4,
        plugins=[first, Checkpoint(ckpt_dir, every_n_steps=2), logger],
        device="cpu",
    )
    await trainer.fit(TinyModule(), make_loader(n=64))
    run_id = logger.run_id
    assert run_id is not None

    second = Captured()
    resumed = MLflowLogger(tracking_uri=uri, artifact_location=artifacts)
    trainer = Trainer(
        max_steps=8,
        plugins=[second, Checkpoint(ckpt_dir, every_n_steps=2), resumed],
        device="cpu",
    )
    await trainer.fit(TinyModule(), make_loader(n=64), ckpt_path="last")

    assert resumed.run_id == run_id
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_run(run_id).info.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]  # no second run
    assert client.get_run(run_id).info.status == "FINISHED"
    # The metrics continue: steps 1..4 from the first fit, 5..8 from the resumed one.
    loss = history(client, run_id, "train/loss")
    assert [step for step, _, _ in loss] == [1, 2, 3, 4, 5, 6, 7, 8]
    assert_histories_equal(client, run_id, expected_history(first.records + second.records))


async def test_a_failed_fit_marks_the_run_failed(tmp_path: Path) -> None:
    class Boom(TinyModule):
        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            if self.trainer.global_step == 2:
                raise ValueError("boom")
            return super().training_step(batch, ctx)

    uri, artifacts = store(tmp_path)
    logger = MLflowLogger(tracking_uri=uri, artifact_location=artifacts)
    trainer = Trainer(max_epochs=1, plugins=[logger], device="cpu")
    with pytest.raises(ValueError, match="boom"):
        await trainer.fit(Boom(), make_loader(n=64))

    assert logger.run_id is not None
    client = MlflowClient(tracking_uri=uri)
    assert client.get_run(logger.run_id).info.status == "FAILED"
    steps = [s for s, _, _ in history(client, logger.run_id, "train/loss")]
    assert steps == [1, 2]  # what was put before the failure is logged


async def test_log_into_an_existing_run(tmp_path: Path) -> None:
    uri, artifacts = store(tmp_path)
    client = MlflowClient(tracking_uri=uri)
    experiment_id = client.create_experiment("mine", artifact_location=artifacts)
    run_id = client.create_run(experiment_id).info.run_id
    logger = MLflowLogger(tracking_uri=uri, run_id=run_id)
    trainer = Trainer(max_steps=3, plugins=[logger], device="cpu")
    await trainer.fit(TinyModule(), make_loader(n=64))

    assert logger.run_id == run_id
    assert [s for s, _, _ in history(client, run_id, "train/loss")] == [1, 2, 3]


async def test_an_unknown_run_id_is_a_clear_error(tmp_path: Path) -> None:
    uri, _ = store(tmp_path)
    logger = MLflowLogger(tracking_uri=uri, run_id="0123456789abcdef0123456789abcdef")
    trainer = Trainer(max_steps=1, plugins=[logger], device="cpu")
    with pytest.raises(Exception, match="cannot reopen the MLflow run '0123456789abcdef"):
        await trainer.fit(TinyModule(), make_loader(n=16))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"experiment_name": ""}, r"experiment_name=\.\.\.\) must be a non-empty string, got ''"),
        ({"tracking_uri": 3}, r"tracking_uri=\.\.\.\) must be a non-empty string or None"),
        ({"tags": ["a"]}, r"tags=\.\.\.\) must be a mapping"),
        ({"overflow": "wait"}, r"overflow"),
    ],
)
def test_bad_options_are_named(options: dict[str, Any], message: str) -> None:
    with pytest.raises(MisconfigurationError, match=message):
        MLflowLogger(**options)


@pytest.mark.external
def test_importing_loopbus_imports_no_tracker() -> None:
    code = (
        "import sys, loopbus, loopbus.plugins\n"
        "loaded = [m for m in ('mlflow', 'wandb') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
