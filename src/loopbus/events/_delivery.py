"""Subscription options: the delivery modes, overflow policies, filters and record roles
that :meth:`EventBus.subscribe <loopbus.events.EventBus.subscribe>` and :func:`on`
accept, and their checks, made once when a subscription is created (never per event).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .._exceptions import SubscriptionError
from .._validate import check_choice, check_int
from ._handlers import check_event_type, describe_handler
from ._types import Event, LoopEvent

if TYPE_CHECKING:
    from ._subscription import Subscription

__all__ = ["DESTINATIONS", "check_count", "check_options", "on"]

#: The destinations a put record can be routed to, and the roles a record subscriber
#: can declare. Plugins may use further roles of their own.
DESTINATIONS: tuple[str, ...] = ("callbacks", "loggers", "progress_bar", "external")

_MODES = {"inline": "awaited where it is published", "queued": "handed to a task of its own"}
_OVERFLOWS = {"block": "wait for the subscriber", "drop": "drop and count"}


def check_count(option: str, value: object, minimum: int) -> int | None:
    """A filter count (``every``, ``once``, ``before``, ``after``): None or an int of at
    least ``minimum``."""
    return check_int(option, value, minimum=minimum, allow_none=True, error=SubscriptionError)


def check_options(sub: Subscription) -> None:
    """Raise :class:`~loopbus.SubscriptionError` unless the options of ``sub`` (a new
    subscription, not yet added to its bus) fit together: its priority, mode, overflow,
    buffer, loop filter, ``when``, destination, and what an event published inside the
    training step allows (the filter counts are checked by :func:`check_count`)."""
    event_type, priority, mode, loop = sub.event_type, sub.priority, sub.mode, sub.loop
    when, destination = sub.when, sub.destination
    check_int("priority", priority, minimum=None, error=SubscriptionError)
    check_choice("mode", mode, _MODES, error=SubscriptionError)
    check_choice("overflow", sub.overflow, _OVERFLOWS, error=SubscriptionError)
    if mode == "queued":
        check_int("buffer", sub.buffer, error=SubscriptionError)
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
        if sub.is_async:
            raise SubscriptionError(
                f"{event_type.__name__} is published inside the (synchronous) training "
                f"step, so its handlers must be plain `def` functions; "
                f"{describe_handler(sub.handler)} is `async def`."
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
    event_type = check_event_type(event_type)
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
