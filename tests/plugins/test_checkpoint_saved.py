"""The CheckpointSaved event: one per durable checkpoint file, in the order written."""

from __future__ import annotations

from pathlib import Path

import pytest

from loopbus import Plugin, Trainer, on
from loopbus.plugins import Checkpoint, CheckpointSaved
from tests.helpers import TinyModule, make_loader


def checkpoint_files(directory: Path) -> set[str]:
    return {p.name for p in directory.glob("*.ckpt")}


class Saved(Plugin):
    def __init__(self) -> None:
        self.events: list[tuple[CheckpointSaved, bool]] = []

    @on(CheckpointSaved)
    def keep(self, event: CheckpointSaved) -> None:
        # The file is durable when the event is delivered.
        self.events.append((event, Path(event.path).exists()))


@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
async def test_each_save_is_announced_once_its_file_is_durable(
    tmp_path: Path, background: bool
) -> None:
    saved = Saved()
    checkpoint = Checkpoint(
        tmp_path, every_n_steps=2, keep_last=2, background=background, save_on_end=False
    )
    trainer = Trainer(max_steps=8, plugins=[checkpoint, saved], device="cpu")
    await trainer.fit(TinyModule(), make_loader(n=64))

    events = [event for event, _ in saved.events]
    assert all(durable for _, durable in saved.events)
    assert [e.step for e in events] == [2, 4, 6, 8]
    assert [Path(e.path).name for e in events] == [
        f"epoch=0-step={s}.ckpt" if s <= 4 else f"epoch=1-step={s}.ckpt" for s in (2, 4, 6, 8)
    ]
    assert [e.epoch for e in events] == [0, 0, 1, 1]
    # keep_last=2: the third and fourth saves removed the first and second files.
    assert [e.removed for e in events] == [(), (), (events[0].path,), (events[1].path,)]
    assert not any(e.best for e in events)
    assert checkpoint_files(tmp_path) == {Path(e.path).name for e in events[2:]}


async def test_a_monitored_save_says_it_is_among_the_best(tmp_path: Path) -> None:
    saved = Saved()
    checkpoint = Checkpoint(tmp_path, monitor="val/loss", save_on_end=False)
    trainer = Trainer(max_epochs=2, plugins=[checkpoint, saved], device="cpu")
    await trainer.fit(TinyModule(), make_loader(n=64), make_loader(n=32))

    events = [event for event, _ in saved.events]
    assert events
    assert all(e.best for e in events)
    assert events[-1].path == str(checkpoint.best_checkpoint_path)
