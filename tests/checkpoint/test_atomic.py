"""Atomic checkpoint writes: an interrupted write (an error, or the writer SIGKILLed in
the middle of the file) never replaces the previous good checkpoint, and ``last`` still
loads."""

from __future__ import annotations

import multiprocessing
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import loopbus
from loopbus import CheckpointError, Trainer
from loopbus.plugins import Checkpoint
from tests.ckpt_scenario import Net, make_data, write_then_die


async def _trained(max_steps: int = 2) -> Trainer:
    loopbus.seed_everything(0)
    module = Net()
    train, val = make_data("plain", n_train=64)
    trainer = Trainer(max_steps=max_steps, plugins=[], device="cpu")
    await trainer.fit(module, train, val)
    return trainer


def _same_module(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(a["module"][k], v) for k, v in b["module"].items())


@pytest.mark.parametrize("second", ["a.ckpt", "b.ckpt"], ids=["overwrite", "new-file"])
async def test_a_write_that_fails_midway_leaves_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, second: str
) -> None:
    trainer = await _trained()
    good = loopbus.write_checkpoint(trainer.state_dict(), tmp_path / "a.ckpt", update_last=True)
    before = loopbus.load_checkpoint(good)
    real_save = torch.save

    def half_then_disk_full(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        import io

        buffer = io.BytesIO()
        real_save(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        f.write(data[: len(data) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", half_then_disk_full)
    second_state = trainer.state_dict()
    second_state["loopbus"]["global_step"] += 5  # recognisably different
    kept = (
        "the previous checkpoint at that path is unchanged"
        if second == "a.ckpt"
        else "nothing was written under that name"
    )
    with pytest.raises(
        CheckpointError,
        match=rf"could not write the checkpoint .*{second}: No space left on device.*"
        rf"Nothing was replaced: {kept}\. .*last\.json still names 'a\.ckpt'",
    ):
        loopbus.write_checkpoint(second_state, tmp_path / second, update_last=True)
    monkeypatch.undo()

    names = sorted([p.name async for p in anyio.Path(tmp_path).iterdir()])
    assert names == ["a.ckpt", "a.ckpt.complete", "last.json"]
    assert loopbus.latest_checkpoint(tmp_path) == good
    after = loopbus.load_checkpoint(tmp_path)  # through last.json, checked against the marker
    assert after["loopbus"]["global_step"] == before["loopbus"]["global_step"] == 2
    assert _same_module(after, before)


@pytest.fixture(scope="module")
def forkserver() -> Any:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tests.ckpt_scenario"])
    return context


@pytest.mark.external
@pytest.mark.slow
@pytest.mark.parametrize("second", ["a.ckpt", "b.ckpt"], ids=["overwrite", "new-file"])
def test_a_writer_killed_mid_file_leaves_the_previous_checkpoint(
    tmp_path: Path, forkserver: Any, second: str
) -> None:
    die_after = 20_000
    proc = forkserver.Process(target=write_then_die, args=(str(tmp_path), second, die_after))
    proc.start()
    proc.join(timeout=120)
    assert proc.exitcode == -signal.SIGKILL

    torn = [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert len(torn) == 1
    assert torn[0].name.startswith(f".{second}.tmp-{proc.pid}-")
    assert torn[0].stat().st_size == die_after, "the write was not interrupted mid-file"
    # The torn file never took a checkpoint's name, and the pointer still names a.ckpt.
    names = sorted(p.name for p in tmp_path.iterdir() if ".tmp-" not in p.name)
    assert names == ["a.ckpt", "a.ckpt.complete", "last.json"]
    assert loopbus.latest_checkpoint(tmp_path) == tmp_path / "a.ckpt"
    state = loopbus.load_checkpoint(tmp_path)
    assert state["loopbus"]["global_step"] == 2

    # Resuming from last works, and the torn temporary of the dead writer is cleaned up.
    loopbus.seed_everything(0)
    module = Net()
    train, val = make_data("plain")
    trainer = Trainer(max_steps=4, plugins=[Checkpoint(tmp_path, every_n_steps=1)], device="cpu")
    # a.ckpt was written without a Checkpoint plugin, so its state is missing: load the rest.
    with pytest.warns(UserWarning, match=r"(?s)ckpt_strict=False.*plugins/Checkpoint"):
        loopbus.run(trainer.fit, module, train, val, ckpt_path="last", ckpt_strict=False)
    # a.ckpt was taken when that fit ended (max_steps=2), which closed its epoch.
    assert trainer.global_step == 4
    assert trainer.current_epoch == 1
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


async def test_a_checkpoint_without_its_marker_still_loads(tmp_path: Path) -> None:
    trainer = await _trained()
    path = trainer.save_checkpoint(tmp_path / "x.ckpt")
    (tmp_path / "x.ckpt.complete").unlink()
    assert loopbus.load_checkpoint(path)["loopbus"]["global_step"] == 2
    # Without a pointer, the newest complete checkpoint (with a marker) is "last"; the
    # file without one is skipped, with a warning that says so.
    skipped = r"x\.ckpt: it has no completeness marker x\.ckpt\.complete"
    with pytest.warns(UserWarning, match=rf"{skipped}.*no complete checkpoint is left"):
        assert loopbus.latest_checkpoint(tmp_path) is None
    second = trainer.save_checkpoint(tmp_path / "y.ckpt")
    with pytest.warns(UserWarning, match=rf"{skipped}.*y\.ckpt, is taken instead"):
        assert loopbus.latest_checkpoint(tmp_path) == second


async def test_marker_records_size_and_checksum(tmp_path: Path) -> None:
    import json
    import zlib

    trainer = await _trained()
    path = trainer.save_checkpoint(tmp_path / "x.ckpt")
    marker = json.loads((tmp_path / "x.ckpt.complete").read_text())
    data = path.read_bytes()
    assert marker["size"] == len(data)
    assert marker["crc32"] == zlib.crc32(data)
    assert marker["global_step"] == 2
    assert marker["format_version"] == 2
