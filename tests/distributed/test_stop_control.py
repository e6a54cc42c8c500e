"""The stop control: the one place where stop requests become a stop. In one process a
request takes effect at the next boundary and the loops run nothing between batches;
under a distributed strategy the control exchanges requests over the strategy's
transport on its own schedule (never from a loop's ``done``), agrees on who asked, and
settles at the rare boundaries. A strategy that still implements the old per-strategy
stop methods is refused with the fix."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loopbus import Strategy, Trainer
from loopbus.distributed import StopTransport
from loopbus.distributed._stopping import StopControl
from loopbus.events import TrainBatchCompleted
from loopbus.state._runstate import RunState
from tests.helpers import TinyModule, make_loader


class _Done:
    def wait(self) -> None:
        pass


class FakeWire:
    """A world of one rank seen through a transport: every reduce is recorded; another
    rank's request is simulated by ``other_asks``."""

    def __init__(self, interval: float = 0.0) -> None:
        self.interval = interval
        self.started: list[list[int]] = []
        self.blocking: list[int] = []
        self.gathered: list[str | None] = []
        self.other_asks: str | None = None

    def transport(self) -> StopTransport:
        return StopTransport(
            interval=self.interval,
            rank=0,
            start_max=self.start_max,
            max_now=self.max_now,
            gather=self.gather,
        )

    def start_max(self, buf: torch.Tensor) -> _Done:
        self.started.append(buf.tolist())
        if self.other_asks is not None:
            buf[0] = 1
        return _Done()

    def max_now(self, flag: torch.Tensor) -> None:
        self.blocking.append(int(flag[0]))
        if self.other_asks is not None:
            flag[0] = 1

    def gather(self, reason: str | None) -> list[str | None]:
        self.gathered.append(reason)
        return [reason, self.other_asks]


def _stage(transport: StopTransport | None) -> tuple[RunState, StopControl]:
    state = RunState()
    state.begin_stage("fit")
    control = StopControl(state)
    control.begin(transport)
    return state, control


def test_in_one_process_a_request_stops_at_once_and_nothing_runs_between_batches() -> None:
    state, control = _stage(None)
    assert control.boundary is None
    control.settle()  # nothing to agree with
    control.request("enough")
    assert state.stop_requested
    assert state.stop_reason == "enough"
    assert state.pending_stop is None


def test_a_collective_request_waits_for_the_exchange_then_every_rank_agrees() -> None:
    wire = FakeWire(interval=0.0)
    state, control = _stage(wire.transport())
    assert control.boundary is not None
    control.boundary()  # boundary 0: the first exchange starts, nothing asked
    control.request("mine")
    assert not state.stop_requested
    assert state.pending_stop == "mine"
    control.boundary()  # reads the first exchange (empty), starts one carrying "mine"
    assert not state.stop_requested
    control.boundary()  # reads it: agreed
    assert state.stop_requested
    assert state.stop_reason == "mine"
    assert wire.gathered == ["mine"]
    assert [buf[0] for buf in wire.started] == [0, 1]


def test_another_ranks_request_is_named_with_its_rank() -> None:
    wire = FakeWire(interval=0.0)
    state, control = _stage(wire.transport())
    wire.other_asks = "EarlyStopping: no improvement"
    control.settle()  # a rare boundary: one blocking exchange
    assert wire.blocking == [0]
    assert state.stop_requested
    assert state.stop_reason == "EarlyStopping: no improvement (on rank 1)"


def test_settle_after_an_agreed_stop_exchanges_nothing_more() -> None:
    wire = FakeWire(interval=0.0)
    state, control = _stage(wire.transport())
    control.request("mine")
    control.settle()
    assert state.stop_requested
    assert wire.blocking == [1]
    control.settle()
    assert wire.blocking == [1]


def test_end_forgets_the_transport() -> None:
    wire = FakeWire()
    _, control = _stage(wire.transport())
    control.end()
    assert control.boundary is None
    control.settle()
    assert wire.blocking == []


async def test_the_loops_done_never_exchanges() -> None:
    """Reading ``done`` as often as one likes starts no exchange: the control's boundary
    runs once before the first batch and once after each."""
    wire = FakeWire(interval=0.0)

    class Wired(Strategy):
        def stop_transport(self) -> StopTransport:
            return wire.transport()

    trainer = Trainer(max_steps=5, plugins=[], device="cpu", strategy=Wired())
    reads: list[bool] = []

    def on_batch(event: TrainBatchCompleted) -> None:
        loop = trainer.fit_loop.epoch_loop
        before = len(wire.started)
        reads.extend(loop.done for _ in range(3))
        assert len(wire.started) == before

    trainer.subscribe(TrainBatchCompleted, on_batch)
    await trainer.fit(TinyModule(), make_loader(128, 16))
    assert trainer.global_step == 5
    assert len(wire.started) == 6  # boundary 0, then one after each of the first 5 batches
    assert wire.blocking == [0, 0]  # before the epoch and after it (no request)


async def test_a_stop_asked_on_another_rank_stops_this_run_at_the_agreed_boundary() -> None:
    wire = FakeWire(interval=0.0)

    class Wired(Strategy):
        def stop_transport(self) -> StopTransport:
            return wire.transport()

    trainer = Trainer(max_epochs=1, plugins=[], device="cpu", strategy=Wired())

    def on_batch(event: TrainBatchCompleted) -> None:
        if event.batch_idx == 2:
            wire.other_asks = "stop (rank 1)"

    trainer.subscribe(TrainBatchCompleted, on_batch)
    await trainer.fit(TinyModule(), make_loader(160, 16))
    # Asked after batch 2; the exchange started at that boundary carries it; the next
    # boundary reads it.
    assert trainer.global_step == 4
    assert trainer.stop_reason == "stop (rank 1) (on rank 1)"


def test_a_strategy_with_the_old_stop_methods_is_refused_with_the_fix() -> None:
    with pytest.raises(TypeError, match=r"stop_transport\(\)"):

        class Old(Strategy):
            def exchange_stop(self, state: Any) -> None:
                pass

    assert Strategy().stop_transport() is None
