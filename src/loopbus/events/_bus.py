"""The event bus: the subscriptions, the dispatch tables built from them, publishing and
the two delivery modes (inline, and queued to a consumer task per subscriber).

Dispatch tables are built when subscriptions change, never per publish: ``table[T]`` is
a plain dict lookup that returns a tuple of ``(callable, is_async, subscription)``
entries, empty when nobody listens, so a loop can skip building an event nobody wants::

    entries = bus.table[TrainBatchStarted]
    if entries:
        await bus.deliver(entries, TrainBatchStarted(...))
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sized
from contextlib import asynccontextmanager
from typing import Any, Literal

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream

from .._exceptions import HandlerError, StopLoop
from ._delivery import check_count, check_options
from ._handlers import Handler, check_event_type, check_handler, handler_error
from ._subscription import Entry, Subscription
from ._types import Event, PutRecord

__all__ = ["EventBus", "record_route"]


def record_route(subscribers: Iterable[Entry], destinations: tuple[str, ...]) -> tuple[Entry, ...]:
    """The entries of ``subscribers`` (a :class:`PutRecord` dispatch table's) whose
    subscriber plays a role named in ``destinations``: where a record put to those goes."""
    return tuple(entry for entry in subscribers if entry[2].destination in destinations)


async def _nothing() -> None:
    """What a plain bus runs between two inline handlers: nothing (never called)."""


class DispatchTable(dict[type, tuple[Entry, ...]]):
    """``table[EventType]`` -> entries; built on first use after each change."""

    __slots__ = ("bus", "kept")

    def __init__(self, bus: EventBus) -> None:
        super().__init__()
        self.bus = bus
        self.kept: dict[type, tuple[Entry, ...]] = {}

    def __missing__(self, key: type) -> tuple[Entry, ...]:
        entries = self.bus._build(key)
        self[key] = entries
        return entries

    def keep(self, *event_types: type) -> dict[type, tuple[Entry, ...]]:
        """A plain dict holding the entries of ``event_types`` (and of those kept
        before), kept up to date from now on: for what reads a few event types at every
        iteration. CPython 3.11 reads a dict subclass, as the table is, through a
        ``__getitem__`` call, and a plain dict with one specialized instruction."""
        for event_type in event_types:
            self.kept[event_type] = self[event_type]
        return self.kept

    def rebuild(self, changed: type) -> None:
        """A subscription to ``changed`` came or went: empty the table and rebuild what
        it keeps of ``changed`` and its subclasses (the only entries that change)."""
        self.clear()
        kept = self.kept
        for event_type in kept:
            if issubclass(event_type, changed):
                kept[event_type] = self[event_type]


class EventBus:
    """Typed publish/subscribe with inline and queued delivery.

    Inline handlers are awaited at the publishing hook in priority order (higher first,
    then subscription order). Queued handlers run in a task of their own fed by a bounded
    memory stream; the publisher waits only when a ``"block"`` subscriber's buffer is
    full. Queued delivery needs the bus to be running (``async with bus.running():``, or
    inside a Trainer stage, which does that for you).
    """

    def __init__(self) -> None:
        self._subs: list[Subscription] = []
        self._seq = 0
        self.table = DispatchTable(self)
        #: The cache :meth:`route` fills, destinations -> record subscribers (what a
        #: :class:`PutRecord` published on the bus goes to); only the bus writes to it.
        self.routes: dict[tuple[str, ...], tuple[Entry, ...]] = {}
        self._tg: TaskGroup | None = None
        self.failure: HandlerError | None = None
        self._consumers: list[anyio.CancelScope] = []
        # What runs between two inline handlers of one event (see :meth:`deliver`):
        # ``_settle()`` while ``_unsettled`` is truthy; never on a plain bus.
        self._unsettled: Sized = ()
        self._settle: Callable[[], Awaitable[None]] = _nothing

    # ------------------------------------------------------------ subscribing
    def subscribe(
        self,
        event_type: type[Event],
        handler: Handler,
        *,
        priority: int = 0,
        loop: str | None = None,
        every: int | None = None,
        once: int | None = None,
        before: int | None = None,
        after: int | None = None,
        when: Callable[[Any], bool] | None = None,
        mode: Literal["inline", "queued"] = "inline",
        buffer: int = 1024,
        overflow: Literal["block", "drop"] = "block",
        destination: str = "callbacks",
        owner: str | None = None,
    ) -> Subscription:
        """Subscribe ``handler`` to ``event_type`` and its subclasses.

        Filters count the occurrences that pass ``loop`` (1-based): ``every=N`` fires on
        every Nth, ``once=N`` only on the Nth (then unsubscribes), ``before=N`` on those
        before the Nth, ``after=N`` on those after the Nth; ``when(event)`` must be true.
        ``destination`` is the role a :class:`PutRecord` subscriber plays: it receives the
        records whose ``destinations`` name that role.
        """
        event_type = check_event_type(event_type)
        is_async = check_handler(handler, event_type)
        sub = Subscription(self, event_type, handler)
        sub.is_async = is_async
        sub.priority = priority  # type: ignore[assignment]  # checked below
        sub.loop = loop
        sub.when = when
        sub.mode = mode
        sub.buffer = buffer
        sub.overflow = overflow
        sub.destination = destination
        check_options(sub)
        sub.every = check_count("every", every, 1)
        sub.once = check_count("once", once, 1)
        sub.before = check_count("before", before, 1)
        sub.after = check_count("after", after, 0)
        if owner is not None:
            sub.owner = owner
        return self._add(sub)

    def _add(self, sub: Subscription) -> Subscription:
        """Add ``sub`` after the subscriptions so far (its place among those of the same
        priority), and start its consumer if it is queued and the bus runs."""
        self._seq += 1
        sub.seq = self._seq
        self._subs.append(sub)
        self._changed(sub)
        if sub.mode == "queued" and self._tg is not None:
            self._start(sub, self._tg)
        return sub

    def subscribe_methods(
        self, obj: object, *, owner: str | None = None, **defaults: Any
    ) -> list[Subscription]:
        """Subscribe every method of ``obj`` decorated with :func:`on`.

        ``defaults`` (for example ``destination="loggers"``, ``mode="queued"``) apply
        where the decorator does not say otherwise.
        """
        subs: list[Subscription] = []
        seen: set[str] = set()
        try:
            for klass in type(obj).__mro__:
                for name, attr in vars(klass).items():
                    if name in seen:
                        continue
                    seen.add(name)
                    specs = getattr(attr, "__loopbus_on__", None)
                    if not specs:
                        continue
                    method = getattr(obj, name)
                    for event_type, options in specs:
                        merged = {**defaults, **options}
                        who = f"{owner or type(obj).__name__}.{name}"
                        subs.append(self.subscribe(event_type, method, owner=who, **merged))
        except BaseException:
            for sub in subs:
                sub.unsubscribe()
            raise
        return subs

    @property
    def subscriptions(self) -> tuple[Subscription, ...]:
        return tuple(self._subs)

    def discard(self, sub: Subscription) -> None:
        """Remove ``sub`` from this bus (what ``sub.unsubscribe()`` calls); nothing when
        it is not subscribed."""
        try:
            self._subs.remove(sub)
        except ValueError:
            return
        self._changed(sub)
        sub.close_queue()

    def _changed(self, sub: Subscription) -> None:
        self.table.rebuild(sub.event_type)
        self.routes.clear()

    def _build(self, event_type: type) -> tuple[Entry, ...]:
        subs = [s for s in self._subs if issubclass(event_type, s.event_type)]
        subs.sort(key=lambda s: (-s.priority, s.seq))
        return tuple(s.entry() for s in subs)

    def route(self, destinations: tuple[str, ...]) -> tuple[Entry, ...]:
        """The record subscribers whose role is in ``destinations`` (cached)."""
        entries = self.routes.get(destinations)
        if entries is None:
            entries = record_route(self.table[PutRecord], destinations)
            self.routes[destinations] = entries
        return entries

    # ------------------------------------------------------------ publishing
    async def publish(self, event: Event) -> None:
        """Deliver ``event`` to its subscribers (inline ones are awaited now)."""
        if type(event) is PutRecord:
            entries = self.route(event.destinations)
            if entries:
                await self.deliver(entries, event, settle=False)
            return
        entries = self.table[type(event)]
        if entries:
            await self.deliver(entries, event)

    async def deliver(self, entries: tuple[Entry, ...], event: Any, *, settle: bool = True) -> None:
        """Deliver ``event`` to precomputed ``entries`` (from :attr:`table`, or for a
        record from :meth:`route`), in their order: the bus's one delivery loop, which
        :meth:`deliver_record` and :meth:`deliver_sync` run too.

        A handler's exception is raised as a :class:`HandlerError` naming its owner and
        the event (one already raised as such, and :class:`StopLoop`, pass as they are).
        On a bus that settles between handlers (a trainer's, whose inline handlers may
        put records), what the previous handler left pending is delivered before the
        next one runs, unless ``settle`` is False: records are delivered as on any bus,
        and what a record's handler puts waits for the next flush."""
        between = self._unsettled if settle else ()
        unsettled: Sized = ()  # nothing to settle before the first handler
        for fn, is_async, sub in entries:
            if unsettled:
                await self._settle()
            try:
                if is_async:
                    await fn(event)
                else:
                    fn(event)
            except (HandlerError, StopLoop):
                raise
            except Exception as exc:
                raise handler_error(sub.owner, event, exc) from exc
            unsettled = between

    async def deliver_record(self, entries: tuple[Entry, ...], record: PutRecord) -> None:
        """Deliver a put record to its routed ``entries`` (from :meth:`route`): :meth:`deliver`
        without settling between handlers."""
        await self.deliver(entries, record, settle=False)

    def deliver_sync(self, entries: tuple[Entry, ...], event: Any) -> None:
        """Deliver an ``inside_step`` event, whose handlers are all synchronous: :meth:`deliver`
        run to its end at once, without an event loop (nothing in it waits)."""
        delivery = self.deliver(entries, event, settle=False)
        try:
            delivery.send(None)
        except StopIteration:
            return
        delivery.close()
        raise RuntimeError(
            f"a handler of {type(event).__name__}, which is published inside the "
            "(synchronous) training step, waited for something; its handlers must be "
            "plain `def` functions that return without waiting."
        )

    # ------------------------------------------------------------ queued delivery
    def _start(self, sub: Subscription, tg: TaskGroup) -> None:
        recv, done = sub.open_queue()
        scope = anyio.CancelScope(shield=True)
        self._consumers.append(scope)
        tg.start_soon(
            self._consume_shielded, scope, sub, recv, done, name=f"loopbus consumer {sub.owner}"
        )

    async def _consume_shielded(
        self,
        scope: anyio.CancelScope,
        sub: Subscription,
        recv: MemoryObjectReceiveStream[Any],
        done: anyio.Event,
    ) -> None:
        # Shielded from the cancellation of the stage (a deadline, a cancelled host task):
        # a consumer ends when drain() closes its queue, so what it accepted is handled;
        # drain() cancels it only when its timeout runs out.
        with scope:
            await self._consume(sub, recv, done)

    async def _consume(
        self, sub: Subscription, recv: MemoryObjectReceiveStream[Any], done: anyio.Event
    ) -> None:
        handler, is_async = sub.handler, sub.is_async
        receive_nowait = recv.receive_nowait
        try:
            async with recv:
                while True:
                    # Take what is buffered without a scheduling round trip per item;
                    # wait (one checkpoint) only when the buffer is empty.
                    try:
                        event = receive_nowait()
                    except anyio.WouldBlock:
                        try:
                            event = await recv.receive()
                        except anyio.EndOfStream:
                            break
                    except anyio.EndOfStream:
                        break
                    try:
                        if is_async:
                            await handler(event)
                        else:
                            handler(event)
                    except Exception as exc:
                        error = handler_error(sub.owner, event, exc)
                        if self.failure is None:
                            self.failure = error
                        raise error from exc
                    sub.delivered += 1
        finally:
            done.set()

    def start(self, tg: TaskGroup) -> None:
        """Start the consumer tasks of queued subscribers in ``tg``."""
        if self._tg is not None:
            raise RuntimeError("this EventBus is already running; one stage at a time.")
        self._tg = tg
        self.failure = None
        for sub in self._subs:
            if sub.mode == "queued":
                self._start(sub, tg)

    async def drain(self, timeout: float | None = None) -> bool:  # noqa: ASYNC109
        """Close the queues and wait until every queued subscriber handled what it was
        sent. Returns False if ``timeout`` (seconds) ran out first."""
        waits: list[anyio.Event] = []
        for sub in self._subs:
            sub.close_queue()
            consumer_done = sub.take_done()
            if consumer_done is not None:
                waits.append(consumer_done)
        self._tg = None
        with anyio.move_on_after(math.inf if timeout is None else timeout) as scope:
            for done in waits:
                await done.wait()
        consumers, self._consumers = self._consumers, []
        if scope.cancelled_caught:
            for consumer in consumers:
                consumer.cancel()
        return not scope.cancelled_caught

    @asynccontextmanager
    async def running(self, drain_timeout: float | None = None) -> AsyncIterator[EventBus]:
        """Run the queued subscribers' tasks for the duration of the block and drain them
        at its end (waiting at most ``drain_timeout`` seconds if given; consumers still
        busy then are cancelled)."""
        async with anyio.create_task_group() as tg:
            self.start(tg)
            try:
                yield self
            finally:
                with anyio.CancelScope(shield=True):
                    await self.drain(drain_timeout)
