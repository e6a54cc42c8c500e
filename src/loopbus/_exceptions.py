"""Every exception loopbus raises on purpose, in one place.

This module imports nothing from loopbus, torch or anyio, so every layer may use it.
It also holds :func:`fixup_module_metadata`, with which the public packages make their
exports (these exceptions first) carry public names: a traceback shows
``loopbus.MisconfigurationError``, not ``loopbus._exceptions.MisconfigurationError``.
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Mapping

__all__ = [
    "CheckpointError",
    "HandlerError",
    "LoopbusError",
    "MisconfigurationError",
    "Preempted",
    "ScopeLeakError",
    "StopLoop",
    "StreamError",
    "SubscriptionError",
]


class LoopbusError(Exception):
    """Raised (as one of its subclasses) when loopbus fails on purpose: catch it to
    handle every error loopbus raises itself."""


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
    """Raised when an option is bad: a Trainer, Module, Loop, plugin, bus subscription or
    stream client is given a value it cannot use, or options that cannot work together.
    The message names the option, the value and how to fix it. Being a ``ValueError``,
    it is caught by code that handles bad arguments."""


class SubscriptionError(MisconfigurationError, TypeError):
    """Raised when :meth:`EventBus.subscribe` (or :func:`on`) gets an event type, a
    handler or a filter it cannot use. The message says what was wrong and how to call
    it instead. It is a :class:`MisconfigurationError` like every bad option, and a
    ``TypeError`` too, since most of these are objects of the wrong kind."""


class CheckpointError(LoopbusError):
    """Raised when a checkpoint cannot be written or read: missing, torn, from a newer
    format, or not matching the components of the current run."""


class StreamError(LoopbusError, ConnectionError):
    """Raised when a metric stream cannot be served or read: a stream server cannot listen
    on its address; a client cannot reach the server, is turned away (authentication,
    protocol version, too many clients), is closed with an error, sees the server go away
    without a bye, or receives data that breaks the protocol. Being a ``ConnectionError``,
    it is caught by code that handles network errors; reconnecting is the caller's choice."""


class Preempted(SystemExit):
    """Raised by a stage (``fit``, ``validate``, ...) that stopped because the process
    received a preemption signal (SIGTERM, SIGUSR1; see ``Trainer(preemption=...)``),
    once the stage has ended cleanly: the checkpoint written, the teardown events fired,
    the queues drained, the signal handlers restored. A ``SystemExit``: uncaught, it ends
    the interpreter quietly with :attr:`code`, the signal's usual exit status (128 + the
    signal's number: 143 for SIGTERM) or ``Trainer(preemption_exit_code=...)``. An
    application that embeds the trainer catches it to decide for itself."""

    def __init__(self, code: int, *, signal: str, step: int) -> None:
        super().__init__(f"stopped at step {step} on {signal}; exit status {code}")
        #: The exit status (what the interpreter exits with when nothing catches it).
        self.code = code
        #: The signal's name ("SIGTERM").
        self.signal = signal
        #: The step at which the stage stopped.
        self.step = step


class StopLoop(Exception):
    """Raised by a loop hook (your code, not loopbus) to end the loop's ``run`` early,
    the way ``StopIteration`` ends Lightning's loops (``StopIteration`` itself cannot
    cross an ``async def``)."""


def fixup_module_metadata(module_name: str, namespace: Mapping[str, object]) -> None:
    """Make the classes and functions that the public module ``module_name`` exports
    (the names in ``namespace["__all__"]``, ``namespace`` being its globals) name that
    module as theirs, so that tracebacks, reprs and documentation show
    ``loopbus.MisconfigurationError`` rather than the private module it is defined in.
    Names and qualified names are unchanged.

    Only objects from loopbus's private modules (a dotted part starting with ``_``) are
    renamed, so a name that ``loopbus.events`` exports and ``loopbus`` re-exports stays
    ``loopbus.events.EventBus`` whichever facade runs last. Methods and nested classes of
    a renamed class follow it. A class with annotations of its own keeps its module:
    the tools that evaluate annotations (msgspec, ``typing.get_type_hints``) look their
    names up in ``sys.modules[cls.__module__]``, where the public module lacks them.
    """
    seen: set[int] = set()

    def fix(obj: object) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        module = getattr(obj, "__module__", None)
        if not isinstance(module, str) or not module.startswith("loopbus."):
            return
        if not any(part.startswith("_") for part in module.split(".")):
            return
        if isinstance(obj, type):
            if inspect.get_annotations(obj):
                return
            obj.__module__ = module_name
            for attribute in list(vars(obj).values()):
                fix(attribute)
        elif isinstance(obj, types.FunctionType):
            obj.__module__ = module_name

    exported = namespace.get("__all__")
    names = exported if isinstance(exported, (list, tuple)) else list(namespace)
    for name in names:
        if not name.startswith("_") and name in namespace:
            fix(namespace[name])
