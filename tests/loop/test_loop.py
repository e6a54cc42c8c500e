from __future__ import annotations

from typing import Any

import pytest

from loopbus import EventBus, Loop, MisconfigurationError, Scope, StopLoop
from loopbus.events import (
    AdvanceCompleted,
    AdvanceStarted,
    Event,
    LoopEvent,
    RunCompleted,
    RunSkipped,
    RunStarted,
)


class CountLoop(Loop[list[int]]):
    """Counts to ``n``; collects the iteration indices in its run scope."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.n = n
        self.hooks: list[str] = []

    @property
    def done(self) -> bool:
        return self.progress.current.completed >= self.n

    async def on_run_start(self, ctx: Scope, *args: Any, **kwargs: Any) -> None:
        self.hooks.append("on_run_start")
        ctx.seen = []

    async def on_advance_start(self, ctx: Scope) -> None:
        self.hooks.append("on_advance_start")
        ctx.index = self.progress.current.ready - 1

    async def advance(self, ctx: Scope) -> None:
        self.hooks.append("advance")
        ctx.seen.append(ctx.index)  # reads the run scope through the iteration scope

    async def on_advance_end(self, ctx: Scope) -> None:
        self.hooks.append("on_advance_end")

    async def on_run_end(self, ctx: Scope) -> list[int]:
        self.hooks.append("on_run_end")
        return ctx.detach("seen")  # type: ignore[no-any-return]


class Outer(Loop[None]):
    def __init__(self) -> None:
        super().__init__()
        self.inner = CountLoop(2)

    @property
    def done(self) -> bool:
        return self.progress.current.completed >= 2

    async def advance(self, ctx: Scope) -> None:
        await self.inner.run(parent_ctx=ctx)


def record_all(bus: EventBus) -> list[tuple[str, str]]:
    got: list[tuple[str, str]] = []
    bus.subscribe(LoopEvent, lambda e: got.append((type(e).__name__, e.loop)))
    return got


async def test_every_hook_publishes_its_event_after_it_runs() -> None:
    loop = CountLoop(2)
    bus = EventBus()
    loop.attach(bus=bus)
    order: list[str] = []
    bus.subscribe(LoopEvent, lambda e: order.append(f"event:{type(e).__name__}"))
    original = loop.hooks
    loop.hooks = _Tee(original, order)  # type: ignore[assignment]
    output = await loop.run()
    assert output == [0, 1]
    assert order == [
        "hook:on_run_start",
        "event:RunStarted",
        "hook:on_advance_start",
        "event:AdvanceStarted",
        "hook:advance",
        "hook:on_advance_end",
        "event:AdvanceCompleted",
        "hook:on_advance_start",
        "event:AdvanceStarted",
        "hook:advance",
        "hook:on_advance_end",
        "event:AdvanceCompleted",
        "hook:on_run_end",
        "event:RunCompleted",
    ]


class _Tee(list[str]):
    def __init__(self, base: list[str], order: list[str]) -> None:
        super().__init__(base)
        self.order = order

    def append(self, item: str) -> None:
        super().append(item)
        self.order.append(f"hook:{item}")


async def test_event_payloads() -> None:
    loop = CountLoop(2)
    bus = EventBus()
    loop.attach(bus=bus)
    got: list[Any] = []
    bus.subscribe(LoopEvent, got.append)
    await loop.run()
    started = [e for e in got if type(e) is AdvanceStarted]
    assert [e.iteration for e in started] == [0, 1]
    assert all(e.loop == "count" for e in got)
    completed = [e for e in got if type(e) is RunCompleted]
    assert completed[0].output == [0, 1]


async def test_skip_calls_on_skip_and_publishes_run_skipped() -> None:
    class Skipper(CountLoop):
        @property
        def skip(self) -> bool:
            return True

        async def on_skip(self) -> str:
            return "skipped"

    loop = Skipper()
    bus = EventBus()
    loop.attach(bus=bus)
    got = []
    bus.subscribe(RunSkipped, got.append)
    assert await loop.run() == "skipped"
    assert loop.hooks == []
    assert got[0].output == "skipped"


async def test_stop_loop_ends_iterations_early() -> None:
    class Stopper(CountLoop):
        async def advance(self, ctx: Scope) -> None:
            if self.progress.current.ready == 2:
                raise StopLoop
            await super().advance(ctx)

    loop = Stopper(5)
    assert await loop.run() == [0]
    assert loop.progress.current.completed == 1


async def test_nested_loops_publish_with_their_names_and_share_the_bus() -> None:
    outer = Outer()
    bus = EventBus()
    outer.attach(bus=bus)
    got = record_all(bus)
    await outer.run()
    assert outer.inner.bus is bus
    assert got[:3] == [("RunStarted", "outer"), ("AdvanceStarted", "outer"), ("RunStarted", "count")]
    assert sum(1 for name, loop in got if name == "AdvanceCompleted" and loop == "count") == 4


def test_hooks_must_be_async_and_done_a_property() -> None:
    with pytest.raises(TypeError, match=r"Bad.advance must be `async def`"):

        class Bad(Loop[None]):
            def advance(self, ctx: Scope) -> None:  # type: ignore[override]
                pass

    with pytest.raises(TypeError, match=r"Bad2.done must be a property"):

        class Bad2(Loop[None]):
            def done(self) -> bool:  # type: ignore[override]
                return True


# ---------------------------------------------------------------- replace / connect
class OtherInner(CountLoop):
    """Same __init__ signature as CountLoop."""


class Leaf(CountLoop):
    pass


async def test_replace_by_class_keeps_arguments_and_children() -> None:
    outer = Outer()
    outer.inner.leaf = Leaf(1)  # type: ignore[attr-defined]
    outer.inner.n = 3
    old_leaf = outer.inner.leaf  # type: ignore[attr-defined]
    bus = EventBus()
    outer.attach(bus=bus)
    outer.replace(inner=OtherInner)
    assert type(outer.inner) is OtherInner
    assert outer.inner.n == 3  # built from the old loop's attributes
    assert outer.inner.leaf is old_leaf  # type: ignore[attr-defined]
    assert outer.inner.bus is bus
    got = record_all(bus)
    await outer.run()
    assert ("RunStarted", "other_inner") in got


def test_replace_by_instance_and_signature_mismatch() -> None:
    outer = Outer()
    new = OtherInner(7)
    outer.replace(inner=new)
    assert outer.inner is new

    class Different(Loop[None]):
        def __init__(self, a: int, b: int) -> None:
            super().__init__()

        @property
        def done(self) -> bool:
            return True

    with pytest.raises(MisconfigurationError, match=r"same __init__ signature"):
        outer.replace(inner=Different)
    with pytest.raises(MisconfigurationError, match=r"no sub-loop 'nope'"):
        outer.replace(nope=OtherInner)


# ---------------------------------------------------------------- state
async def test_state_dict_covers_progress_and_sub_loops() -> None:
    outer = Outer()
    await outer.run()
    state = outer.state_dict()
    assert state["progress"]["total"] == {"ready": 2, "started": 2, "processed": 2, "completed": 2}
    assert state["loops"]["inner"]["progress"]["total"]["completed"] == 4
    fresh = Outer()
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    assert fresh.restarting
    assert fresh.inner.restarting
    with pytest.raises(KeyError, match=r"does not match its sub-loops"):
        CountLoop().load_state_dict(state)


async def test_restart_rolls_back_the_in_flight_iteration() -> None:
    loop = CountLoop(4)
    state = loop.state_dict()
    state["progress"]["current"] = {"ready": 3, "started": 3, "processed": 2, "completed": 2}
    state["progress"]["total"] = {"ready": 3, "started": 3, "processed": 2, "completed": 2}
    loop.load_state_dict(state)
    output = await loop.run()
    # resumed at iteration 2 (the one in flight was redone), ran to 4
    assert output == [2, 3]
    assert loop.progress.total.completed == 4
    assert not loop.restarting


class Milestone(Event, frozen=True, kw_only=True):
    value: int


async def test_custom_events_from_a_custom_loop() -> None:
    class Publishing(CountLoop):
        async def on_advance_end(self, ctx: Scope) -> None:
            assert self.bus is not None
            await self.bus.publish(Milestone(value=ctx.index))

    loop = Publishing(3)
    bus = EventBus()
    loop.attach(bus=bus)
    got: list[int] = []
    bus.subscribe(Milestone, lambda e: got.append(e.value))
    await loop.run()
    assert got == [0, 1, 2]


def test_generic_events_are_the_bases_of_trainer_events() -> None:
    from loopbus.events import FitStarted, TrainBatchCompleted, ValidationCompleted

    assert issubclass(FitStarted, RunStarted)
    assert issubclass(TrainBatchCompleted, AdvanceCompleted)
    assert issubclass(ValidationCompleted, RunCompleted)
