"""Subscriptions: one handler's subscription to an event type, with its filters, its
delivery mode and (queued) its queue; and the dispatch entry it contributes to the bus's
tables, with the filters folded in so that an unfiltered inline handler is called as is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, Protocol

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._handlers import Handler, describe_handler
from ._types import Event

__all__ = ["Entry", "Subscription", "SubscriptionOwner"]

#: What a dispatch table holds for each subscriber, in delivery order: the callable that
#: takes the event (the handler, or a wrapper applying the filters or feeding the queue),
#: whether it is awaited, and the subscription (named in a handler's error).
Entry = tuple[Callable[[Any], Any], bool, "Subscription"]


class SubscriptionOwner(Protocol):
    """What a subscription asks of the bus it belongs to: to be removed from it."""

    def discard(self, sub: Subscription) -> None: ...


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

    def __init__(self, bus: SubscriptionOwner, event_type: type[Event], handler: Handler) -> None:
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
            self.bus.discard(self)

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

    # ---- queued delivery (what the bus's run calls)
    def open_queue(self) -> tuple[MemoryObjectReceiveStream[Any], anyio.Event]:
        """Open this queued subscription's queue for a run of the bus; returns what its
        consumer task takes: the receiving end, and the event it sets when it ends."""
        send, recv = anyio.create_memory_object_stream[Any](self.buffer)
        self._send, self._recv = send, recv
        self._done = done = anyio.Event()
        return recv, done

    def close_queue(self) -> None:
        """Close the sending end: the consumer ends once it handled what is buffered."""
        if self._send is not None:
            self._send.close()
            self._send = None

    def take_done(self) -> anyio.Event | None:
        """The event the consumer of this run sets when it ends (None: no consumer, or
        already taken), handed over once to the one who waits for it."""
        done, self._done = self._done, None
        return done

    def _not_running(self) -> RuntimeError:
        return RuntimeError(
            f"{self.owner} is a queued subscriber of {self.event_type.__name__}, but the bus "
            "is not running. Publish inside a Trainer stage or `async with bus.running():`."
        )

    def _offer_drop(self, event: Any) -> None:
        send = self._send
        if send is None:
            raise self._not_running()
        try:
            send.send_nowait(event)
        except (anyio.WouldBlock, anyio.BrokenResourceError):
            # Broken: the consumer failed, and its error is already ending the stage.
            self.dropped += 1

    async def _offer_block(self, event: Any) -> None:
        send = self._send
        if send is None:
            raise self._not_running()
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

    def entry(self) -> Entry:
        """What the bus's dispatch table holds for this subscription: the callable that
        takes an event (the handler, or a wrapper with the filters or the queue), and
        whether it is awaited."""
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
