from __future__ import annotations

import functools
from collections.abc import Generator
from typing import Any

import anyio
import pytest

from loopbus import HandlerError, SubscriptionError
from loopbus.events import (
    AdvanceCompleted,
    AfterBackward,
    Event,
    EventBus,
    PutRecord,
    TrainBatchCompleted,
    on,
)


class Ping(Event, frozen=True, kw_only=True):
    n: int = 0


class SubPing(Ping, frozen=True, kw_only=True):
    pass


def pings(n: int) -> list[Ping]:
    return [Ping(n=i) for i in range(1, n + 1)]


async def publish_all(bus: EventBus, events: list[Any]) -> None:
    for event in events:
        await bus.publish(event)


# ---------------------------------------------------------------- filters
@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({}, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]),
        ({"every": 3}, [3, 6, 9]),
        ({"once": 4}, [4]),
        ({"before": 4}, [1, 2, 3]),
        ({"after": 7}, [8, 9, 10]),
        ({"when": lambda e: e.n % 2 == 0}, [2, 4, 6, 8, 10]),
        ({"every": 2, "after": 4, "before": 9}, [6, 8]),
    ],
)
async def test_filters(options: dict[str, Any], expected: list[int]) -> None:
    bus = EventBus()
    got: list[int] = []
    bus.subscribe(Ping, lambda e: got.append(e.n), **options)
    await publish_all(bus, pings(10))
    assert got == expected


async def test_once_unsubscribes_itself() -> None:
    bus = EventBus()
    sub = bus.subscribe(Ping, lambda e: None, once=2)
    await publish_all(bus, pings(3))
    assert not sub.active
    assert sub not in bus.subscriptions


async def test_loop_filter_and_subclass_dispatch() -> None:
    bus = EventBus()
    generic: list[str] = []
    train_only: list[int] = []
    bus.subscribe(AdvanceCompleted, lambda e: generic.append(type(e).__name__))
    bus.subscribe(AdvanceCompleted, lambda e: train_only.append(e.batch_idx), loop="train")
    await bus.publish(TrainBatchCompleted(loop="train", batch_idx=3))
    await bus.publish(AdvanceCompleted(loop="custom"))
    assert generic == ["TrainBatchCompleted", "AdvanceCompleted"]
    assert train_only == [3]


async def test_priorities_and_sync_async_interleaved() -> None:
    bus = EventBus()
    order: list[str] = []

    async def a_low(e: Ping) -> None:
        await anyio.lowlevel.checkpoint()
        order.append("async-low")

    async def a_high(e: Ping) -> None:
        await anyio.lowlevel.checkpoint()
        order.append("async-high")

    bus.subscribe(Ping, lambda e: order.append("sync-mid"), priority=5)
    bus.subscribe(Ping, a_low, priority=-1)
    bus.subscribe(Ping, a_high, priority=10)
    bus.subscribe(Ping, lambda e: order.append("sync-low"), priority=-1)
    bus.subscribe(Ping, lambda e: order.append("sync-default"))
    await bus.publish(Ping())
    assert order == ["async-high", "sync-mid", "sync-default", "async-low", "sync-low"]


async def test_unsubscribe_handle_and_context_manager() -> None:
    bus = EventBus()
    got: list[int] = []
    sub = bus.subscribe(Ping, lambda e: got.append(e.n))
    await bus.publish(Ping(n=1))
    sub.unsubscribe()
    sub.unsubscribe()  # idempotent
    await bus.publish(Ping(n=2))
    with bus.subscribe(Ping, lambda e: got.append(-e.n)):
        await bus.publish(Ping(n=3))
    await bus.publish(Ping(n=4))
    assert got == [1, -3]
    assert bus.table[Ping] == ()


async def test_custom_events_without_registration() -> None:
    bus = EventBus()
    got: list[Any] = []
    bus.subscribe(Ping, got.append)
    await bus.publish(SubPing(n=7))
    assert got == [SubPing(n=7)]
    assert got[0].n == 7


def test_dispatch_table_is_built_at_subscribe_time() -> None:
    bus = EventBus()
    assert bus.table[Ping] == ()
    bus.subscribe(Ping, lambda e: None)
    entries = bus.table[Ping]
    assert len(entries) == 1
    # A second lookup is the same tuple: nothing is rebuilt per publish.
    assert bus.table[Ping] is entries


