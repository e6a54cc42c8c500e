"""Progress bar details: epoch rate and ETA, validation left out of the training rate,
stale records marked, summary lines wrapped between parts at 80 columns, a starting
status before the first batch."""

from __future__ import annotations

import io
import re
import time
from typing import Any

import pytest
import torch
from rich.console import Console

from loopbus import Loop, Trainer
from loopbus.plugins import ProgressBar
from loopbus.plugins._progress_bar import _Run, _wrap
from tests.helpers import TinyModule, make_loader

pytestmark = pytest.mark.anyio

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class _Dummy(Loop[None]):
    name = "dummy"


def test_epoch_rate_and_eta_are_measured_between_epochs() -> None:
    # 8 s of start-up, then epochs of 2.3 s; the bar is redrawn every 0.25 s, and
    # marks each epoch's end when it hears EpochCompleted.
    run = _Run(_Dummy(), completed=0, now=100.0)
    ends = [100.0 + 8 + 2.3 * k for k in range(1, 4)]  # epochs 1-3 end
    info = ""
    t = 100.0
    while t <= 116.0:
        for n, end in enumerate(ends, start=1):
            if t - 0.25 < end <= t:
                run.mark(n, end)
        done = sum(1 for end in ends if end <= t)
        info = run.info(done, 10, t)
        t = round(t + 0.25, 2)
    # At t = 116.0: 3 epochs done, 1.1 s into the 4th (it ended at 114.9).
    assert "3/10" in info
    assert "2.3 s/it" in info
    eta = float(re.search(r"eta ([\d.]+)s", info).group(1))  # type: ignore[union-attr]
    # 7 epochs of 2.3 s left, 1.1 s of the current one spent.
    assert eta == pytest.approx(7 * 2.3 - 1.1, abs=0.05)


def test_the_first_epoch_rate_includes_start_up_only_until_a_second_one() -> None:
    run = _Run(_Dummy(), completed=0, now=0.0)
    run.mark(1, 10.0)  # start-up and the first epoch
    assert "10.0 s/it" in run.info(1, 5, 10.5)
    run.mark(2, 12.0)
    assert "2.0 s/it" in run.info(2, 5, 12.5)


def test_a_paused_run_leaves_the_pause_out_of_its_rate() -> None:
    run = _Run(_Dummy(), completed=0, now=0.0)
    for i in range(1, 11):  # 10 batches a second
        run.mark(i, i * 0.1)
    run.pause(1.0)
    run.info(10, 40, 3.0)  # redraws while validation runs
    run.resume(6.0)  # five seconds of validation
    for i in range(11, 21):
        run.mark(i, 6.0 + (i - 10) * 0.1)
    info = run.info(20, 40, 7.0)
    assert "10.0 it/s" in info
    assert "eta 2.0s" in info
    assert "7.0s" in info  # elapsed is wall time


class SlowValidation(TinyModule):
    def validation_step(self, batch: Any, ctx: Any) -> None:
        time.sleep(0.05)
        super().validation_step(batch, ctx)


async def test_validation_time_is_not_in_the_train_bar() -> None:
    bar = ProgressBar(file=io.StringIO())
    runs: dict[str, _Run] = {}
    # For each validation batch: when the train run was paused, and the batch's span.
    batches: list[tuple[float | None, float, float]] = []

    class Watch(TinyModule):
        def validation_step(self, batch: Any, ctx: Any) -> None:
            runs.update(bar._running)
            start = time.monotonic()
            time.sleep(0.05)
            super().validation_step(batch, ctx)
            if "train" in bar._running:  # not the sanity check before it
                batches.append((bar._running["train"].paused_at, start, time.monotonic()))

    trainer = Trainer(max_epochs=1, val_check_interval=2, plugins=[bar], device="cpu")
    await trainer.fit(Watch(), make_loader(n=64), make_loader(n=32))
    train = runs["train"]
    # Two validations of two batches ran inside the epoch; the train run was paused
    # before each batch began, and resumed after: the time they took is left out of its
    # active time.
    assert len(batches) == 4
    for paused_at, start, _ in batches:
        assert paused_at is not None
        assert paused_at <= start
    assert train.paused_at is None
    assert train.excluded >= sum(end - start for _, start, end in batches) - 1e-9


async def test_a_stale_record_says_which_epoch_it_is_from() -> None:
    out = io.StringIO()
    trainer = Trainer(
        max_epochs=3, check_val_every_n_epoch=2, plugins=[ProgressBar(file=out)], device="cpu"
    )
    await trainer.fit(TinyModule(), make_loader(n=32), make_loader(n=32))
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert "val/loss" not in lines[0]  # no validation yet
    assert re.search(r"val/loss [\d.]+(  |$)", lines[1])  # this epoch's: unmarked
    # Epoch 1's (0-based, as the "Epoch N/M" text counts), shown in epoch 2's line.
    assert re.search(r"val/loss [\d.]+ \(epoch 1\)", lines[2])
    assert "(epoch" not in lines[2].split("val/loss")[0]  # train/loss is current


def test_wrap_breaks_between_parts_only() -> None:
    parts = ["Epoch 3/30", "23 batches in 0.4s (57.1 it/s), validation 0.1s", "step 69"]
    parts += [f"metric/{i} 0.{i}234" for i in range(6)]
    lines = _wrap(parts, 80)
    assert all(len(line) <= 80 for line in lines)
    assert len(lines) > 1
    joined = [p.strip() for line in lines for p in line.split(" | ")]
    assert joined == parts


class ManyMetrics(TinyModule):
    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        loss = super().training_step(batch, ctx)
        for i in range(6):
            self.put(f"train/metric_{i}", 0.123456 + i)
        return loss


async def test_summary_lines_wrap_between_parts_at_80_columns() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=80, color_system=None)
    trainer = Trainer(max_epochs=2, plugins=[ProgressBar(console=console)], device="cpu")
    await trainer.fit(ManyMetrics(), make_loader(n=32))
    text = ANSI.sub("", out.getvalue()).replace("\r", "\n")
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Epoch 0/1 | "))
    summary = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith("  "):
            break
        summary.append(line)
    assert len(summary) > 1
    assert all(len(line) <= 80 for line in summary)
    words = " | ".join(line.strip() for line in summary).split(" | ")
    # Every metric is whole on one line.
    for i in range(6):
        assert f"train/metric_{i} {0.123456 + i:.4g}" in words


async def test_a_starting_status_is_drawn_before_the_first_batch() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=80, color_system=None)
    drawn_before_first_batch: list[str] = []

    class FirstBatchSlow(TinyModule):
        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            if not drawn_before_first_batch:
                drawn_before_first_batch.append(ANSI.sub("", out.getvalue()))
            return super().training_step(batch, ctx)

    trainer = Trainer(max_epochs=1, plugins=[ProgressBar(console=console)], device="cpu")
    await trainer.fit(FirstBatchSlow(), make_loader(n=32))
    assert "Starting fit…" in drawn_before_first_batch[0]


def test_short_times_read_in_milliseconds() -> None:
    from loopbus.plugins._progress_bar import _fmt_time

    assert [_fmt_time(t) for t in (0.0, 0.0128, 0.094, 0.4, 59.94, 75, 3725)] == [
        "0s",
        "13ms",
        "94ms",
        "0.4s",
        "59.9s",
        "1:15",
        "1:02:05",
    ]
