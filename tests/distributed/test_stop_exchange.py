"""How DDP ranks agree on a stop without a collective per step (``StopExchange``),
simulated here with ranks stepping in lockstep and an all-reduce (MAX) between them: the
check schedule is the same on every rank even when their paces differ, a stop asked on
one rank stops all of them at the same boundary, within two intervals (at the next
boundary but one with ``interval=0``), the number of all-reduces follows time, not
steps, and the rare boundaries read what is in flight. The torchrun tests in
``tests/distributed/test_ddp.py`` run the same exchange over gloo."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from loopbus import Module
from loopbus.distributed._ddp import TrainingStepAdapter
from loopbus.distributed._stopping import StopExchange
from loopbus.state._runstate import RunState


class World:
    """An all-reduce (MAX, in place) among ``n`` simulated ranks: the i-th reduce of
    every rank is one collective; waiting needs every rank to have started it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.started: list[list[torch.Tensor]] = [[] for _ in range(n)]
        self.buffers: list[list[torch.Tensor]] = [[] for _ in range(n)]

    def reducer(self, rank: int) -> Any:
        def reduce(buf: torch.Tensor) -> Work:
            self.started[rank].append(buf.clone())
            self.buffers[rank].append(buf)
            return Work(self, rank, len(self.started[rank]) - 1)

        return reduce


@dataclass
class Work:
    world: World
    rank: int
    index: int
    waited: bool = field(default=False)

    def wait(self) -> None:
        world = self.world
        assert not self.waited, "a collective is waited twice"
        assert all(len(s) > self.index for s in world.started), "waited before every rank began"
        result = torch.stack([s[self.index] for s in world.started]).amax(dim=0)
        world.buffers[self.rank][self.index].copy_(result)
        self.waited = True


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Rank:
    state: RunState
    clock: Clock
    exchange: StopExchange
    countdowns: list[int] = field(default_factory=list)


def ranks(n: int, interval: float, world: World | None = None) -> tuple[World, list[Rank]]:
    world = world or World(n)
    out = []
    for r in range(n):
        state = RunState()
        state.begin_stage("fit")
        state.make_stop_collective()
        clock = Clock()
        exchange = StopExchange(
            interval, world.reducer(r), lambda s: s.confirm_stop("agreed"), clock=clock
        )
        out.append(Rank(state, clock, exchange))
    return world, out


def run(
    group: list[Rank],
    paces: list[float],
    boundaries: int,
    ask: tuple[int, int] | None = None,
) -> int | None:
    """Boundary 0, then a step and a boundary per rank, in lockstep; ``ask=(rank, b)``:
    that rank asks to stop just before boundary ``b``. Returns the boundary where every
    rank stopped (None: none did), after checking that they all stop together."""
    for b in range(boundaries):
        for r, (rank, pace) in enumerate(zip(group, paces, strict=True)):
            if b > 0:
                rank.clock.now += pace  # this rank's step
            if ask == (r, b):
                rank.state.request_stop(f"rank {r} asked")
            rank.exchange.boundary(rank.state)
            rank.countdowns.append(rank.exchange.steps_to_next_check)
        stopped = [rank.state.stop_requested for rank in group]
        assert len(set(stopped)) == 1, f"ranks disagree at boundary {b}: {stopped}"
        if stopped[0]:
            return b
    return None


def test_every_boundary_with_interval_zero_stops_one_boundary_after_the_request() -> None:
    world, group = ranks(2, 0.0)
    assert run(group, [0.001, 0.003], 50, ask=(1, 10)) == 11
    assert all(rank.state.stop_reason == "agreed" for rank in group)
    # One all-reduce per boundary, none after the stop.
    assert [len(s) for s in world.started] == [11, 11]


