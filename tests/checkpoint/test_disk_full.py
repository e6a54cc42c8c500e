"""A full disk while a checkpoint is written: every write (a checkpoint file, in the
foreground or the background, a sharded checkpoint's shards, its state file, a
completeness marker, ``last.json``) fails with a :class:`CheckpointError` that names the
path, says "No space left on device" and says truthfully what is on disk since; what was
written before still loads.

The full disk is a fake (``_full_disk.FullDisk``: writes fail with ENOSPC as write(2) does
on a full disk), so the tests run anywhere; one more writes onto a real, small tmpfs where
this process may mount one, and is skipped elsewhere."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from loopbus import CheckpointError, HandlerError, ShardedCheckpointWriter, Trainer
from loopbus.plugins import Checkpoint
from tests.ckpt_scenario import Net, make_data

from ._full_disk import NO_SPACE, FullDisk

FIRST = "epoch=0-step=2.ckpt"
SECOND = "epoch=0-step=4.ckpt"


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FullDisk:
    return FullDisk(monkeypatch, tmp_path)


def _trainer(directory: Path, **options: Any) -> tuple[Trainer, Net, Any, Any]:
    loopbus.seed_everything(0)
    train, val = make_data("plain", n_train=64)
    plugin = Checkpoint(directory, every_n_steps=2, keep_last=None, save_on_end=False, **options)
    trainer = Trainer(max_steps=4, plugins=[plugin], device="cpu", enable_model_summary=False)
    return trainer, Net(), train, val


async def _trained(module: Net | None = None, *, max_steps: int = 4) -> Trainer:
    """A trainer after a short fit without plugins, whose state is saved by hand."""
    loopbus.seed_everything(0)
    train, val = make_data("plain", n_train=64)
    trainer = Trainer(max_steps=max_steps, plugins=[], device="cpu", enable_model_summary=False)
    await trainer.fit(module or Net(), train, val)
    return trainer


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _step(path: Path) -> int:
    return int(loopbus.load_checkpoint(path)["loopbus"]["global_step"])


def _pointer(directory: Path) -> str:
    return str(json.loads((directory / "last.json").read_text())["checkpoint"])


def _later(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as if taken one step later: recognisably another checkpoint."""
    header = dict(state["loopbus"], global_step=state["loopbus"]["global_step"] + 1)
    return dict(state, loopbus=header)


# ---------------------------------------------------------------- checkpoint files


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
async def test_a_full_disk_fails_a_checkpoint_file_naming_it(
    disk: FullDisk, tmp_path: Path, background: bool
) -> None:
    directory = tmp_path / "ckpt"
    disk.full = lambda path: SECOND in path.name
    disk.room = 4096  # it fills up in the middle of the file (torch then raises its own error)
    trainer, module, train, val = _trainer(directory, background=background)
    target = re.escape(str(directory / SECOND))
    with pytest.raises(
        HandlerError,
        match=rf"could not write the checkpoint {target}: {NO_SPACE}\b.*Nothing was replaced: "
        rf"nothing was written under that name\. .*last\.json still names '{FIRST}'",
    ) as caught:
        await trainer.fit(module, train, val)
    assert disk.failed
    assert isinstance(caught.value.__cause__, CheckpointError)
    assert "unexpected pos" not in str(caught.value)  # torch's words for a failed write
    # The first checkpoint is untouched and is what the directory loads; no temporary.
    assert _names(directory) == [FIRST, FIRST + ".complete", "last.json"]
    assert _step(directory) == 2


@pytest.mark.parametrize("existing", [False, True], ids=["new-name", "same-name"])
async def test_a_full_disk_at_the_marker(disk: FullDisk, tmp_path: Path, existing: bool) -> None:
    trainer = await _trained()
    state = trainer.state_dict()
    first = loopbus.write_checkpoint(state, tmp_path / "a.ckpt", update_last=True)
    second = tmp_path / ("a.ckpt" if existing else "b.ckpt")
    disk.full = lambda path: f".{second.name}.complete.tmp-" in path.name
    replaced = "It replaced the previous checkpoint of that name. " if existing else ""
    with pytest.raises(
        CheckpointError,
        match=rf"the checkpoint {re.escape(str(second))} was written, but its completeness "
        rf"marker {re.escape(str(second))}\.complete could not be: {NO_SPACE}\b.*{replaced}"
        r"Without its marker .* The pointer was not moved: .*last\.json still names 'a\.ckpt'",
    ):
        loopbus.write_checkpoint(_later(state), second, update_last=True)
    assert not [n for n in _names(tmp_path) if ".tmp-" in n]
    assert _pointer(tmp_path) == "a.ckpt"
    assert _step(second) == 5  # complete, loaded by its path (checked structurally)
    if not existing:
        assert _step(tmp_path) == 4  # the pointer still names the first, intact
        # Without the pointer the unmarked file is skipped, and said so.
        (tmp_path / "last.json").unlink()
        with pytest.warns(UserWarning, match=r"b\.ckpt: it has no completeness marker"):
            assert loopbus.latest_checkpoint(tmp_path) == first


async def test_a_full_disk_at_the_pointer(disk: FullDisk, tmp_path: Path) -> None:
    trainer = await _trained()
    state = trainer.state_dict()
    loopbus.write_checkpoint(state, tmp_path / "a.ckpt", update_last=True)
    disk.full = lambda path: path.name.startswith(".last.json.tmp-")
    pointer = re.escape(str(tmp_path / "last.json"))
    with pytest.raises(
        CheckpointError,
        match=rf"the checkpoint .*b\.ckpt and its completeness marker were written, but the "
        rf"pointer {pointer} could not be moved to it: {NO_SPACE}\b.*The checkpoint is "
        rf"complete and loads by its path; {pointer} still names 'a\.ckpt'\.",
    ):
        loopbus.write_checkpoint(_later(state), tmp_path / "b.ckpt", update_last=True)
    assert _names(tmp_path) == [
        "a.ckpt",
        "a.ckpt.complete",
        "b.ckpt",
        "b.ckpt.complete",
        "last.json",
    ]
    assert _pointer(tmp_path) == "a.ckpt"
    assert _step(tmp_path) == 4
    assert _step(tmp_path / "b.ckpt") == 5  # verified against its marker


