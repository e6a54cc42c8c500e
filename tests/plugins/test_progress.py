from __future__ import annotations

import io
import os
import pty
import re
import threading
import time
from typing import Any

import pytest
import torch
from rich.console import Console

import loopbus
from loopbus import Plugin, Trainer, on
from loopbus.events import FitStarted
from loopbus.plugins import ModelSummary, ProgressBar
from tests.helpers import TinyModule, make_loader

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # anything but \t and \n


class SlowSteps(TinyModule):
    """Steps long enough for a few redraws; the loss also goes to the progress bar only."""

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        time.sleep(0.01)
        loss = super().training_step(batch, ctx)
        self.put("bar/only", 1.25, destinations="progress_bar")
        self.put("hidden", 3.0, destinations="loggers")
        return loss


async def test_not_a_terminal_writes_a_plain_line_per_epoch() -> None:
    out = io.StringIO()
    bar = ProgressBar(file=out)
    assert not bar.is_interactive
    trainer = Trainer(max_epochs=3, plugins=[bar], device="cpu")
    await trainer.fit(SlowSteps(), make_loader(n=32), make_loader(n=32))
    text = out.getvalue()
    assert not CONTROL.search(text), repr(text)
    lines = text.splitlines()
    assert len(lines) == 3
    for epoch, line in enumerate(lines):
        # Epochs are numbered from 0, as trainer.current_epoch counts them.
        assert line.startswith(f"Epoch {epoch}/2 | 2 batches in ")
        assert f"step {2 * (epoch + 1)}" in line
        assert "it/s" in line
        assert "validation" in line
        # Records addressed to the progress bar, and only those.
        assert "train/loss" in line
        assert "val/loss" in line
        assert "bar/only 1.25" in line
        assert "hidden" not in line


async def test_the_default_plugin_set_is_a_progress_bar_on_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    trainer = Trainer(max_epochs=2, device="cpu")
    assert [type(p) for p in trainer.plugins] == [ProgressBar, ModelSummary]
    assert Trainer(plugins=[], device="cpu").plugins == []
    await trainer.fit(TinyModule(), make_loader(n=32))
    captured = capsys.readouterr()
    assert captured.out == ""
    assert not CONTROL.search(captured.err)
    assert "Total params" in captured.err  # the model summary, first
    lines = [line for line in captured.err.splitlines() if line.startswith("Epoch ")]
    assert [line.split(" | ")[0] for line in lines] == ["Epoch 0/1", "Epoch 1/1"]


async def test_a_stop_request_is_reported_with_its_reason() -> None:
    class Stopper(Plugin):
        def setup(self, trainer: Trainer, stage: str) -> None:
            self.trainer = trainer

        @on(FitStarted)
        def soon(self, event: FitStarted) -> None:
            self.trainer.request_stop("patience ran out")

    out = io.StringIO()
    trainer = Trainer(max_epochs=5, plugins=[Stopper(), ProgressBar(file=out)], device="cpu")
    await trainer.fit(TinyModule(), make_loader(n=32))
    assert out.getvalue().splitlines()[-1] == "Stopped at epoch 0, step 0: patience ran out"


async def test_failures_and_evaluation_stages_get_a_line() -> None:
    class Crash(TinyModule):
        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            if self.trainer.global_step == 3:
                raise ValueError("bad batch")
            return super().training_step(batch, ctx)

    out = io.StringIO()
    trainer = Trainer(max_epochs=5, plugins=[ProgressBar(file=out)], device="cpu")
    module = Crash()
    with pytest.raises(ValueError, match="bad batch"):
        await trainer.fit(module, make_loader(n=64))
    assert out.getvalue().splitlines()[-1] == "fit failed at epoch 0, step 3"
    out.truncate(0)
    out.seek(0)
    await trainer.validate(module, make_loader(n=48))
    line = out.getvalue().splitlines()[0]  # then the results table
    assert line.startswith("Validate: 3 batches in ")
    assert "val/loss" in line


async def test_a_terminal_gets_bars_with_rate_eta_and_records() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=160, color_system=None)
    bar = ProgressBar(console=console, refresh_rate=50)
    assert bar.is_interactive
    trainer = Trainer(max_epochs=2, plugins=[bar], device="cpu")
    await trainer.fit(SlowSteps(), make_loader(n=160), make_loader(n=32))
    text = out.getvalue()
    assert "\x1b[" in text  # cursor movement: a live display
    drawn = "[━ ]+"  # no colours: the done part is drawn, the rest is blank
    assert re.search(rf"Epochs {drawn}0/2", text)
    # A rate in whichever unit reads better: an epoch (or, on a busy machine, a step)
    # may take more than a second.
    rate = r"[\d.]+ (it/s|s/it)"
    assert re.search(rf"Epochs {drawn}1/2  {rate}", text)
    assert re.search(
        rf"Train {drawn}\d+/10  {rate}  [\d.]+m?s  eta [\d.]+m?s  train/loss [\d.]+", text
    )
    assert "bar/only 1.25" in text
    assert "hidden" not in text
    # The per-epoch lines are printed above the bars as well.
    assert "Epoch 0/1 | 10 batches in" in text
    assert "Epoch 1/1 | 10 batches in" in text


def test_a_pseudo_terminal_is_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TERM", "xterm-256color")
    monkeypatch.delenv("FORCE_COLOR", raising=False)
    monkeypatch.delenv("TTY_COMPATIBLE", raising=False)
    master, slave = pty.openpty()
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    with os.fdopen(slave, "w", encoding="utf-8") as tty:
        bar = ProgressBar(file=tty, refresh_rate=50)
        assert bar.is_interactive
        trainer = Trainer(max_epochs=1, plugins=[bar], device="cpu")
        loopbus.run(trainer.fit, SlowSteps(), make_loader(n=160))
    reader.join(timeout=5)
    os.close(master)
    text = b"".join(chunks).decode("utf-8", "replace")
    assert "\x1b[" in text
    assert "Train" in text
    assert "Epoch 0/0 | 10 batches" in text
    # With TERM=dumb the same file gets plain lines.
    monkeypatch.setenv("TERM", "dumb")
    master, slave = pty.openpty()
    with os.fdopen(slave, "w") as tty:
        assert not ProgressBar(file=tty).is_interactive
    os.close(master)


async def test_the_bar_subscribes_to_no_per_step_event() -> None:
    seen: list[str] = []

    class Spy(Plugin):
        def setup(self, trainer: Trainer, stage: str) -> None:
            self.trainer = trainer

        @on(FitStarted)
        def look(self, event: FitStarted) -> None:
            seen.extend(
                s.event_type.__name__
                for s in self.trainer.bus.subscriptions
                if s.owner.startswith("ProgressBar")
            )

    out = io.StringIO()
    console = Console(file=out, force_terminal=True)
    trainer = Trainer(max_steps=2, plugins=[Spy(), ProgressBar(console=console)], device="cpu")
    await trainer.fit(TinyModule(), make_loader(n=32))
    assert sorted(seen) == [
        "EpochCompleted",
        "FitCompleted",
        "RunCompleted",
        "RunStarted",
        "Teardown",
    ]


def test_bad_options_are_reported() -> None:
    with pytest.raises(ValueError, match=r"refresh_rate=.*got 0"):
        ProgressBar(refresh_rate=0)
    with pytest.raises(ValueError, match="file= or console=, not both"):
        ProgressBar(file=io.StringIO(), console=Console())
