"""The event bus: subscriptions, dispatch tables and the two delivery modes.

Dispatch tables are built when subscriptions change, never per publish: ``table[T]`` is
a plain dict lookup that returns a tuple of ``(callable, is_async, subscription)``
entries, empty when nobody listens, so a loop can skip building an event nobody wants::

    entries = bus.table[TrainBatchStarted]
    if entries:
        await bus.deliver(entries, TrainBatchStarted(...))
"""

from __future__ import annotations

import inspect
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sized
from contextlib import asynccontextmanager
from typing import Any, Literal, Protocol

import anyio
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from .._exceptions import HandlerError, StopLoop, SubscriptionError
from .._validate import check_choice, check_int
from ._types import Event, LoopEvent, PutRecord

__all__ = ["DESTINATIONS", "EventBus", "RecordSource", "Subscription", "describe_handler", "on"]

#: The destinations a put record can be routed to, and the roles a record subscriber
#: can declare. Plugins may use further roles of their own.
DESTINATIONS: tuple[str, ...] = ("callbacks", "loggers", "progress_bar", "external")

_MODES = {"inline": "awaited where it is published", "queued": "handed to a task of its own"}
_OVERFLOWS = {"block": "wait for the subscriber", "drop": "drop and count"}

Handler = Callable[[Any], Any]


class RecordSource(Protocol):
    """What :meth:`EventBus.attach_records` takes: a list of pending records (truthy when
    something is pending) and the coroutine that delivers them."""

    @property
    def pending(self) -> Sized: ...

    async def flush(self) -> None: ...


Entry = tuple[Callable[[Any], Any], bool, "Subscription"]

_LIGHTNING_NAMES = {
    "on_fit_start": "FitStarted",
    "on_fit_end": "FitCompleted",
    "on_train_start": "FitStarted",
    "on_train_end": "FitCompleted",
    "on_train_epoch_start": "TrainEpochStarted",
    "on_train_epoch_end": "TrainEpochCompleted",
    "on_train_batch_start": "TrainBatchStarted",
    "on_train_batch_end": "TrainBatchCompleted",
    "on_validation_start": "ValidationStarted",
    "on_validation_end": "ValidationCompleted",
    "on_validation_epoch_start": "ValidationStarted",
    "on_validation_epoch_end": "ValidationCompleted",
    "on_validation_batch_start": "ValidationBatchStarted",
    "on_validation_batch_end": "ValidationBatchCompleted",
    "on_test_start": "TestStarted",
    "on_test_end": "TestCompleted",
    "on_test_batch_end": "TestBatchCompleted",
    "on_predict_start": "PredictStarted",
    "on_predict_end": "PredictCompleted",
    "on_predict_batch_end": "PredictBatchCompleted",
    "on_after_backward": "AfterBackward",
    "on_before_optimizer_step": "BeforeOptimizerStep",
    "on_exception": "ExceptionRaised",
    "teardown": "Teardown",
}


def describe_handler(handler: object) -> str:
    """A short, readable name for a handler: ``Plugin.method`` or a function's qualname."""
    self_obj = getattr(handler, "__self__", None)
    func = getattr(handler, "__func__", handler)
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None)
    if self_obj is not None and name is not None:
        return f"{type(self_obj).__name__}.{getattr(func, '__name__', name)}"
    if name is not None:
        return str(name)
    return repr(handler)


def _check_event_type(event_type: object) -> type[Event]:
    if isinstance(event_type, type) and issubclass(event_type, Event):
        return event_type
    from . import _types

    if isinstance(event_type, str):
        guess = _LIGHTNING_NAMES.get(event_type)
        if guess is None:
            lowered = event_type.replace("_", "").lower()
            for candidate in _types.__all__:
                if candidate.lower() == lowered:
                    guess = candidate
                    break
        hint = (
            f" Did you mean loopbus.events.{guess}? (from loopbus.events import {guess})"
            if guess
            else " See loopbus.events.__all__ for the event types."
        )
        raise SubscriptionError(
            f"event types are classes, not strings: got {event_type!r}.{hint}"
        )
    if isinstance(event_type, Event):
        raise SubscriptionError(
            f"pass the event class, not an instance: got {event_type!r}; "
            f"use {type(event_type).__name__} instead of {type(event_type).__name__}(...)."
        )
    raise SubscriptionError(
        f"{event_type!r} is not an event type. Event types are subclasses of "
        "loopbus.events.Event, for example `class Milestone(Event, frozen=True): ...`."
    )