# ---------------------------------------------------------------- sharded checkpoints


@pytest.mark.parametrize("background", [False, True], ids=["foreground", "background"])
async def test_a_full_disk_fails_the_shards_naming_the_checkpoint(
    disk: FullDisk, tmp_path: Path, background: bool
) -> None:
    directory = tmp_path / "ckpt"
    disk.full = lambda path: SECOND in str(path) and path.suffix == ".distcp"
    disk.room = 4096
    trainer, module, train, val = _trainer(directory, sharded=True, background=background)
    with pytest.raises(
        HandlerError,
        match=rf"could not write the shards of the sharded checkpoint "
        rf"{re.escape(str(directory / SECOND))}: {NO_SPACE}\b.*nothing was replaced.*its "
        rf"temporary directory is removed, and .*last\.json still names '{FIRST}'",
    ) as caught:
        await trainer.fit(module, train, val)
    assert disk.failed
    assert "unexpected pos" not in str(caught.value)
    assert "Traceback" not in str(caught.value)  # not DCP's report of every rank
    assert _names(directory) == [FIRST, "last.json"]  # the partial directory is gone
    assert _step(directory) == 2


@pytest.mark.parametrize("where", ["loopbus_state.pt", "loopbus.complete"])
async def test_a_full_disk_while_completing_a_sharded_checkpoint(
    disk: FullDisk, tmp_path: Path, where: str
) -> None:
    directory = tmp_path / "ckpt"
    disk.full = lambda path: SECOND in str(path) and path.name.startswith(f".{where}.tmp-")
    trainer, module, train, val = _trainer(directory, sharded=True)
    with pytest.raises(
        HandlerError,
        match=rf"could not complete the sharded checkpoint {re.escape(str(directory / SECOND))}: "
        rf"writing {re.escape(where)} failed: {NO_SPACE}\b.*It was never published: its "
        rf"temporary directory is removed.*last\.json still names '{FIRST}'",
    ):
        await trainer.fit(module, train, val)
    assert disk.failed
    assert _names(directory) == [FIRST, "last.json"]
    assert _step(directory) == 2


async def test_a_full_disk_at_a_sharded_checkpoints_pointer(disk: FullDisk, tmp_path: Path) -> None:
    trainer = await _trained()
    directory = tmp_path / "ckpt"
    writer = ShardedCheckpointWriter()
    writer.save(trainer, directory / "a.ckpt", update_last=True).wait()
    disk.full = lambda path: path.name.startswith(".last.json.tmp-")
    pointer = re.escape(str(directory / "last.json"))
    with pytest.raises(
        CheckpointError,
        match=rf"the sharded checkpoint {re.escape(str(directory / 'b.ckpt'))} is complete, "
        rf"but the pointer {pointer} could not be moved to it: {NO_SPACE}\b.*loads by its "
        rf"path; {pointer} still names 'a\.ckpt'\.",
    ):
        writer.save(trainer, directory / "b.ckpt", update_last=True).wait()
    assert _names(directory) == ["a.ckpt", "b.ckpt", "last.json"]
    assert _pointer(directory) == "a.ckpt"
    assert _step(directory) == _step(directory / "b.ckpt") == 4


# ---------------------------------------------------------------- a real, small disk


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 384 KiB tmpfs, where this process may mount one (root on Linux, with ``mount``
    available and allowed); the test is skipped elsewhere."""
    mount = tmp_path / "small"
    mount.mkdir()
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("needs mount(8) to make a small file system")
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=384k", "tmpfs", str(mount)],
            capture_output=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)], check=False, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(mount)], check=False, timeout=30)


@pytest.mark.external
async def test_a_real_full_file_system(small_disk: Path) -> None:
    trainer = await _trained(max_steps=2)
    state = trainer.state_dict()
    first = loopbus.write_checkpoint(state, small_disk / "a.ckpt", update_last=True)
    big = dict(state, **{"user/big": {"t": torch.zeros(256 * 1024)}})  # 1 MiB
    with pytest.raises(
        CheckpointError,
        match=rf"could not write the checkpoint {re.escape(str(small_disk / 'b.ckpt'))}: "
        rf"{NO_SPACE}\b.*nothing was written under that name",
    ) as caught:
        loopbus.write_checkpoint(big, small_disk / "b.ckpt", update_last=True)
    assert "unexpected pos" not in str(caught.value)
    # Sharded: a module too wide for what is left.
    wide = Net(hidden=16384)
    wide_trainer = await _trained(wide, max_steps=1)
    with pytest.raises(
        CheckpointError,
        match=rf"the sharded checkpoint {re.escape(str(small_disk / 'wide.ckpt'))}: "
        rf"(writing loopbus_state\.pt failed: )?{NO_SPACE}\b",
    ):
        ShardedCheckpointWriter().save(wide_trainer, small_disk / "wide.ckpt").wait()
    assert _names(small_disk) == ["a.ckpt", "a.ckpt.complete", "last.json"]
    assert loopbus.load_checkpoint(small_disk)["loopbus"]["global_step"] == 2
    assert loopbus.latest_checkpoint(small_disk) == first
