"""Every exception loopbus raises on purpose, in one place.

This module imports nothing from loopbus, torch or anyio, so every layer may use it.
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "HandlerError",
    "LoopbusError",
    "MisconfigurationError",
    "ScopeLeakError",
    "StopLoop",
    "StreamError",
    "SubscriptionError",
]


class LoopbusError(Exception):
    """Base class of the errors loopbus raises on purpose."""


class SubscriptionError(LoopbusError, TypeError):
    """Raised when :meth:`EventBus.subscribe` gets an event type, a handler or a filter
    it cannot use. The message says what was wrong and how to call it instead."""


class HandlerError(LoopbusError):
    """Raised when an event handler raised. The message names the handler's owner (the
    plugin, module or function) and the event; the original exception is chained as
    ``__cause__`` and kept in :attr:`original`."""

    def __init__(self, message: str, *, owner: str, event: str, original: BaseException) -> None:
        super().__init__(message)
        self.owner = owner
        self.event = event
        self.original = original


class ScopeLeakError(LoopbusError):
    """Raised (or warned, see ``leak_check``) when a value held by a dropped scope is still
    alive: something outside the scope kept a reference to it."""


class MisconfigurationError(LoopbusError, ValueError):
    """Raised when a Trainer, Module or Loop is set up with options that cannot work
    together; the message names the option and how to fix it."""


class CheckpointError(LoopbusError):
    """Raised when a checkpoint cannot be written or read: missing, torn, from a newer
    format, or not matching the components of the current run."""


class StreamError(LoopbusError, ConnectionError):
    """Raised when a metric stream cannot be served or read: a stream server cannot listen
    on its address; a client cannot reach the server, is turned away (authentication,
    protocol version, too many clients), is closed with an error, sees the server go away
    without a bye, or receives data that breaks the protocol. Being a ``ConnectionError``,
    it is caught by code that handles network errors; reconnecting is the caller's choice."""


class StopLoop(Exception):
    """Raise from a loop hook to end the loop's ``run`` early, the way ``StopIteration``
    ends Lightning's loops (``StopIteration`` itself cannot cross an ``async def``)."""