def test_the_entries_a_table_keeps_follow_every_subscription_change() -> None:
    # What the loops and the step read at every iteration: a plain dict (one specialized
    # lookup), rebuilt whenever the subscriptions change, never stale.
    bus = EventBus()
    kept = bus.table.keep(Ping)
    assert type(kept) is dict
    assert kept == {Ping: ()}
    sub = bus.subscribe(Ping, lambda e: None)
    assert len(kept[Ping]) == 1
    assert kept[Ping] is bus.table[Ping]
    # A subscription to a base class counts for the kept subclass too.
    assert bus.table.keep(SubPing) is kept
    bus.subscribe(Event, lambda e: None, priority=1)
    assert [entry[2].event_type for entry in kept[SubPing]] == [Event, Ping]
    sub.unsubscribe()
    assert [entry[2].event_type for entry in kept[Ping]] == [Event]
    # Types never kept are built on first use, as before.
    assert AfterBackward not in kept
    assert len(bus.table[AfterBackward]) == 1


async def test_put_records_are_routed_by_destination() -> None:
    bus = EventBus()
    seen: dict[str, list[str]] = {"callbacks": [], "loggers": [], "external": []}
    for role, names in seen.items():
        bus.subscribe(PutRecord, lambda r, names=names: names.append(r.name), destination=role)
    await bus.publish(PutRecord(name="a", value=1.0, destinations=("callbacks", "loggers")))
    await bus.publish(PutRecord(name="b", value=2.0, destinations=("external",)))
    assert seen == {"callbacks": ["a"], "loggers": ["a"], "external": ["b"]}


# ---------------------------------------------------------------- errors at subscribe time
def test_unknown_event_type_is_refused_with_a_hint() -> None:
    bus = EventBus()
    with pytest.raises(SubscriptionError, match=r"not strings.*TrainBatchCompleted"):
        bus.subscribe("on_train_batch_end", lambda e: None)  # type: ignore[arg-type]
    with pytest.raises(SubscriptionError, match=r"pass the event class, not an instance"):
        bus.subscribe(Ping(), lambda e: None)  # type: ignore[arg-type]
    with pytest.raises(SubscriptionError, match=r"is not an event type.*subclasses of"):
        bus.subscribe(int, lambda e: None)  # type: ignore[arg-type]


def test_wrong_handler_shapes_are_refused() -> None:
    bus = EventBus()

    async def handler(e: Ping) -> None:
        pass

    def two_args(a: Any, b: Any) -> None:
        pass

    def gen(e: Any) -> Any:
        yield e

    with pytest.raises(SubscriptionError, match=r"coroutine object.*not subscribe\(Event, handler\(\)\)"):
        bus.subscribe(Ping, handler(Ping()))  # type: ignore[arg-type]
    with pytest.raises(SubscriptionError, match=r"must be a callable.*got None"):
        bus.subscribe(Ping, None)  # type: ignore[arg-type]
    with pytest.raises(SubscriptionError, match=r"exactly one positional argument.*functools.partial"):
        bus.subscribe(Ping, two_args)
    with pytest.raises(SubscriptionError, match=r"generator function"):
        bus.subscribe(Ping, gen)
    # functools.partial is the documented way to pass extras
    bus.subscribe(Ping, functools.partial(two_args, b=1))


def test_bad_filters_are_refused() -> None:
    bus = EventBus()
    with pytest.raises(SubscriptionError, match=r"every must be an int >= 1, got 0"):
        bus.subscribe(Ping, lambda e: None, every=0)
    with pytest.raises(SubscriptionError, match=r"once must be an int >= 1, got 1.5"):
        bus.subscribe(Ping, lambda e: None, once=1.5)  # type: ignore[arg-type]
    with pytest.raises(SubscriptionError, match=r"loop='train' filters loop events"):
        bus.subscribe(Ping, lambda e: None, loop="train")
    with pytest.raises(SubscriptionError, match=r"overflow must be 'block'"):
        bus.subscribe(Ping, lambda e: None, mode="queued", overflow="oldest")  # type: ignore[arg-type]
    with pytest.raises(SubscriptionError, match=r"mode must be 'inline' .* or 'queued'"):
        bus.subscribe(Ping, lambda e: None, mode="later")  # type: ignore[arg-type]


def test_inside_step_events_need_sync_inline_handlers() -> None:
    bus = EventBus()

    async def handler(e: Any) -> None:
        pass

    with pytest.raises(SubscriptionError, match=r"AfterBackward .* plain `def`"):
        bus.subscribe(AfterBackward, handler)
    with pytest.raises(SubscriptionError, match=r"cannot be queued"):
        bus.subscribe(AfterBackward, lambda e: None, mode="queued")


def test_on_decorator_validates_early() -> None:
    with pytest.raises(SubscriptionError, match=r"unknown option\(s\) \['evry'\]"):
        on(Ping, evry=3)
    with pytest.raises(SubscriptionError, match=r"not strings"):
        on("Ping")  # type: ignore[arg-type]


# ---------------------------------------------------------------- errors at publish time
async def test_handler_error_names_owner_and_event() -> None:
    bus = EventBus()

    def broken(e: Ping) -> None:
        raise ValueError("no good")

    bus.subscribe(Ping, broken)
    with pytest.raises(HandlerError, match=r"broken raised ValueError while handling Ping: no good") as info:
        await bus.publish(Ping())
    assert isinstance(info.value.__cause__, ValueError)
    assert info.value.event == "Ping"


