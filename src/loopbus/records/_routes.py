"""Where pending records go: each record's destinations resolved to the bus's record
subscribers whose role they name, once per destinations (cached until the bus's
subscriptions change), and the records nobody listens to kept, unread, as the latest
of their name.

Routing reads the bus's dispatch table (``table[PutRecord]``, rebuilt by the bus
whenever its subscriptions change); the bus never calls back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..events import PutRecord
from ..events._bus import DispatchTable, record_route
from ..events._subscription import Entry
from ._entries import PendingEvent, PendingPut, Unread
from ._readback import Routed

if TYPE_CHECKING:
    from loopbus.state._runstate import RunState

__all__ = ["Routes"]


class _Cache(dict[tuple[str, ...], tuple[Entry, ...]]):
    """destinations -> the entries of ``subscribers`` they go to, built on first use."""

    __slots__ = ("subscribers",)

    def __init__(self, subscribers: tuple[Entry, ...]) -> None:
        super().__init__()
        self.subscribers = subscribers

    def __missing__(self, destinations: tuple[str, ...]) -> tuple[Entry, ...]:
        entries = self[destinations] = record_route(self.subscribers, destinations)
        return entries


class Routes:
    """Takes the ``pending`` entries (the recorder's list) and routes them: each record
    to the subscribers of ``table[PutRecord]`` whose role its destinations name, each
    event as it is (the bus dispatches it when delivered). A record nobody listens to
    goes into ``latest`` (the stage's latest records) unread, with the step and epoch
    of ``state``, unless a record of its name goes out before it in the same flush."""

    __slots__ = ("_cache", "_table", "latest", "pending", "state")

    def __init__(
        self,
        table: DispatchTable,
        pending: list[PendingPut | PendingEvent],
        latest: dict[str, Any],
        state: RunState,
    ) -> None:
        self._table = table.keep(PutRecord)  # read at every flush
        self._cache = _Cache(())
        self.pending = pending
        self.latest = latest
        self.state = state

    def route(self) -> list[Routed]:
        """Empty the pending entries: those to deliver, in order, each with where it
        goes (see :data:`Routed`); the records nobody listens to are kept unread."""
        cache = self._cache
        if (subscribers := self._table[PutRecord]) is not cache.subscribers:
            cache = self._cache = _Cache(subscribers)  # the subscriptions changed
        routed: list[Routed] = []
        for item in self.pending:
            if type(item) is PendingPut and not cache[item.destinations] and not routed:
                self.latest[item.name] = Unread(item, self.state.step, self.state.epoch)
            elif type(item) is PendingPut and (entries := cache[item.destinations]):
                routed.append((item, entries))
            else:
                self._add(routed, item)
        self.pending.clear()
        return routed

    def _add(self, routed: list[Routed], item: PendingPut | PendingEvent) -> None:
        """Route ``item`` after ``routed`` (the entries before it that go out): an event,
        or a record nobody listens to after one that goes out."""
        if type(item) is PendingEvent:
            routed.append((item, None))
            return
        entries = self._cache[item.destinations]
        name = item.name
        if entries or any(
            type(earlier) is PendingPut and earlier.name == name for earlier, _ in routed
        ):
            # A record of this name going out first (to other destinations) is followed
            # to nobody by this one, so that the latest is this one, as put.
            routed.append((item, entries))
        else:  # nobody listens: kept unread until someone asks
            self.latest[name] = Unread(item, self.state.step, self.state.epoch)
