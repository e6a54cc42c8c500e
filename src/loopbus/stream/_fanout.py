"""The stream server's fan-out: which connected client wants which item, and handing
published items to the clients' queues.

Each item is encoded once, however many clients take it; the clients a record name goes
to are looked up once per name (until a subscription changes), and each client's filters
are matched against a name once (until that client's filters change: a subscription
change costs one match per name for that client alone, and a Subscribe that repeats the
filters in force costs none). A client's queue is
bounded: when it falls behind, its oldest items fall off, and the numbers of what fell
off are counted here until the client is told (a ``Gap``) or leaves. A version-1 client
(``docs/protocol.md``, "Versions") is sent its bye at the end of the stage, after that
stage's items; nothing later is queued for it."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
import msgspec

from ._connection import Connection
from ._limits import ROUTE_CACHE_LIMIT
from ._wire import EpochEnded, StageEnded, StageStarted, Subscribe, Subscribed

__all__ = ["EVENT_TYPES", "Fanout"]

#: The lifecycle events a server publishes (anything else published is a record).
EVENT_TYPES = (EpochEnded, StageStarted, StageEnded)

_Runs = list[tuple[tuple[Connection, ...], list[msgspec.Raw]]]


class Fanout:
    """The connected clients, their subscriptions, and the hand-over of published items
    (taken from ``pending``) to their queues. Whenever the clients that take records
    change, ``records_wanted`` is called with whether any does (publishers skip records
    nobody wants)."""

    def __init__(self, pending: deque[Any], records_wanted: Callable[[bool], None]) -> None:
        self._pending = pending
        self._records_wanted = records_wanted
        self._encode = msgspec.msgpack.Encoder().encode
        #: Clients connected now, and how many of them subscribed.
        self.connected = 0
        self.subscribers = 0
        #: The stage, step and epoch of the last item handed over (or published while
        #: no client could take it).
        self.stage: str | None = None
        self.step = 0
        self.epoch = 0
        #: Items dropped for slow clients that were reported in gap notices, and those
        #: of clients that left before they could be told.
        self.drops = 0
        self.clients: set[Connection] = set()
        #: The clients in a fixed order, those subscribed to records and those to
        #: events; the clients each record name goes to, cached.
        self.client_list: tuple[Connection, ...] = ()
        self._record_clients: tuple[Connection, ...] = ()
        self._event_clients: tuple[Connection, ...] = ()
        self._routes: dict[str, tuple[Connection, ...]] = {}
        # The event clients that take StageStarted items (version 2 on), and the clients
        # that said version 1 (their connections end with the stage).
        self._start_clients: tuple[Connection, ...] = ()
        self._stage_clients: set[Connection] = set()
        # Set once no client is left, while the server waits for that to close.
        self._all_gone: anyio.Event | None = None

    @property
    def dropped(self) -> int:
        """Items dropped for slow clients so far, reported to them or not yet."""
        return self.drops + sum(c.pending_drops() for c in self.client_list)

    def note(self, event: Any) -> None:
        """Follow the stage, step and epoch (for new clients' ``Welcome``)."""
        kind = type(event)
        if kind is StageStarted:
            self.stage = event.stage
        elif kind is StageEnded:
            self.stage = None
        self.step = event.step
        self.epoch = event.epoch

    # ------------------------------------------------------------ clients
    def admit(self, client: Connection, *, stage_bound: bool) -> None:
        """Count ``client`` in (it takes a slot at once); ``stage_bound`` for a client
        whose connection ends with the stage (version 1)."""
        self.clients.add(client)
        self.client_list = tuple(self.clients)
        self.connected = len(self.clients)
        if stage_bound:
            self._stage_clients.add(client)

    def subscribe(self, client: Connection, message: Subscribe) -> None:
        """Replace ``client``'s filters, and queue the acknowledgement: items published
        before it are handed out under the old filters."""
        self.distribute()
        if client.bye is not None and client in self._stage_clients:
            return  # version 1: its stage ended, its bye is on the way
        if client.set_filters(message.names, message.topics):
            self._routes_changed()
        client.acks.append(
            Subscribed(seq=client.next_seq, names=list(message.names), topics=list(message.topics))
        )
        client.notify()

    def forget(self, client: Connection) -> None:
        """``client`` is gone: count what it was never told it lost, and queue nothing
        more for it."""
        if client in self.clients:
            self.drops += client.pending_drops()
            self.clients.discard(client)
            self._stage_clients.discard(client)
            self.connected = len(self.clients)
            self._routes_changed()
            if not self.clients and self._all_gone is not None:
                self._all_gone.set()

    async def close_all(self, reason: str, linger: float) -> None:
        """Hand over what is waiting, then let every client receive what is queued for it
        and ``Bye(code="end", reason=reason)``, waiting at most ``linger`` seconds for them
        to leave."""
        self.distribute()
        all_gone = self._all_gone = anyio.Event()
        for client in self.client_list:
            client.close("end", reason, flush=True)
        if self.clients:
            with anyio.move_on_after(linger):
                await all_gone.wait()

    def clear(self) -> None:
        """Forget every client at once (the server stopped)."""
        self.clients.clear()
        self.client_list = self._record_clients = self._event_clients = ()
        self._start_clients = ()
        self._stage_clients.clear()
        self._routes.clear()
        self.connected = self.subscribers = 0

    def _routes_changed(self) -> None:
        clients = sorted(self.clients, key=id)
        self.client_list = tuple(clients)
        self._record_clients = tuple(c for c in clients if "records" in c.topics)
        self._routes.clear()
        self._event_clients = tuple(c for c in clients if "events" in c.topics)
        stage_clients = self._stage_clients
        self._start_clients = tuple(c for c in self._event_clients if c not in stage_clients)
        self.subscribers = sum(1 for c in clients if c.topics)
        self._records_wanted(bool(self._record_clients))

    # ------------------------------------------------------------ the hand-over
    def distribute(self) -> None:
        """Encode each waiting item once and queue it for every client that wants it.

        The per-record path: consecutive items going to the same clients are gathered in
        one list and each client's queue is extended once per list (not appended to once
        per item), and the step and epoch are taken from the last item only."""
        pending = self._pending
        popleft = pending.popleft
        encode = self._encode
        routes = self._routes
        event_types = EVENT_TYPES
        raw_type = msgspec.Raw
        # (clients, items for them): one entry per run of items with the same clients.
        runs: _Runs = []
        targets: tuple[Connection, ...] = ()
        items: list[msgspec.Raw] = []
        last = None
        while pending:
            item = last = popleft()
            if isinstance(item, event_types):
                self.note(item)
                if self._stage_clients and isinstance(item, StageEnded):
                    self._end_stage(runs, item)
                    runs = []
                    targets = ()
                    continue
                kind = type(item)
                wanted = self._event_clients if kind is not StageStarted else self._start_clients
                if not wanted:
                    continue
                raw = raw_type(encode(item))
            else:
                if not self._record_clients:
                    continue
                wanted = routes.get(item.name)  # type: ignore[assignment]
                if wanted is None:
                    wanted = self._route(item.name)
                if not wanted:
                    continue
                # record_fields(item), inlined: this runs once per record.
                fields = ("R", item.name, item.value, item.step, item.epoch, item.time, item.source)
                raw = raw_type(encode(fields))
            if wanted is not targets and wanted != targets:  # (each name has its own tuple)
                targets = wanted
                items = []
                runs.append((targets, items))
            items.append(raw)
        if last is not None and not isinstance(last, event_types):
            self.step = last.step
            self.epoch = last.epoch
        self._hand_over(runs)
        for client in self.client_list:
            if client.queue:
                client.notify()

    @staticmethod
    def _hand_over(runs: _Runs) -> None:
        """Queue each run's items for its clients (numbering them)."""
        for clients, batch in runs:
            for client in clients:
                client.queue.extend(batch)
                client.next_seq += len(batch)

    def _end_stage(self, runs: _Runs, event: StageEnded) -> None:
        """Version 1's stage end: each version-1 client receives what came before
        ``event`` (and it, if the client takes events), then ``Bye(code="end")``, and
        nothing more is queued for it."""
        if self._event_clients:
            runs.append((self._event_clients, [msgspec.Raw(self._encode(event))]))
        self._hand_over(runs)
        for client in self._stage_clients:
            if client.bye is None:
                client.close("end", f"the {event.stage} stage ended", flush=True)
                client.set_filters([], [])
        self._routes_changed()

    def _route(self, name: str) -> tuple[Connection, ...]:
        """The subscribed clients whose name filters accept ``name`` (cached per name
        until the subscriptions change)."""
        routes = self._routes
        if len(routes) >= ROUTE_CACHE_LIMIT:
            routes.clear()
        targets = routes[name] = tuple(c for c in self._record_clients if c.takes(name))
        return targets
