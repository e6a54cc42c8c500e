"""One epoch numbering everywhere: ``trainer.current_epoch`` (0-based) in records,
events, checkpoint file names and the progress bar's lines."""

from __future__ import annotations

import io
import os
import re
from pathlib import Path
from typing import Any

import torch

import loopbus
from loopbus import Plugin, Trainer, on
from loopbus.events import EpochCompleted, PutRecord
from loopbus.loop import Counters
from loopbus.plugins import Checkpoint, ProgressBar
from tests.helpers import TinyModule, make_loader


class EpochPutter(TinyModule):
    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        self.put("seen/epoch", self.trainer.current_epoch)
        return super().training_step(batch, ctx)


class Notes(Plugin):
    def __init__(self) -> None:
        self.record_epochs: set[tuple[int, int]] = set()  # (record.epoch, value put)
        self.event_epochs: list[int] = []

    @on(PutRecord)
    def record(self, record: PutRecord) -> None:
        if record.name == "seen/epoch":
            self.record_epochs.add((record.epoch, int(record.value)))

    @on(EpochCompleted)
    def epoch(self, event: EpochCompleted) -> None:
        self.event_epochs.append(event.epoch)


async def test_bar_file_name_record_and_event_agree_on_each_epoch(tmp_path: Path) -> None:
    out = io.StringIO()
    notes = Notes()
    checkpoint = Checkpoint(tmp_path, every_n_epochs=1, keep_last=None)
    trainer = Trainer(
        max_epochs=3, plugins=[ProgressBar(file=out), checkpoint, notes], device="cpu"
    )
    await trainer.fit(EpochPutter(), make_loader(n=32), make_loader(n=16))
    assert trainer.current_epoch == 2  # the last of epochs 0, 1, 2

    bar = [int(m.group(1)) for m in re.finditer(r"^Epoch (\d+)/2 \|", out.getvalue(), re.M)]
    names = sorted(n for n in os.listdir(tmp_path) if n.endswith(".ckpt"))
    by_epoch = {int(m.group(1)): n for n in names if (m := re.match(r"epoch=(\d+)-", n))}
    files = sorted(by_epoch)
    assert bar == files == notes.event_epochs == [0, 1, 2]
    # Records carry the epoch trainer.current_epoch had when they were put.
    assert notes.record_epochs == {(0, 0), (1, 1), (2, 2)}
    # A checkpoint named epoch=N holds run state epoch N, and records of epoch N.
    for epoch, name in by_epoch.items():
        state = loopbus.load_checkpoint(tmp_path / name)
        assert state["run"]["epoch"] == epoch
        assert state["records"]["seen/epoch"]["epoch"] == epoch
        assert state["records"]["seen/epoch"]["value"] == epoch


async def test_stop_line_names_the_epoch_as_current_epoch_does() -> None:
    out = io.StringIO()

    class StopAfterFirst(Plugin):
        def __init__(self) -> None:
            self.trainer: Trainer | None = None

        def setup(self, trainer: Trainer, stage: str) -> None:
            self.trainer = trainer

        @on(EpochCompleted)
        def enough(self, event: EpochCompleted) -> None:
            assert self.trainer is not None
            self.trainer.request_stop("enough")

    trainer = Trainer(max_epochs=5, plugins=[ProgressBar(file=out), StopAfterFirst()], device="cpu")
    await trainer.fit(TinyModule(), make_loader(n=32))
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("Epoch 0/4 |")
    assert lines[-1] == f"Stopped at epoch {trainer.current_epoch}, step 2: enough"
    assert trainer.current_epoch == 0


def test_progress_skips_on_to_a_later_iteration_and_never_back() -> None:
    # A fault-tolerant group that healed into a later epoch: the fit loop's counters
    # move on to the peer's epoch (the one in flight), as if the epochs between ran.
    counters = Counters()
    counters.ready = counters.started = counters.processed = 1  # epoch 0 in flight
    counters.skip_to(3)
    assert counters.state_dict() == {"ready": 4, "started": 4, "processed": 4, "completed": 3}
    counters.skip_to(1)
    assert counters.ready == 4