@pytest.mark.parametrize("ask_at", [3, 40, 41, 77, 150])
@pytest.mark.parametrize("paces", [[0.001, 0.001], [0.001, 0.002], [0.004, 0.0005]])
def test_a_request_on_one_rank_stops_every_rank_within_two_intervals(
    paces: list[float], ask_at: int
) -> None:
    interval = 0.05
    _, group = ranks(2, interval)
    stopped = run(group, paces, 2000, ask=(1, ask_at))
    assert stopped is not None
    steps = round(interval / max(paces))  # the agreed interval: the slower rank's
    assert ask_at <= stopped <= ask_at + 2 * steps + 1
    # The same schedule on every rank, whatever its own pace.
    assert group[0].countdowns == group[1].countdowns


def test_the_schedule_follows_the_slowest_rank_and_time_not_steps() -> None:
    world, group = ranks(3, 0.05)
    assert run(group, [0.001, 0.002, 0.0025], 4000) is None
    # 0.05 s at the slowest rank's 2.5 ms a step: a check every 20 boundaries once the
    # pace is known (the first checks come sooner while it is measured).
    assert group[0].countdowns[-1] <= 20
    assert max(group[0].countdowns) == 20
    checks = len(world.started[0])
    assert 4000 / 20 <= checks <= 4000 / 20 + 10
    assert all(len(s) == checks for s in world.started)
    # Nobody asked: every exchange carried 0 and the proposals.
    assert all(int(buf[0]) == 0 for s in world.started for buf in s)


def test_a_pace_change_moves_the_schedule_on_every_rank_alike() -> None:
    _, group = ranks(2, 0.05)
    run(group, [0.001, 0.001], 500)
    assert group[0].countdowns[-1] <= 50
    run(group, [0.01, 0.01], 200)  # steps ten times slower (say, a larger batch)
    assert max(group[0].countdowns[-100:]) == 5
    assert group[0].countdowns == group[1].countdowns


def test_very_fast_steps_are_capped_and_a_still_clock_checks_every_boundary() -> None:
    _, group = ranks(2, 0.05)
    run(group, [1e-9, 1e-9], 6)
    assert max(group[0].countdowns) == StopExchange.MAX_STEPS
    _, group = ranks(2, 0.05)
    run(group, [0.0, 0.0], 6)  # no pace to go by
    assert group[0].countdowns == [1] * 6


def test_settle_reads_the_exchange_in_flight_and_checks_at_the_next_boundary() -> None:
    _, group = ranks(2, 0.05)
    assert run(group, [0.001, 0.001], 120) is None
    assert all(rank.exchange.in_flight for rank in group)
    group[0].state.request_stop("rank 0 asked")
    # Asked after the last exchange started: settling reads that exchange (no request
    # in it) and leaves the request to the blocking exchange the strategy does next.
    for rank in group:
        rank.exchange.settle(rank.state)
        assert not rank.exchange.in_flight
        assert rank.exchange.steps_to_next_check == 1
    assert not any(rank.state.stop_requested for rank in group)
    # The next boundary starts a new exchange, carrying the request; the one after
    # reads it.
    assert run(group, [0.001, 0.001], 3) == 1


def test_settle_agrees_on_a_request_the_exchange_in_flight_carries() -> None:
    _, group = ranks(2, 0.0)
    group[1].state.request_stop("rank 1 asked")
    for rank in group:
        rank.exchange.boundary(rank.state)  # starts an exchange carrying the request
    for rank in group:
        rank.exchange.settle(rank.state)
    assert all(rank.state.stop_requested for rank in group)


def test_reset_drops_what_a_stage_left_in_flight() -> None:
    _, group = ranks(1, 0.05)
    run(group, [0.001], 10)
    exchange = group[0].exchange
    assert exchange.in_flight
    exchange.reset()
    assert not exchange.in_flight
    assert exchange.steps_to_next_check == 1


class Tiny(Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    def training_step(self, batch: Any, ctx: Any) -> Any:
        return {"loss": self.layer(batch).pow(2).mean(), "extra": ctx}


def test_the_adapter_is_the_training_step_and_adds_no_parameter() -> None:
    module = Tiny()
    adapter = TrainingStepAdapter(module)
    batch = torch.randn(4, 3)
    out = adapter(batch, "ctx")
    assert out["extra"] == "ctx"
    assert torch.equal(out["loss"], module.training_step(batch, None)["loss"])
    assert list(adapter.parameters()) == list(module.parameters())