# ---------------------------------------------------------------- queued delivery
async def test_queued_block_receives_everything_in_order() -> None:
    bus = EventBus()
    got: list[int] = []

    async def slow(e: Ping) -> None:
        await anyio.sleep(0.001)
        got.append(e.n)

    sub = bus.subscribe(Ping, slow, mode="queued", buffer=4, overflow="block")
    async with bus.running():
        await publish_all(bus, pings(50))
    assert got == list(range(1, 51))
    assert sub.delivered == 50
    assert sub.dropped == 0


async def test_queued_drop_counts_exactly() -> None:
    bus = EventBus()
    got: list[int] = []
    gate = anyio.Event()

    async def stalled(e: Ping) -> None:
        await gate.wait()
        got.append(e.n)

    sub = bus.subscribe(Ping, stalled, mode="queued", buffer=5, overflow="drop")
    async with bus.running():
        await anyio.wait_all_tasks_blocked()
        with anyio.fail_after(5):
            await publish_all(bus, pings(100))  # never waits on the stalled consumer
        gate.set()
    assert sub.dropped + len(got) == 100
    # one taken by the consumer before it stalled + a full buffer of 5
    assert len(got) == 6
    assert sub.dropped == 94


async def test_queued_publish_requires_a_running_bus() -> None:
    bus = EventBus()
    bus.subscribe(Ping, lambda e: None, mode="queued")
    with pytest.raises(HandlerError, match=r"bus is not running"):
        await bus.publish(Ping())


async def test_queued_handler_error_propagates_from_running() -> None:
    bus = EventBus()

    def broken(e: Ping) -> None:
        raise KeyError("lost")

    bus.subscribe(Ping, broken, mode="queued")
    with pytest.raises(BaseException) as info:  # noqa: PT011 - inspected below
        async with bus.running():
            await bus.publish(Ping())
            await anyio.sleep(0.1)
    leaves = [info.value]
    while isinstance(leaves[0], BaseExceptionGroup):
        leaves = list(leaves[0].exceptions)
    assert isinstance(leaves[0], HandlerError)
    assert "broken raised KeyError while handling Ping" in str(leaves[0])
    assert bus.failure is leaves[0]


async def test_running_drain_timeout_cancels_a_hung_consumer() -> None:
    bus = EventBus()
    forever = anyio.Event()

    async def hung(e: Ping) -> None:
        await forever.wait()

    sub = bus.subscribe(Ping, hung, mode="queued")
    with anyio.fail_after(5):
        async with bus.running(drain_timeout=0.05):
            await bus.publish(Ping())
    assert sub.delivered == 0


# ---------------------------------------------------------------- one delivery loop
def test_in_step_events_run_the_delivery_loop_without_an_event_loop() -> None:
    bus = EventBus()
    got: list[str] = []
    bus.subscribe(AfterBackward, lambda e: got.append("first"))
    bus.subscribe(Event, lambda e: got.append(type(e).__name__))
    bus.deliver_sync(bus.table[AfterBackward], AfterBackward(loop="train"))
    assert got == ["first", "AfterBackward"]

    def fails(event: Any) -> None:
        raise ValueError("boom")

    bus.subscribe(AfterBackward, fails, owner="Failing")
    with pytest.raises(HandlerError, match="Failing") as caught:
        bus.deliver_sync(bus.table[AfterBackward], AfterBackward(loop="train"))
    assert isinstance(caught.value.__cause__, ValueError)


class _Suspend:
    """An awaitable that suspends once (what waiting on an event loop looks like)."""

    def __await__(self) -> Generator[None, None, None]:
        yield None


def test_an_in_step_handler_that_waits_is_named_in_the_error() -> None:
    bus = EventBus()

    async def waits(event: Any) -> None:  # subscribed to every event, so also in-step ones
        await _Suspend()

    bus.subscribe(Event, waits)
    with pytest.raises(RuntimeError, match=r"AfterBackward.*waited"):
        bus.deliver_sync(bus.table[AfterBackward], AfterBackward(loop="train"))


async def test_records_are_delivered_with_the_same_errors_as_events() -> None:
    bus = EventBus()

    def fails(record: PutRecord) -> None:
        raise KeyError("nope")

    bus.subscribe(PutRecord, fails, owner="Sink")
    record = PutRecord(name="a", value=1.0, destinations=("callbacks",))
    with pytest.raises(HandlerError, match="Sink"):
        await bus.deliver_record(bus.route(("callbacks",)), record)
    with pytest.raises(HandlerError, match="Sink"):
        await bus.publish(record)