def _is_async_callable(handler: object) -> bool:
    if inspect.iscoroutinefunction(handler):
        return True
    if inspect.isroutine(handler):
        return False
    call = vars(type(handler)).get("__call__") or type(handler).__call__
    return inspect.iscoroutinefunction(call)


def _check_handler(handler: object, event_type: type[Event]) -> bool:
    """Validate a handler's shape; return whether it is async."""
    what = f"the handler for {event_type.__name__}"
    if inspect.iscoroutine(handler):
        handler.close()
        raise SubscriptionError(
            f"{what} is a coroutine object, the result of calling an async function. "
            "Pass the function itself: subscribe(Event, handler), not subscribe(Event, handler())."
        )
    if handler is None or not callable(handler):
        raise SubscriptionError(
            f"{what} must be a callable that takes the event, got {handler!r}. "
            "Pass the function itself: subscribe(Event, handler), not subscribe(Event, handler())."
        )
    if inspect.isgeneratorfunction(handler) or inspect.isasyncgenfunction(handler):
        raise SubscriptionError(
            f"{what}, {describe_handler(handler)}, is a generator function; a handler must "
            "be a plain `def` or `async def` function that returns (no `yield`)."
        )
    try:
        signature = inspect.signature(handler)
    except (TypeError, ValueError):  # builtins without a signature: trust them
        signature = None
    if signature is not None:
        try:
            signature.bind(None)
        except TypeError:
            raise SubscriptionError(
                f"{what}, {describe_handler(handler)}{signature}, must accept exactly one "
                "positional argument, the event. To pass more, bind them first: "
                "subscribe(Event, functools.partial(handler, extra=value))."
            ) from None
    return _is_async_callable(handler)


def _check_count(option: str, value: object, minimum: int) -> int | None:
    return check_int(option, value, minimum=minimum, allow_none=True, error=SubscriptionError)


