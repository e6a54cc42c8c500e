"""``loopbus fit`` as a user launches it, in processes of its own: killed with SIGKILL
mid-epoch and continued with ``--resume RUN_DIR``, it ends with the weights of a run
never killed, bit for bit; under ``torchrun`` every rank reads the same configuration,
trains the same weights, and one run folder is made."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import ROOT
from tests.torchrun import env, free_port, torchrun

pytestmark = pytest.mark.external

#: Four batches an epoch, two epochs; a checkpoint every 3 steps (step 3 is mid-epoch).
CONFIG: dict[str, Any] = {
    "seed_everything": 0,
    "trainer": {"max_epochs": 2, "enable_model_summary": False},
    "model": {"class_path": "tests.helpers.TinyModule", "init_args": {"lr": 0.05}},
    "data": {
        "class_path": "tests.helpers.make_loader",
        "init_args": {"n": 64, "batch_size": 16, "shuffle": True},
    },
}


def _plugins(*plugins: str) -> str:
    return f"--trainer.plugins=[{', '.join(plugins)}]"


def _loopbus(*args: str, launcher: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    command = [*(launcher or [sys.executable]), "-m", "loopbus", *args]
    return subprocess.run(
        command, cwd=ROOT, env=env(tests=True), capture_output=True, text=True, timeout=240
    )


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)  # type: ignore[no-any-return]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_killed_mid_epoch_and_resumed_ends_bit_identical(tmp_path: Path) -> None:
    config = tmp_path / "run.json"
    config.write_text(json.dumps(CONFIG))
    checkpoint = "{class_path: Checkpoint, init_args: {every_n_steps: 3}}"
    saved = "{class_path: tests.cli.fixtures.SaveRankWeights, init_args: {path: '%s'}}"
    common = ("fit", "--config", str(config), f"--trainer.root_dir={tmp_path / 'runs'}")

    whole = _loopbus(*common, "--trainer.name=whole", _plugins(saved % (tmp_path / "whole.pt")))
    assert whole.returncode == 0, whole.stderr[-4000:]

    killed = _loopbus(
        *common,
        "--trainer.name=killed",
        _plugins(checkpoint, "{class_path: tests.cli.fixtures.KillAt, init_args: {step: 5}}"),
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
    run_dir = tmp_path / "runs" / "killed" / "version_0"
    assert json.loads((run_dir / "checkpoints" / "last.json").read_text())["checkpoint"] == (
        "epoch=0-step=3.ckpt"
    )
    resumed = _loopbus(
        "fit", "--resume", str(run_dir), _plugins(checkpoint, saved % (tmp_path / "resumed.pt"))
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"loopbus fit: resuming {run_dir}" in resumed.stderr
    assert json.loads((run_dir / "run.json").read_text())["resumed_from_step"] == 3
    _same(_weights(tmp_path / "resumed.pt.rank0"), _weights(tmp_path / "whole.pt.rank0"))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_under_torchrun_every_rank_reads_the_same_configuration(tmp_path: Path) -> None:
    config = tmp_path / "run.json"
    config.write_text(json.dumps(CONFIG))
    saved = "{class_path: tests.cli.fixtures.SaveRankWeights, init_args: {path: '%s'}}"
    launcher = torchrun("--nproc_per_node=2", f"--master_port={free_port()}")
    proc = _loopbus(
        "fit", "--config", str(config), f"--trainer.root_dir={tmp_path / 'runs'}",
        _plugins(saved % (tmp_path / "w.pt")), launcher=launcher,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    _same(_weights(tmp_path / "w.pt.rank0"), _weights(tmp_path / "w.pt.rank1"))
    folder = tmp_path / "runs" / "loopbus_logs"
    assert sorted(p.name for p in folder.iterdir()) == ["version_0"]  # one folder, rank 0's
    run = json.loads((folder / "version_0" / "run.json").read_text())
    assert run["world_size"] == 2
