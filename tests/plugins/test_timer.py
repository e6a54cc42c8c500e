from __future__ import annotations

import io
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from loopbus import Trainer
from loopbus.events import FitStarted
from loopbus.plugins import Timer
from tests.helpers import TinyModule, make_loader


class Slow(TinyModule):
    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        time.sleep(0.01)
        return super().training_step(batch, ctx)


class Watched(Slow):
    """Counts the steps that begin after a stop was requested."""

    def __init__(self) -> None:
        super().__init__()
        self.begun_after_stop = 0

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        self.begun_after_stop += self.trainer.should_stop
        return super().training_step(batch, ctx)


async def test_stops_fit_when_the_budget_runs_out() -> None:
    timer = Timer(0.3)
    trainer = Trainer(max_epochs=1000, plugins=[timer], device="cpu")
    module = Watched()
    await trainer.fit(module, make_loader(n=64))
    assert trainer.should_stop
    assert 0 < trainer.global_step < 1000 * 4
    assert trainer.stop_reason is not None
    assert trainer.stop_reason.startswith("Timer: the time budget of 0:00:00 ran out")
    # The Timer's request is honoured at the next step boundary: no step begins after it.
    assert module.begun_after_stop == 0
    assert timer.time_elapsed("fit") >= 0.3
    assert timer.expired
    assert timer.time_remaining() == 0


async def test_epoch_interval_finishes_the_epoch() -> None:
    timer = Timer(0.05, interval="epoch")
    trainer = Trainer(max_epochs=1000, plugins=[timer], device="cpu")
    await trainer.fit(Slow(), make_loader(n=160))  # 10 steps of >= 10 ms per epoch
    assert trainer.global_step == 10
    assert trainer.stop_reason is not None


async def test_a_resumed_run_gets_the_rest_of_the_budget() -> None:
    timer = Timer({"hours": 1})
    trainer = Trainer(max_steps=20, plugins=[timer], device="cpu")
    await trainer.fit(Slow(), make_loader(n=160))
    spent = timer.time_elapsed("fit")
    assert spent >= 0.2  # 20 steps of >= 10 ms
    assert not trainer.should_stop
    buffer = io.BytesIO()
    torch.save(timer.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    budget = spent + 1.0  # a second more than the first run spent
    resumed = Timer(budget)
    resumed.load_state_dict(state)
    assert resumed.time_elapsed("fit") == pytest.approx(spent)
    trainer = Trainer(max_epochs=1000, plugins=[resumed], device="cpu")
    remaining: list[float | None] = []
    trainer.subscribe(FitStarted, lambda event: remaining.append(resumed.time_remaining()))
    await trainer.fit(Slow(), make_loader(n=160))
    # The rest of the budget, not a fresh one: the run starts with at most that second.
    assert remaining[0] is not None
    assert remaining[0] <= budget - spent
    assert trainer.stop_reason is not None
    assert resumed.time_elapsed("fit") >= budget

    # A budget already spent stops the run before its first step.
    spent_up = Timer(0.5)
    spent_up.load_state_dict({"time_elapsed": {"fit": 0.6}})
    trainer = Trainer(max_epochs=1000, plugins=[spent_up], device="cpu")
    await trainer.fit(Slow(), make_loader(n=160))
    assert trainer.global_step == 0
    assert trainer.stop_reason is not None


async def test_measures_every_stage_without_a_budget() -> None:
    timer = Timer()
    trainer = Trainer(max_steps=3, plugins=[timer], device="cpu")
    module = Slow()
    await trainer.fit(module, make_loader(n=64))
    await trainer.validate(module, make_loader(n=64))
    assert timer.time_elapsed("fit") >= 0.03
    assert timer.time_elapsed("validate") > 0
    assert timer.time_remaining() is None
    assert not timer.expired
    assert set(timer.state_dict()["time_elapsed"]) == {"fit", "validate", "test", "predict"}


def test_durations_are_parsed() -> None:
    assert Timer("00:12:00:00").duration == 12 * 3600
    assert Timer(timedelta(minutes=2)).duration == 120
    assert Timer({"hours": 1, "minutes": 30}).duration == 5400
    assert Timer(90).duration == 90
    with pytest.raises(ValueError, match="'DD:HH:MM:SS'"):
        Timer("12h")
    with pytest.raises(ValueError, match="positive, finite"):
        Timer(0)
    with pytest.raises(ValueError, match="timedelta's keys"):
        Timer({"fortnights": 1})
    with pytest.raises(ValueError, match=r"interval=.*got 'batch'"):
        Timer(10, interval="batch")  # type: ignore[arg-type]