class Subscription:
    """A handle on one subscription. ``unsubscribe()`` (or leaving its ``with`` block)
    removes it. For queued subscriptions :attr:`dropped` counts events dropped by the
    ``"drop"`` overflow policy and :attr:`delivered` the events handled so far."""

    __slots__ = (
        "__weakref__",
        "_accept_count",
        "_done",
        "_recv",
        "_send",
        "active",
        "after",
        "before",
        "buffer",
        "bus",
        "delivered",
        "destination",
        "dropped",
        "event_type",
        "every",
        "handler",
        "is_async",
        "loop",
        "mode",
        "once",
        "overflow",
        "owner",
        "priority",
        "seq",
        "when",
    )

    def __init__(self, bus: EventBus, event_type: type[Event], handler: Handler) -> None:
        self.bus = bus
        self.event_type = event_type
        self.handler = handler
        self.owner = describe_handler(handler)
        self.is_async = False
        self.mode: Literal["inline", "queued"] = "inline"
        self.priority = 0
        self.loop: str | None = None
        self.every: int | None = None
        self.once: int | None = None
        self.before: int | None = None
        self.after: int | None = None
        self.when: Callable[[Any], bool] | None = None
        self.destination = "callbacks"
        self.buffer = 0
        self.overflow: Literal["block", "drop"] = "block"
        self.dropped = 0
        self.delivered = 0
        self.active = True
        self.seq = 0
        self._accept_count = 0
        self._send: MemoryObjectSendStream[Any] | None = None
        self._recv: MemoryObjectReceiveStream[Any] | None = None
        self._done: anyio.Event | None = None

    def __repr__(self) -> str:
        return (
            f"<Subscription {self.owner} to {self.event_type.__name__} "
            f"({self.mode}, priority={self.priority}{'' if self.active else ', removed'})>"
        )

    def unsubscribe(self) -> None:
        """Remove the subscription; safe to call more than once."""
        if self.active:
            self.active = False
            self.bus._remove(self)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.unsubscribe()

    # ---- filters
    @property
    def filtered(self) -> bool:
        return (
            self.loop is not None
            or self.every is not None
            or self.once is not None
            or self.before is not None
            or self.after is not None
            or self.when is not None
        )

    def accepts(self, event: Any) -> bool:
        """Apply the loop/every/once/before/after/when filters; counts occurrences."""
        if self.loop is not None and getattr(event, "loop", None) != self.loop:
            return False
        self._accept_count += 1
        n = self._accept_count
        if self.every is not None and n % self.every:
            return False
        if self.once is not None and n != self.once:
            return False
        if self.before is not None and n >= self.before:
            return False
        if self.after is not None and n <= self.after:
            return False
        return self.when is None or bool(self.when(event))

    # ---- queued delivery
    def _offer_drop(self, event: Any) -> None:
        send = self._send
        if send is None:
            raise self.bus._not_running(self)
        try:
            send.send_nowait(event)
        except (anyio.WouldBlock, anyio.BrokenResourceError):
            # Broken: the consumer failed, and its error is already ending the stage.
            self.dropped += 1

    async def _offer_block(self, event: Any) -> None:
        send = self._send
        if send is None:
            raise self.bus._not_running(self)
        try:
            send.send_nowait(event)
        except anyio.WouldBlock:
            try:
                await send.send(event)
            except anyio.BrokenResourceError:
                self.dropped += 1
        except anyio.BrokenResourceError:
            # The consumer failed, and its error is already ending the stage.
            self.dropped += 1

    def _entry(self) -> Entry:
        if self.mode == "queued":
            target: Callable[[Any], Any] = (
                self._offer_drop if self.overflow == "drop" else self._offer_block
            )
            target_async = self.overflow == "block"
        else:
            target = self.handler
            target_async = self.is_async
        if not self.filtered:
            return (target, target_async, self)
        accepts = self.accepts
        once = self.once is not None
        unsubscribe = self.unsubscribe
        if target_async:
            async_target = target

            async def filtered_async(event: Any) -> None:
                if accepts(event):
                    try:
                        await async_target(event)
                    finally:
                        if once:
                            unsubscribe()

            return (filtered_async, True, self)

        sync_target = target

        def filtered(event: Any) -> None:
            if accepts(event):
                try:
                    sync_target(event)
                finally:
                    if once:
                        unsubscribe()

        return (filtered, False, self)


