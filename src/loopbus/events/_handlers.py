"""Handlers as the bus receives and reports them: the checks ``subscribe`` and ``on`` make
of an event type and a handler (with a hint where a Lightning hook name or an instance
was passed instead of an event class), a handler's readable name, and the
:class:`~loopbus.HandlerError` that names the handler that failed and what it handled.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .._exceptions import HandlerError, SubscriptionError
from ._types import Event

__all__ = [
    "Handler",
    "check_event_type",
    "check_handler",
    "describe_handler",
    "handler_error",
    "is_async_callable",
]

Handler = Callable[[Any], Any]

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


def check_event_type(event_type: object) -> type[Event]:
    """``event_type`` if it is an event class; otherwise raise, with a hint for a hook
    name (``"on_train_batch_end"``) or an event instance passed instead."""
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


def is_async_callable(handler: object) -> bool:
    """Whether calling ``handler`` returns an awaitable (``async def`` functions and
    objects whose ``__call__`` is one)."""
    if inspect.iscoroutinefunction(handler):
        return True
    if inspect.isroutine(handler):
        return False
    call = vars(type(handler)).get("__call__") or type(handler).__call__
    return inspect.iscoroutinefunction(call)


def check_handler(handler: object, event_type: type[Event]) -> bool:
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
    return is_async_callable(handler)


def handler_error(owner: str, event: Any, exc: BaseException) -> HandlerError:
    """The error that reports ``exc``, raised by the handler named ``owner`` while it
    handled ``event``; the original is chained to it and kept as ``original``."""
    name = type(event).__name__
    loop = getattr(event, "loop", None)
    where = f"{name} (loop {loop!r})" if loop else name
    return HandlerError(
        f"{owner} raised {type(exc).__name__} while handling {where}: {exc}",
        owner=owner,
        event=name,
        original=exc,
    )
