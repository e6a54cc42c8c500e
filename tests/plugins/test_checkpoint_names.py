"""The Checkpoint plugin never replaces a checkpoint: a save whose name is taken (two
saves at the same epoch and step, or a checkpoint an earlier run left in the directory)
is named ``<name>-v1.ckpt`` (``-v2``, ...), for checkpoint files and sharded directories
alike, and ``last``, ``keep_last`` and ``keep_best`` count the versions as checkpoints of
their own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import loopbus
from loopbus import Plugin, Trainer, on
from loopbus.plugins import Checkpoint, CheckpointSaved
from tests.ckpt_scenario import Net, make_data

N_TRAIN = 96
BATCH = 8  # 12 steps an epoch


class Saved(Plugin):
    """The paths of the CheckpointSaved events."""

    def __init__(self) -> None:
        self.paths: list[str] = []

    @on(CheckpointSaved)
    def _saved(self, event: CheckpointSaved) -> None:
        self.paths.append(Path(event.path).name)


def fit(directory: Path, epochs: int = 1, **options: Any) -> tuple[Checkpoint, Saved]:
    checkpoint = Checkpoint(directory, **options)
    saved = Saved()
    train, val = make_data("plain", n_train=N_TRAIN, batch=BATCH)
    trainer = Trainer(
        max_epochs=epochs, plugins=[checkpoint, saved], device="cpu", enable_model_summary=False
    )
    loopbus.run(trainer.fit, Net(), train, val)
    return checkpoint, saved


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".ckpt"))


def in_epoch(path: Path) -> bool:
    state = loopbus.load_checkpoint(path)
    return bool(state["loops/fit"]["loops"]["epoch_loop"]["state"]["in_epoch"])


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_two_saves_at_the_same_step_both_survive(tmp_path: Path, sharded: bool) -> None:
    # Step 12 ends the epoch: its periodic save (inside the epoch, at the batch) and the
    # epoch-end save (between epochs) are two checkpoints of the same epoch and step.
    _, saved = fit(tmp_path, every_n_steps=6, every_n_epochs=1, keep_last=None, sharded=sharded)
    both = ["epoch=0-step=12.ckpt", "epoch=0-step=12-v1.ckpt"]
    assert saved.paths == ["epoch=0-step=6.ckpt", *both]
    assert names(tmp_path) == sorted(["epoch=0-step=6.ckpt", *both])
    first, second = (tmp_path / name for name in both)
    assert loopbus.is_sharded_checkpoint(first) == loopbus.is_sharded_checkpoint(second) == sharded
    assert (in_epoch(first), in_epoch(second)) == (True, False)
    for path in (first, second):
        assert loopbus.load_checkpoint(path)["run"]["step"] == 12
    assert loopbus.latest_checkpoint(tmp_path) == second


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
def test_a_checkpoint_an_earlier_run_left_is_not_replaced(tmp_path: Path, sharded: bool) -> None:
    fit(tmp_path, every_n_steps=6, keep_last=None, save_on_end=False, sharded=sharded)
    before = {name: loopbus.load_checkpoint(tmp_path / name)["loopbus"]["created"] for name in
              names(tmp_path)}  # fmt: skip
    assert sorted(before) == ["epoch=0-step=12.ckpt", "epoch=0-step=6.ckpt"]
    # A new run (not resumed) added to the same directory: same epochs and steps.
    _, saved = fit(
        tmp_path, every_n_steps=6, keep_last=1, save_on_end=False, sharded=sharded, exist_ok=True
    )
    assert saved.paths == ["epoch=0-step=6-v1.ckpt", "epoch=0-step=12-v1.ckpt"]
    # keep_last=1 removed its own older save, never the earlier run's.
    assert names(tmp_path) == sorted([*before, "epoch=0-step=12-v1.ckpt"])
    for name, created in before.items():
        assert loopbus.load_checkpoint(tmp_path / name)["loopbus"]["created"] == created
    assert loopbus.latest_checkpoint(tmp_path) == tmp_path / "epoch=0-step=12-v1.ckpt"


def test_a_taken_version_is_skipped(tmp_path: Path) -> None:
    # Something else already holds the name and its first version.
    (tmp_path / "epoch=0-step=12.ckpt").write_bytes(b"mine")
    (tmp_path / "epoch=0-step=12-v1.ckpt").mkdir()
    _, saved = fit(tmp_path, every_n_steps=12, keep_last=None, save_on_end=False, exist_ok=True)
    assert saved.paths == ["epoch=0-step=12-v2.ckpt"]
    assert (tmp_path / "epoch=0-step=12.ckpt").read_bytes() == b"mine"
    assert not any((tmp_path / "epoch=0-step=12-v1.ckpt").iterdir())


def test_keep_last_and_keep_best_count_versions_as_checkpoints(tmp_path: Path) -> None:
    # Each epoch: a periodic save at its last step, then the monitored one at its end.
    checkpoint, saved = fit(
        tmp_path, epochs=3, every_n_steps=12, monitor="val/loss", keep_last=2, keep_best=1
    )
    periodic = [f"epoch={e}-step={12 * (e + 1)}.ckpt" for e in range(3)]
    assert [p for p in saved.paths if not p.endswith("-v1.ckpt")] == periodic
    state = checkpoint.state_dict()
    assert state["recent"] == periodic[1:]
    ((_, best),) = state["best"]
    assert best.endswith("-v1.ckpt")
    assert checkpoint.best_checkpoint_path == tmp_path / best
    assert state["last"] == saved.paths[-1]
    # On disk: exactly what is kept, every one a checkpoint of its own.
    assert names(tmp_path) == sorted({*state["recent"], best, state["last"]})
    for name in names(tmp_path):
        assert loopbus.load_checkpoint(tmp_path / name)["run"]["step"] % 12 == 0