class _Table(dict[type, tuple[Entry, ...]]):
    """``table[EventType]`` -> entries; built on first use after each change."""

    __slots__ = ("bus",)

    def __init__(self, bus: EventBus) -> None:
        super().__init__()
        self.bus = bus

    def __missing__(self, key: type) -> tuple[Entry, ...]:
        entries = self.bus._build(key)
        self[key] = entries
        return entries


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
        self.table = _Table(self)
        #: The cache :meth:`route` fills, destinations -> record subscribers: read it to
        #: skip a call where the route is usually cached; only the bus writes to it.
        self.routes: dict[tuple[str, ...], tuple[Entry, ...]] = {}
        self._tg: TaskGroup | None = None
        self.failure: HandlerError | None = None
        self._consumers: list[anyio.CancelScope] = []
        self._records: RecordSource | None = None

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
        event_type = _check_event_type(event_type)
        is_async = _check_handler(handler, event_type)
        check_int("priority", priority, minimum=None, error=SubscriptionError)
        check_choice("mode", mode, _MODES, error=SubscriptionError)
        check_choice("overflow", overflow, _OVERFLOWS, error=SubscriptionError)
        if mode == "queued":
            check_int("buffer", buffer, error=SubscriptionError)
        if loop is not None:
            if not isinstance(loop, str):
                raise SubscriptionError(f"loop must be a loop name (str), got {loop!r}.")
            if not issubclass(event_type, LoopEvent):
                raise SubscriptionError(
                    f"loop={loop!r} filters loop events, but {event_type.__name__} is not "
                    "a LoopEvent; drop the loop argument."
                )
        if when is not None and not callable(when):
            raise SubscriptionError(f"when must be a callable taking the event, got {when!r}.")
        if not isinstance(destination, str) or not destination:
            raise SubscriptionError(
                f"destination must be a non-empty role name such as {DESTINATIONS!r}, "
                f"got {destination!r}."
            )
        if event_type.inside_step:
            if mode == "queued":
                raise SubscriptionError(
                    f"{event_type.__name__} is published inside the training step and cannot "
                    "be queued; subscribe inline (the default)."
                )
            if is_async:
                raise SubscriptionError(
                    f"{event_type.__name__} is published inside the (synchronous) training "
                    f"step, so its handlers must be plain `def` functions; "
                    f"{describe_handler(handler)} is `async def`."
                )
        sub = Subscription(self, event_type, handler)
        sub.is_async = is_async
        sub.priority = priority
        sub.loop = loop
        sub.every = _check_count("every", every, 1)
        sub.once = _check_count("once", once, 1)
        sub.before = _check_count("before", before, 1)
        sub.after = _check_count("after", after, 0)
        sub.when = when
        sub.mode = mode
        sub.buffer = buffer
        sub.overflow = overflow
        sub.destination = destination
        if owner is not None:
            sub.owner = owner
        self._seq += 1
        sub.seq = self._seq
        self._subs.append(sub)
        self._changed()
        if mode == "queued" and self._tg is not None:
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

    def _remove(self, sub: Subscription) -> None:
        try:
            self._subs.remove(sub)
        except ValueError:
            return
        self._changed()
        if sub._send is not None:
            sub._send.close()
            sub._send = None

    def _changed(self) -> None:
        self.table.clear()
        self.routes.clear()

    def _build(self, event_type: type) -> tuple[Entry, ...]:
        subs = [s for s in self._subs if issubclass(event_type, s.event_type)]
        subs.sort(key=lambda s: (-s.priority, s.seq))
        return tuple(s._entry() for s in subs)

    def route(self, destinations: tuple[str, ...]) -> tuple[Entry, ...]:
        """The record subscribers whose role is in ``destinations`` (cached)."""
        entries = self.routes.get(destinations)
        if entries is None:
            wanted = set(destinations)
            entries = tuple(e for e in self.table[PutRecord] if e[2].destination in wanted)
            self.routes[destinations] = entries
        return entries

    # ------------------------------------------------------------ publishing
    async def publish(self, event: Event) -> None:
        """Deliver ``event`` to its subscribers (inline ones are awaited now)."""
        if type(event) is PutRecord:
            entries = self.route(event.destinations)
            if entries:
                await self.deliver_record(entries, event)
            return
        entries = self.table[type(event)]
        if entries:
            await self.deliver(entries, event)

    async def deliver(self, entries: tuple[Entry, ...], event: Any) -> None:
        """Deliver ``event`` to precomputed ``entries`` (from :attr:`table`).

        With a record source attached (see :meth:`attach_records`), what a handler put or
        published is flushed before the next handler of the same event runs, so later
        handlers see it (``trainer.latest``); only when something is pending, and never
        after the last handler (the loops flush at their boundaries, in batches)."""
        settle: RecordSource | None = None
        for fn, is_async, sub in entries:
            if settle is not None and settle.pending:
                await settle.flush()
            try:
                if is_async:
                    await fn(event)
                else:
                    fn(event)
            except (HandlerError, StopLoop):
                raise
            except Exception as exc:
                raise _handler_error(sub, event, exc) from exc
            settle = self._records

    async def deliver_record(self, entries: tuple[Entry, ...], record: PutRecord) -> None:
        """Deliver a put record to its routed ``entries`` (from :meth:`route`). What a
        record handler puts waits for the next flush, so records keep their put order."""
        for fn, is_async, sub in entries:
            try:
                if is_async:
                    await fn(record)
                else:
                    fn(record)
            except (HandlerError, StopLoop):
                raise
            except Exception as exc:
                raise _handler_error(sub, record, exc) from exc

    def attach_records(self, source: RecordSource | None) -> None:
        """Flush ``source`` (the pending records of the trainer that owns this bus)
        between the handlers of an event when a handler left something pending; None
        detaches it."""
        self._records = source

    def deliver_sync(self, entries: tuple[Entry, ...], event: Any) -> None:
        """Deliver an ``inside_step`` event, whose handlers are all synchronous."""
        for fn, _, sub in entries:
            try:
                fn(event)
            except (HandlerError, StopLoop):
                raise
            except Exception as exc:
                raise _handler_error(sub, event, exc) from exc

    # ------------------------------------------------------------ queued delivery
    def _not_running(self, sub: Subscription) -> RuntimeError:
        return RuntimeError(
            f"{sub.owner} is a queued subscriber of {sub.event_type.__name__}, but the bus is "
            "not running. Publish inside a Trainer stage or `async with bus.running():`."
        )

    def _start(self, sub: Subscription, tg: TaskGroup) -> None:
        send, recv = anyio.create_memory_object_stream[Any](sub.buffer)
        sub._send, sub._recv = send, recv
        sub._done = anyio.Event()
        scope = anyio.CancelScope(shield=True)
        self._consumers.append(scope)
        tg.start_soon(
            self._consume_shielded, scope, sub, recv, sub._done, name=f"loopbus consumer {sub.owner}"
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
                        error = _handler_error(sub, event, exc)
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
            if sub._send is not None:
                sub._send.close()
                sub._send = None
            if sub._done is not None:
                waits.append(sub._done)
                sub._done = None
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


def _handler_error(sub: Subscription, event: Any, exc: BaseException) -> HandlerError:
    name = type(event).__name__
    loop = getattr(event, "loop", None)
    where = f"{name} (loop {loop!r})" if loop else name
    return HandlerError(
        f"{sub.owner} raised {type(exc).__name__} while handling {where}: {exc}",
        owner=sub.owner,
        event=name,
        original=exc,
    )


def on(
    event_type: type[Event], **options: Any
) -> Callable[[Callable[..., Awaitable[Any] | Any]], Callable[..., Any]]:
    """Mark a method as a handler of ``event_type``; the options are those of
    :meth:`EventBus.subscribe`. Plugins and modules are subscribed with their marked
    methods when a Trainer stage starts::

        class Printer(Plugin):
            @on(TrainBatchCompleted, every=100)
            def report(self, event: TrainBatchCompleted) -> None: ...
    """
    event_type = _check_event_type(event_type)
    unknown = set(options) - _ON_OPTIONS
    if unknown:
        raise SubscriptionError(
            f"on({event_type.__name__}) got unknown option(s) {sorted(unknown)}; "
            f"known options are {sorted(_ON_OPTIONS)}."
        )

    def mark(func: Callable[..., Any]) -> Callable[..., Any]:
        specs: list[tuple[type[Event], dict[str, Any]]] = list(
            getattr(func, "__loopbus_on__", ())
        )
        specs.append((event_type, options))
        func.__loopbus_on__ = specs  # type: ignore[attr-defined]
        return func

    return mark


_ON_OPTIONS = frozenset(
    {
        "priority",
        "loop",
        "every",
        "once",
        "before",
        "after",
        "when",
        "mode",
        "buffer",
        "overflow",
        "destination",
    }
)

