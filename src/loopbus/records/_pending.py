"""What waits for the recorder's next flush: the entries put or published since the
last one, in order, and what the puts of a compiled step hand out while it runs.

``put`` appends to the pending list through :attr:`Pending.enqueue` (the list's own
``append``: no Python frame); compiled code appends plain tuples to the step buffer
(:attr:`Pending.traced`), typed and moved to the pending list when the step returns.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..events import Event
from ._entries import PendingEvent, PendingPut

__all__ = ["Pending"]


class Pending:
    """The pending entries (:attr:`entries`) and a compiled step's buffer."""

    __slots__ = ("enqueue", "entries", "stepping", "traced")

    def __init__(self) -> None:
        #: What was put or published since the last flush, in order: one list for the
        #: recorder's life (a flush empties it), so that :attr:`enqueue` stays bound.
        self.entries: list[PendingPut | PendingEvent] = []
        #: Queue a pending entry (what the eager ``put`` calls): the list's ``append``.
        self.enqueue = self.entries.append
        #: Whether a compiled step runs (see :meth:`run_compiled`), and what its puts
        #: handed out: one list, empty whenever a step starts (compiled code guards on
        #: the length of a list it appends to; this one's never varies). A put is kept
        #: there as a plain ``(name, value, destinations, source)`` tuple, which compiled
        #: code builds without a graph break, and typed when the step returns.
        self.stepping = False
        self.traced: list[tuple[str, Any, tuple[str, ...], str] | PendingEvent] = []

    def retract(self, count: int) -> None:
        """Drop the pending entries after the first ``count``."""
        del self.entries[count:]

    def peek(self) -> list[Any]:
        """What is pending, in order: each put as its ``(name, value, destinations,
        source)`` tuple, each published event as itself. A new list."""
        return [
            (item.name, item.value, item.destinations, item.source)
            if type(item) is PendingPut
            else item.event
            for item in self.entries
        ]

    def last_value(self, name: str) -> Any:
        """The value of the last pending put of ``name`` as put (None: there is none)."""
        for item in reversed(self.entries):
            if type(item) is PendingPut and item.name == name:
                return item.value
        return None

    def queue_put(self, name: str, value: Any, destinations: tuple[str, ...], source: str) -> None:
        """Queue a checked put (what the compiled ``put`` calls, also while compiled
        code traces it): while a compiled step runs, into its step buffer; otherwise with
        the pending entries."""
        if self.stepping:
            self.traced.append((name, value, destinations, source))
        else:
            self.entries.append(PendingPut(name, value, destinations, source))

    def queue_event(self, event: Event) -> None:
        """Queue ``event`` after what is pending (during a compiled step, after what the
        step has put so far: its puts join the pending entries only when it returns)."""
        (self.traced if self.stepping else self.entries).append(PendingEvent(event))

    def run_compiled(self, fn: Callable[[Any, Any], Any], batch: Any, ctx: Any) -> Any:
        """``fn(batch, ctx)``, a compiled step: the puts it makes go to :attr:`traced`
        and join the pending entries, in the order they were made, when it returns (or
        raises). So compiled code never sees the pending list, whose length changes with
        what handlers put between steps."""
        self.stepping = True
        try:
            return fn(batch, ctx)
        finally:
            self.stepping = False
            traced = self.traced
            if traced:
                self.entries.extend(
                    item if type(item) is PendingEvent else PendingPut(*item) for item in traced
                )
                traced.clear()
