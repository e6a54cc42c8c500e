"""A damaged newest checkpoint (a truncated file or shard, a file whose CRC-32 no longer
matches its marker, its marker or its file deleted) is skipped by
``load_checkpoint(directory)``, ``latest_checkpoint`` and ``fit(ckpt_path="last")``,
which take the newest complete one instead and say, in a ``UserWarning``, which one they
skipped and why: without ``last.json``, and when ``last.json`` names the damaged one. Named explicitly, a damaged checkpoint is still
refused (``test_sharded_checkpoint.py``, ``test_checkpoint_files.py``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import loopbus
from loopbus import CheckpointError, Trainer
from loopbus.checkpoint._format import SHARDED_MARKER
from loopbus.events import FitStarted
from loopbus.plugins import Checkpoint
from tests.ckpt_scenario import Net, make_data

FIRST = "epoch=0-step=2.ckpt"
SECOND = "epoch=0-step=4.ckpt"


def _trainer(directory: Path, sharded: bool) -> tuple[Trainer, Net, Any, Any]:
    loopbus.seed_everything(0)
    train, val = make_data("plain", n_train=64)
    plugin = Checkpoint(
        directory, every_n_steps=2, keep_last=None, save_on_end=False, sharded=sharded
    )
    trainer = Trainer(max_steps=4, plugins=[plugin], device="cpu", enable_model_summary=False)
    return trainer, Net(), train, val


async def _saved(directory: Path, sharded: bool) -> None:
    """Checkpoints at steps 2 and 4 in ``directory``; ``last.json`` names the second."""
    trainer, module, train, val = _trainer(directory, sharded)
    await trainer.fit(module, train, val)


def _damage(checkpoint: Path, damage: str) -> str:
    """Damage ``checkpoint``; return what the warning says is wrong with it (a regex)."""
    if damage == "truncated":
        file = checkpoint / "__0_0.distcp" if checkpoint.is_dir() else checkpoint
        with open(file, "r+b") as handle:
            handle.truncate(file.stat().st_size // 2)
        what = r"its file __0_0\.distcp has" if checkpoint.is_dir() else "it has"
        return rf"{what} \d+ bytes where its completeness marker records \d+ \(it is truncated"
    if damage == "corrupted":  # one byte changed, the size kept: only the CRC-32 tells
        with open(checkpoint, "r+b") as handle:
            handle.seek(checkpoint.stat().st_size // 2)
            byte = handle.read(1)
            handle.seek(-1, 1)
            handle.write(bytes([byte[0] ^ 0xFF]))
        marker = re.escape(f"{checkpoint.name}.complete")
        return rf"its CRC-32 does not match the one its completeness marker {marker} records"
    if damage == "marker-deleted":
        if checkpoint.is_dir():
            (checkpoint / SHARDED_MARKER).unlink()
            return r"it has no completeness marker loopbus\.complete \(its save did not finish"
        Path(f"{checkpoint}.complete").unlink()
        return rf"it has no completeness marker {re.escape(checkpoint.name)}\.complete"
    assert damage == "file-deleted"
    checkpoint.unlink()
    return rf"only its completeness marker {re.escape(checkpoint.name)}\.complete is left"


CASES = [
    ("file", "truncated"),
    ("file", "corrupted"),
    ("file", "marker-deleted"),
    ("file", "file-deleted"),
    ("sharded", "truncated"),
    ("sharded", "marker-deleted"),
]


@pytest.mark.filterwarnings("ignore:resuming mid-epoch by skipping")
@pytest.mark.parametrize(("layout", "damage"), CASES)
async def test_without_last_json_the_newest_complete_checkpoint_is_taken(
    tmp_path: Path, layout: str, damage: str
) -> None:
    directory = tmp_path / "ckpt"
    await _saved(directory, sharded=layout == "sharded")
    (directory / "last.json").unlink()
    why = _damage(directory / SECOND, damage)
    said = rf"{re.escape(SECOND)}: {why}.*the newest complete checkpoint there, {FIRST}, is taken"
    with pytest.warns(UserWarning, match=said):
        assert loopbus.latest_checkpoint(directory) == directory / FIRST
    with pytest.warns(UserWarning, match=said):
        assert loopbus.load_checkpoint(directory)["loopbus"]["global_step"] == 2
    # fit(ckpt_path="last") resumes from it, saying the same.
    trainer, module, train, val = _trainer(directory, sharded=layout == "sharded")
    resumed: list[Any] = []
    trainer.subscribe(FitStarted, lambda event: resumed.append(trainer.state.resume))
    with pytest.warns(UserWarning, match=said):
        await trainer.fit(module, train, val, ckpt_path="last")
    assert resumed[0] is not None
    assert resumed[0].step == 2
    assert trainer.global_step == 4


@pytest.mark.filterwarnings("ignore:resuming mid-epoch by skipping")
@pytest.mark.parametrize(
    ("layout", "damage"),
    [("file", "truncated"), ("file", "corrupted"), ("file", "file-deleted"), *CASES[4:]],
)
async def test_a_damaged_checkpoint_that_last_json_names_is_skipped(
    tmp_path: Path, layout: str, damage: str
) -> None:
    directory = tmp_path / "ckpt"
    await _saved(directory, sharded=layout == "sharded")
    why = _damage(directory / SECOND, damage)
    if damage == "file-deleted":
        why = "it does not exist"
    said = (
        rf"{re.escape(SECOND)}: last\.json names it, but {why}.*the newest complete "
        rf"checkpoint there, {FIRST}, is taken"
    )
    with pytest.warns(UserWarning, match=said):
        assert loopbus.load_checkpoint(directory)["loopbus"]["global_step"] == 2
    with pytest.warns(UserWarning, match=said):  # the pointer, given as such
        assert loopbus.load_checkpoint(directory / "last.json")["loopbus"]["global_step"] == 2
    trainer, module, train, val = _trainer(directory, sharded=layout == "sharded")
    resumed: list[Any] = []
    trainer.subscribe(FitStarted, lambda event: resumed.append(trainer.state.resume))
    with pytest.warns(UserWarning, match=said):
        await trainer.fit(module, train, val, ckpt_path="last")
    assert resumed[0].step == 2


async def test_a_file_without_its_marker_that_last_json_names_is_taken(tmp_path: Path) -> None:
    # Complete on disk (only its marker is gone): checked structurally when it loads.
    directory = tmp_path / "ckpt"
    await _saved(directory, sharded=False)
    _damage(directory / SECOND, "marker-deleted")
    assert loopbus.latest_checkpoint(directory) == directory / SECOND
    assert loopbus.load_checkpoint(directory)["loopbus"]["global_step"] == 4


@pytest.mark.parametrize("layout", ["file", "sharded"])
async def test_when_nothing_is_complete_every_skipped_checkpoint_is_named(
    tmp_path: Path, layout: str
) -> None:
    directory = tmp_path / "ckpt"
    await _saved(directory, sharded=layout == "sharded")
    (directory / "last.json").unlink()
    first = _damage(directory / FIRST, "truncated")
    second = _damage(directory / SECOND, "truncated")
    with pytest.warns(
        UserWarning,
        match=rf"{re.escape(FIRST)}: {first}.*{re.escape(SECOND)}: {second}.*no complete "
        "checkpoint is left there",
    ):
        assert loopbus.latest_checkpoint(directory) is None
    with pytest.raises(
        CheckpointError,
        match=rf"no checkpoint in the directory .*Skipped as not complete: "
        rf"{re.escape(FIRST)}: {first}.*{re.escape(SECOND)}: {second}",
    ):
        loopbus.load_checkpoint(directory)
