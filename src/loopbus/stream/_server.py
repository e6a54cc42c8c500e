"""``loopbus.stream.Server``: serve put records and lifecycle events to other processes.

A dashboard, a notebook or ``loopbus watch`` connects over TCP or a Unix socket, says
which record names it wants, and receives them in the order they were published, each
with a per-client sequence number. The protocol is specified in ``docs/protocol.md``.
The server knows nothing of trainers: whoever owns it hands it records and events
(``publish_record`` / ``publish_event``); ``loopbus.plugins.StreamServer`` does that for
a trainer.

How it stays off the publisher's critical path: publishing appends the item to one
queue (a ``deque``, safe to append to from any thread), which is all the publisher ever
pays, and wakes the server's *pump* when it idles. The pump runs on the server's event
loop: it encodes each item once, appends it to the bounded queue of every client that
wants it, and wakes their writers, at most once per ``flush_interval`` (records published
meanwhile go out together: many records per frame, many frames per ``send``). A client
that reads too slowly loses its oldest queued items, never slows the publisher, and is
told exactly how many it lost (a ``Gap``). Nothing a client sends reaches the publisher:
bad frames end that client's connection with a reason (``Bye``), and an unexpected error
in a connection's task is logged and ends only that connection.

The server runs on the event loop of the task that serves it (``async with server`` or
``await server.serve()``), or on an event loop of its own in a background thread
(:meth:`Server.start_in_thread`): then it outlives the publisher's event loops, and
reaches its clients even while the publisher's loop is busy.

A connection speaks the protocol version its client's ``Hello`` names, for good: a
version-1 client gets version 1's promises (its connection ends with the stage, after
that stage's items and a ``Bye``; no ``StageStarted`` items), a version-2 client stays
connected from stage to stage.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import stat
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
import sniffio
from anyio.abc import SocketAttribute

from .._exceptions import MisconfigurationError, StreamError
from .._validate import check_int, check_number
from ._address import Address, is_loopback, parse_address
from ._connection import Connection, Rejected, decode_client_message, match_nothing, matcher
from ._wire import (
    MAX_CLIENT_FRAME,
    PROTOCOL_VERSIONS,
    TOPICS,
    Bye,
    ClientMessage,
    EpochEnded,
    Hello,
    StageEnded,
    StageStarted,
    Subscribe,
    Subscribed,
    Welcome,
    append_frame,
)

if TYPE_CHECKING:
    from anyio.abc import Listener, SocketStream, TaskGroup, TaskStatus

    from ..events import PutRecord

__all__ = ["Server"]

logger = logging.getLogger("loopbus.stream")

_FREE_PORT = "0 picks a free port"
_GONE = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)
_RECEIVE_SIZE = 65536
_CACHE_LIMIT = 4096
_BYE_TIMEOUT = 1.0
_DISCARD_LIMIT = 1 << 20
#: A queue length never reached: the pump is not to be woken.
_NEVER = sys.maxsize
_EVENT_TYPES = (EpochEnded, StageStarted, StageEnded)
#: The version whose connections end with their stage (docs/protocol.md, "Versions").
_STAGE_VERSION = 1


def _spoken(versions: tuple[int, ...]) -> str:
    """``"1 and 2"``: the versions a server speaks, in words."""
    words = [str(v) for v in versions]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


async def _close(resource: Any) -> None:
    """Close ``resource`` now, even in a cancelled scope (shielded, then forcefully)."""
    with anyio.CancelScope(shield=True):
        await anyio.aclose_forcefully(resource)


def _format_address(kind: str, sockname: Any) -> str:
    if kind == "unix":
        return str(Address("unix", path=str(sockname)))
    host, port = sockname[0], sockname[1]
    return str(Address("tcp", host=host, port=port))


def _threadsafe_caller() -> Callable[[Callable[[], None]], None]:
    """How another thread schedules a call on the running event loop (without waiting)."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    import asyncio

    loop = asyncio.get_running_loop()

    def call(callback: Callable[[], None]) -> None:
        loop.call_soon_threadsafe(callback)

    return call


class Server:
    """Serve records and lifecycle events to clients in other processes.

    * ``host``, ``port``: the TCP address (``port=0`` picks a free port; read it from
      :attr:`address`). Loopback by default; any other host needs a ``token``.
      ``host=None`` serves no TCP.
    * ``path``: also (or, with ``host=None``, only) serve on this Unix socket (created
      with mode 0600; a stale socket file is replaced, a live one is an error).
    * ``token``: a shared secret clients must present (compared in constant time).
      Required to bind beyond loopback. It authenticates, it does not encrypt: across
      untrusted networks, tunnel the port (``ssh -L``) instead.
    * ``client_buffer``: items queued per client (sent to clients as
      ``Welcome.buffer``); when a client falls this far behind, its oldest items are
      dropped and it receives a gap notice.
    * ``send_buffer``: bytes the operating system may buffer per client (``SO_SNDBUF``);
      None keeps its default, which grows to megabytes for a client that stops reading.
    * ``max_clients``: clients served at once; a ``Hello`` beyond this is turned away
      (``busy``), however many arrive together.
    * ``max_frame``: the largest frame (bytes) a client may send.
    * ``flush_interval``: after handing items to the clients' writers, the server waits
      this long (s) before the next hand-over, so that items published meanwhile go out
      together; an item published after a quiet spell goes out at once, and half a
      ``client_buffer`` of waiting items ends the wait early. 0 sends at once.
    * ``linger``: when the server closes, seconds to let clients receive what is queued
      and the closing bye before they are disconnected.
    * ``handshake_timeout``: seconds a new connection has to send its ``Hello``.

    Serve with ``async with server:`` (or ``await server.serve()`` in a task group) on
    the current event loop, or :meth:`start_in_thread`; stop with :meth:`close` (any
    thread) or :meth:`aclose`. A server serves once. Counters for monitoring:
    :attr:`connected`, :attr:`subscribers`, :attr:`accepted`, :attr:`rejected`,
    :attr:`dropped`, :attr:`errors`.

    It speaks every protocol version of :attr:`versions`; each connection the one its
    client's ``Hello`` names.
    """

    #: The protocol versions the server speaks (told to clients in ``Welcome.versions``,
    #: and in the reason of the ``Bye`` that refuses any other).
    versions: tuple[int, ...] = PROTOCOL_VERSIONS

    def __init__(
        self,
        host: str | None = "127.0.0.1",
        port: int = 0,
        *,
        path: str | os.PathLike[str] | None = None,
        token: str | None = None,
        client_buffer: int = 16384,
        send_buffer: int | None = None,
        max_clients: int = 64,
        max_frame: int = MAX_CLIENT_FRAME,
        flush_interval: float = 0.1,
        linger: float = 2.0,
        handshake_timeout: float = 10.0,
        owner: str = "Server",
    ) -> None:
        if host is None and path is None:
            raise MisconfigurationError(
                f"{owner} needs somewhere to listen: a TCP host (host='127.0.0.1') "
                "and/or a Unix socket path (path='/tmp/run.sock')."
            )
        if host is not None and (not isinstance(host, str) or not host.strip()):
            raise MisconfigurationError(
                f"{owner}(host=...) must be a host name or IP address such as "
                f"'127.0.0.1', got {host!r}; use host=None to serve only a Unix socket."
            )
        check_int("port", port, minimum=0, maximum=65535, owner=owner, hint=_FREE_PORT)
        if token is not None and (not isinstance(token, str) or not token):
            raise MisconfigurationError(
                f"{owner}(token=...) must be a non-empty str or None, got {token!r}."
            )
        if host is not None and not is_loopback(host) and token is None:
            raise MisconfigurationError(
                f"{owner}(host={host!r}) would accept connections from other machines, "
                "which requires a token: pass token='<a long random secret>' (clients give "
                "it to loopbus.connect(..., token=...) or `loopbus watch --token`), or bind "
                "to a loopback address such as host='127.0.0.1'."
            )
        check_int("client_buffer", client_buffer, owner=owner, hint="it counts records")
        check_int("max_clients", max_clients, owner=owner)
        check_int("max_frame", max_frame, minimum=64, owner=owner, hint="it counts bytes")
        check_int(
            "send_buffer",
            send_buffer,
            minimum=1024,
            allow_none=True,
            owner=owner,
            hint="it counts bytes, and None keeps the system's default",
        )
        seconds = "a number of seconds"
        check_number("flush_interval", flush_interval, minimum=0, owner=owner, what=seconds)
        check_number("linger", linger, minimum=0, owner=owner, what=seconds)
        check_number("handshake_timeout", handshake_timeout, minimum=0, owner=owner, what=seconds)
        self.host = host.strip() if host is not None else None
        self.port = port
        self.path = os.fspath(path) if path is not None else None
        self.token = token
        self.client_buffer = client_buffer
        self.send_buffer = send_buffer
        self.max_clients = max_clients
        self.max_frame = max_frame
        self.flush_interval = float(flush_interval)
        self.linger = float(linger)
        self.handshake_timeout = float(handshake_timeout)
        self._owner = owner
        #: Where the server listens while it serves ("tcp://127.0.0.1:PORT" first).
        self.addresses: tuple[str, ...] = ()
        #: Clients connected now, and how many of them subscribed; in total: handshakes
        #: accepted, connections turned away or closed for a protocol violation, and
        #: unexpected errors in connection tasks (logged to the "loopbus.stream" logger;
        #: they end only that connection).
        self.connected = 0
        self.subscribers = 0
        self.accepted = 0
        self.rejected = 0
        self.errors = 0
        #: The stage, step and epoch of the last item published (told to new clients in
        #: their ``Welcome``).
        self.stage: str | None = None
        self.step = 0
        self.epoch = 0
        self._dropped = 0
        self._token = token.encode() if token is not None else b""
        self._encode = msgspec.msgpack.Encoder().encode
        self._encoder = msgspec.msgpack.Encoder()
        self._decode = msgspec.msgpack.Decoder(ClientMessage).decode
        self._clients: set[Connection] = set()
        self._client_list: tuple[Connection, ...] = ()
        self._record_clients: tuple[Connection, ...] = ()
        self._routes: dict[str, tuple[Connection, ...]] = {}
        self._event_clients: tuple[Connection, ...] = ()
        # The event clients that take StageStarted items (version 2 on), and the clients
        # that said version 1 (their connections end with the stage).
        self._start_clients: tuple[Connection, ...] = ()
        self._stage_clients: set[Connection] = set()
        # Publishing: the items waiting for the pump, the queue length that wakes it, and
        # whether records are wanted at all (read by publishers on any thread).
        self._pending: deque[Any] = deque()
        self._pump_at = _NEVER
        self._high = max(1, client_buffer // 2)
        self._records_wanted = False
        self._serving = False
        self._state = "new"
        self._close_reason = "the server closed"
        # Set while serving: the loop's thread, how to call on it from another thread.
        self._loop_thread: int | None = None
        self._call_soon: Callable[[Callable[[], None]], None] | None = None
        self._pump_event: anyio.Event | None = None
        self._close_event: anyio.Event | None = None
        self._finished: anyio.Event | None = None
        self._all_gone: anyio.Event | None = None
        self._conn_tg: TaskGroup | None = None
        self._own_tg: TaskGroup | None = None
        self._thread: threading.Thread | None = None

    @classmethod
    def from_address(cls, address: str | Address, **options: Any) -> Server:
        """``Server.from_address("tcp://127.0.0.1:8765")`` or ``("unix:///tmp/run.sock")``;
        ``options`` are the constructor's."""
        where = parse_address(address)
        if where.kind == "unix":
            return cls(host=None, path=where.path, **options)
        return cls(host=where.host, port=where.port, **options)

    @property
    def dropped(self) -> int:
        """Items dropped for slow clients so far, over all clients (each client's share
        is reported to it in gap notices)."""
        return self._dropped + sum(c.pending_drops() for c in self._client_list)

    @property
    def address(self) -> str | None:
        """The first address served, while the server serves (None otherwise)."""
        addresses = self.addresses
        return addresses[0] if addresses else None

    @property
    def serving(self) -> bool:
        """True from the moment the server listens until it closed."""
        return self._serving

    @property
    def closed(self) -> bool:
        """True once the server served and stopped (a server serves once)."""
        return self._state == "closed"

    def __repr__(self) -> str:
        where = self.address or (
            f"tcp://{self.host}:{self.port}" if self.host is not None else f"unix://{self.path}"
        )
        return f"<{self._owner} {where} clients={self.connected}>"

    # ------------------------------------------------------------ publishing (any thread)
    def publish_record(self, record: PutRecord) -> None:
        """Send ``record`` (a :class:`~loopbus.PutRecord`, or any object with its fields)
        to the clients whose filters accept its name. Costs the caller an append; safe
        from any thread; a no-op while no client subscribed to records."""
        if self._records_wanted:
            pending = self._pending
            pending.append(record)
            if len(pending) >= self._pump_at:
                self._kick()

    def publish_event(self, event: StageStarted | StageEnded | EpochEnded) -> None:
        """Send a lifecycle event to the clients subscribed to ``"events"`` (in order with
        the records published before and after it). Safe from any thread."""
        if not isinstance(event, _EVENT_TYPES):
            raise MisconfigurationError(
                f"{self._owner}.publish_event() takes a StageStarted, StageEnded or "
                f"EpochEnded from loopbus.stream, got {event!r}."
            )
        if self._serving:
            pending = self._pending
            pending.append(event)
            if len(pending) >= self._pump_at:
                self._kick()
        else:
            self._note(event)

    def _kick(self) -> None:
        """Wake the pump, from whichever thread published."""
        self._pump_at = _NEVER
        if threading.get_ident() == self._loop_thread:
            self._wake_pump()
        else:
            call = self._call_soon
            if call is not None:
                with contextlib.suppress(RuntimeError):  # the loop just closed
                    call(self._wake_pump)

    def _wake_pump(self) -> None:
        if self._pump_event is not None:
            self._pump_event.set()

    def _note(self, event: Any) -> None:
        """Follow the stage, step and epoch (for new clients' ``Welcome``)."""
        kind = type(event)
        if kind is StageStarted:
            self.stage = event.stage
        elif kind is StageEnded:
            self.stage = None
        self.step = event.step
        self.epoch = event.epoch

    # ------------------------------------------------------------ lifetime
    async def __aenter__(self) -> Server:
        tg = anyio.create_task_group()
        await tg.__aenter__()
        try:
            await tg.start(self.serve)
        except BaseException:
            await tg.__aexit__(*sys.exc_info())
            raise
        self._own_tg = tg
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        tg, self._own_tg = self._own_tg, None
        self.close()
        assert tg is not None
        return await tg.__aexit__(exc_type, exc, tb)

    def close(self, reason: str = "the server closed") -> None:
        """Stop serving (from any thread; returns at once): stop accepting, let every
        client receive what is queued and ``Bye(code="end", reason=reason)`` (waiting at
        most ``linger`` seconds), then close the connections and listeners."""
        if self._state == "new":
            self._state = "closed"
            return
        if self._state != "serving":
            return
        self._state = "closing"
        self._close_reason = reason
        if threading.get_ident() == self._loop_thread:
            self._request_close()
        else:
            call = self._call_soon
            if call is not None:
                with contextlib.suppress(RuntimeError):
                    call(self._request_close)

    def _request_close(self) -> None:
        if self._close_event is not None:
            self._close_event.set()

    async def aclose(self, reason: str = "the server closed") -> None:
        """:meth:`close`, and wait until the server stopped (call it on the server's event
        loop; use :meth:`join` for a server in a thread)."""
        finished = self._finished
        self.close(reason)
        if finished is not None:
            await finished.wait()

    def start_in_thread(self, name: str = "loopbus stream server") -> None:
        """Serve from a daemon thread with an event loop of its own (asyncio) until
        :meth:`close`; returns once the server listens, or raises why it could not."""
        ready = threading.Event()
        failure: list[BaseException] = []

        async def main() -> None:
            try:
                async with anyio.create_task_group() as tg:
                    await tg.start(self.serve)
                    ready.set()
            except BaseException as exc:
                if ready.is_set():
                    raise
                failure.append(exc)
                ready.set()

        def run() -> None:
            try:
                anyio.run(main)
            except Exception:
                logger.exception("stream server: the server thread failed")

        if self._state != "new":
            raise RuntimeError(f"{self!r} already served; a server serves once.")
        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        ready.wait()
        if failure:
            thread.join()
            raise failure[0]
        self._thread = thread

    def join(self, timeout: float | None = None) -> bool:
        """Wait until the thread of :meth:`start_in_thread` ended (at most ``timeout``
        seconds); True if it did (or there is none)."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Listen, report started (with ``task_group.start``), and serve until
        :meth:`close`."""
        if self._state != "new":
            raise RuntimeError(f"{self!r} already served; a server serves once.")
        self._state = "starting"
        try:
            listeners = await self._listen()
        except BaseException:
            self._state = "closed"
            raise
        finished = self._finished = anyio.Event()
        self._close_event = anyio.Event()
        self._pump_event = anyio.Event()
        self._all_gone = anyio.Event()
        self._loop_thread = threading.get_ident()
        self._call_soon = _threadsafe_caller()
        accept_scope = anyio.CancelScope()
        try:
            async with anyio.create_task_group() as tg:
                self._conn_tg = tg
                tg.start_soon(self._accept_all, listeners, accept_scope)
                tg.start_soon(self._pump, name="loopbus stream pump")
                self._serving = True
                self._state = "serving"
                task_status.started()
                await self._close_event.wait()
                accept_scope.cancel()
                self._distribute()
                reason = self._close_reason
                # A fresh event: an earlier moment without clients set the first one.
                all_gone = self._all_gone = anyio.Event()
                for client in self._client_list:
                    client.close("end", reason, flush=True)
                if self._clients:
                    with anyio.move_on_after(self.linger):
                        await all_gone.wait()
                tg.cancel_scope.cancel()
        finally:
            self._serving = False
            self._records_wanted = False
            self._state = "closed"
            self._call_soon = None
            self._pending.clear()
            try:
                for listener in listeners:
                    await _close(listener)
                self._remove_unix_path()
            finally:
                self.addresses = ()
                self._conn_tg = None
                self._clients.clear()
                self._client_list = self._record_clients = self._event_clients = ()
                self._start_clients = ()
                self._stage_clients.clear()
                self._routes.clear()
                self.connected = self.subscribers = 0
                finished.set()

    async def _listen(self) -> list[Listener[Any]]:
        listeners: list[tuple[str, Listener[Any]]] = []
        owner = self._owner
        try:
            if self.host is not None:
                try:
                    multi = await anyio.create_tcp_listener(
                        local_host=self.host, local_port=self.port
                    )
                except OSError as exc:
                    where = Address("tcp", host=self.host, port=self.port)
                    raise StreamError(
                        f"{owner} could not listen on {where}: {exc.strerror or exc}. "
                        "Choose another port (port=0 picks a free one)."
                    ) from exc
                listeners += [("tcp", listener) for listener in multi.listeners]
            if self.path is not None:
                self._check_unix_path(self.path)
                try:
                    unix = await anyio.create_unix_listener(self.path, mode=0o600)
                except OSError as exc:
                    raise StreamError(
                        f"{owner} could not listen on unix://{self.path}: {exc.strerror or exc}."
                    ) from exc
                listeners.append(("unix", unix))
        except BaseException:
            for _, listener in listeners:
                await _close(listener)
            raise
        addresses: list[str] = []
        for kind, listener in listeners:
            address = _format_address(kind, listener.extra(SocketAttribute.local_address))
            if address not in addresses:
                addresses.append(address)
        self.addresses = tuple(addresses)
        return [listener for _, listener in listeners]

    def _check_unix_path(self, path: str) -> None:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise StreamError(
                f"{self._owner} cannot listen on unix://{path}: the path exists and is not a "
                "socket. Choose another path."
            )
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.settimeout(1.0)
            probe.connect(path)
        except OSError:
            return  # a stale socket file: create_unix_listener replaces it
        finally:
            probe.close()
        raise StreamError(
            f"{self._owner} cannot listen on unix://{path}: another server is listening "
            "there. Choose another path."
        )

    def _remove_unix_path(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(os.stat(self.path).st_mode):
                    os.unlink(self.path)

    # ------------------------------------------------------------ the pump
    async def _pump(self) -> None:
        """Hand published items to the clients' queues: at once after a quiet spell, then
        at most once per ``flush_interval`` (or when half a client buffer waits)."""
        pending = self._pending
        interval = self.flush_interval
        while True:
            self._pump_at = 1
            if not pending:
                await self._wait_for_items()
            self._distribute()
            if interval:
                self._pump_at = self._high
                with anyio.move_on_after(interval):
                    await self._wait_for_items()

    async def _wait_for_items(self) -> None:
        event = self._pump_event
        assert event is not None
        await event.wait()
        self._pump_event = anyio.Event()

    def _distribute(self) -> None:
        """Encode each waiting item once and queue it for every client that wants it.

        The per-record path: consecutive items going to the same clients are gathered in
        one list and each client's queue is extended once per list (not appended to once
        per item), and the step and epoch are taken from the last item only. At a
        ``StageEnded``, version-1 clients get what came before it (and it, if they take
        events), then their bye: nothing after it is queued for them."""
        pending = self._pending
        popleft = pending.popleft
        encode = self._encode
        routes = self._routes
        event_types = _EVENT_TYPES
        raw_type = msgspec.Raw
        # (clients, items for them): one entry per run of items with the same clients.
        runs: list[tuple[tuple[Connection, ...], list[msgspec.Raw]]] = []
        targets: tuple[Connection, ...] = ()
        items: list[msgspec.Raw] = []
        last = None
        while pending:
            item = last = popleft()
            if isinstance(item, event_types):
                self._note(item)
                kind = type(item)
                wanted = self._event_clients if kind is not StageStarted else self._start_clients
                if self._stage_clients and isinstance(item, StageEnded):
                    if wanted:
                        runs.append((wanted, [raw_type(encode(item))]))
                    self._hand_over(runs)
                    runs = []
                    targets = ()
                    self._end_stage(item.stage)
                    continue
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
                raw = raw_type(
                    encode(
                        (
                            "R",
                            item.name,
                            item.value,
                            item.step,
                            item.epoch,
                            item.time,
                            item.source,
                        )
                    )
                )
            if wanted is not targets and wanted != targets:  # (each name has its own tuple)
                targets = wanted
                items = []
                runs.append((targets, items))
            items.append(raw)
        if last is not None and not isinstance(last, event_types):
            self.step = last.step
            self.epoch = last.epoch
        self._hand_over(runs)
        for client in self._client_list:
            if client.queue:
                client.notify()

    @staticmethod
    def _hand_over(runs: list[tuple[tuple[Connection, ...], list[msgspec.Raw]]]) -> None:
        """Queue each run's items for its clients (numbering them)."""
        for clients, batch in runs:
            for client in clients:
                client.queue.extend(batch)
                client.next_seq += len(batch)

    def _end_stage(self, stage: str) -> None:
        """Version 1's stage end: each version-1 client receives what is queued for it,
        then ``Bye(code="end")``, and nothing more is queued for it."""
        for client in self._stage_clients:
            if client.bye is None:
                client.close("end", f"the {stage} stage ended", flush=True)
                client.match = match_nothing
                client.topics = frozenset()
        self._routes_changed()

    def _route(self, name: str) -> tuple[Connection, ...]:
        """The subscribed clients whose name filters accept ``name`` (cached per name
        until the subscriptions change)."""
        routes = self._routes
        if len(routes) >= _CACHE_LIMIT:
            routes.clear()
        targets = routes[name] = tuple(c for c in self._record_clients if c.match(name))
        return targets

    # ------------------------------------------------------------ connections
    async def _accept_all(self, listeners: list[Listener[Any]], scope: anyio.CancelScope) -> None:
        try:
            with scope:
                async with anyio.create_task_group() as tg:
                    for listener in listeners:
                        tg.start_soon(self._accept_loop, listener)
        finally:
            for listener in listeners:
                await _close(listener)
            self._remove_unix_path()

    async def _accept_loop(self, listener: Listener[Any]) -> None:
        while True:
            try:
                stream = await listener.accept()  # type: ignore[attr-defined]
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
            except OSError as exc:  # out of file descriptors, aborted connection, ...
                logger.warning("stream server: accept failed: %s", exc)
                await anyio.sleep(0.1)
                continue
            assert self._conn_tg is not None
            self._conn_tg.start_soon(self._handle, stream, name="loopbus stream client")

    async def _handle(self, stream: SocketStream) -> None:
        try:
            peer = str(stream.extra(SocketAttribute.remote_address, "?"))
        except Exception:
            peer = "?"
        if self.send_buffer is not None:
            raw = stream.extra(SocketAttribute.raw_socket, None)
            if raw is not None:
                with contextlib.suppress(OSError):
                    raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer)
        client = Connection(stream, self.client_buffer, self.max_frame, peer or "unix")
        try:
            try:
                await self._serve_client(client)
            except Rejected as rejected:
                self.rejected += 1
                logger.info("stream server: closing %s: %s", client.peer, rejected.reason)
                await self._say_bye(client, rejected.code, rejected.reason)
        except _GONE:
            pass
        except Exception:
            self.errors += 1
            logger.exception("stream server: unexpected error serving %s", client.peer)
        finally:
            self._forget(client)
            await _close(stream)

    async def _serve_client(self, client: Connection) -> None:
        hello: Any = None
        with anyio.move_on_after(self.handshake_timeout):
            hello = await self._receive(client)
            if hello is None:
                return
        if hello is None:
            raise Rejected("timeout", f"no Hello within {self.handshake_timeout:g} s.")
        if not isinstance(hello, Hello):
            raise Rejected(
                "unexpected", f"the first message must be Hello, got {type(hello).__name__}."
            )
        if hello.version not in self.versions:
            raise Rejected(
                "version",
                f"this server speaks protocol versions {_spoken(self.versions)}; the client "
                f"asked for version {hello.version}.",
            )
        if self.token is not None:
            if hello.token is None:
                raise Rejected("auth", "this server requires a token; none was given.")
            if not hmac.compare_digest(hello.token.encode(), self._token):
                raise Rejected("auth", "wrong token.")
        if len(self._clients) >= self.max_clients:
            raise Rejected("busy", f"the server already has {self.max_clients} clients.")
        if not self._serving or self._state != "serving":
            raise Rejected("busy", "the server is closing.")
        # Take the slot before the first await: counting the client only once its welcome
        # is sent would let every handshake waiting in that send pass the check above.
        self._clients.add(client)
        self._client_list = tuple(self._clients)
        self.connected = len(self._clients)
        if hello.version == _STAGE_VERSION:
            self._stage_clients.add(client)
        from .. import __version__

        welcome = Welcome(
            version=hello.version,
            server=f"loopbus {__version__}",
            stage=self.stage,
            step=self.step,
            epoch=self.epoch,
            time=time.time(),
            max_frame=self.max_frame,
            buffer=self.client_buffer,
            topics=list(TOPICS),
            versions=list(self.versions),
        )
        await self._send_now(client, welcome)
        self.accepted += 1
        async with anyio.create_task_group() as tg:
            client.scope = tg.cancel_scope
            tg.start_soon(self._write, client, name="loopbus stream writer")
            try:
                await self._read(client)
            finally:
                client.input_closed.set()
            if client.bye is None:
                # The client left (bye or end of input): nothing more to send to it.
                tg.cancel_scope.cancel()
            # Otherwise the writer is sending our bye; it ends the connection after that.

    async def _receive(self, client: Connection) -> Any:
        """The next message from ``client``; None when it is gone. Frames are judged one
        at a time, in order: an error in a frame is raised (as :class:`Rejected`) only
        once every message before it was handled, however the bytes arrived."""
        reader = client.reader
        while True:
            try:
                frame = reader.next_frame()
            except StreamError as exc:
                raise Rejected("too_large", str(exc)) from None
            if frame is not None:
                return decode_client_message(self._decode, frame)
            try:
                data = await client.stream.receive(_RECEIVE_SIZE)
            except _GONE:
                return None
            reader.push(data)

    async def _read(self, client: Connection) -> None:
        """Handle the client's messages until it closes its side. After a protocol
        violation, ask the writer for a bye and discard the rest of the input."""
        try:
            while True:
                message = await self._receive(client)
                if message is None or isinstance(message, Bye):
                    return
                if isinstance(message, Subscribe):
                    self._subscribe(client, message)
                else:
                    raise Rejected("unexpected", f"unexpected {type(message).__name__} message.")
        except Rejected as rejected:
            self.rejected += 1
            logger.info("stream server: closing %s: %s", client.peer, rejected.reason)
            client.close(rejected.code, rejected.reason, flush=False)
        discarded = 0
        while discarded < _DISCARD_LIMIT:
            try:
                discarded += len(await client.stream.receive(_RECEIVE_SIZE))
            except _GONE:
                return

    def _subscribe(self, client: Connection, message: Subscribe) -> None:
        unknown = sorted(set(message.topics) - set(TOPICS))
        if unknown:
            raise Rejected("malformed", f"unknown topic(s) {unknown}; topics are {list(TOPICS)}.")
        # Items published before this point are handed out under the old filters.
        self._distribute()
        if client.bye is not None and client in self._stage_clients:
            return  # version 1: its stage ended, its bye is on the way
        client.match = matcher(message.names)
        client.topics = frozenset(message.topics)
        self._routes_changed()
        client.acks.append(
            Subscribed(seq=client.next_seq, names=list(message.names), topics=list(message.topics))
        )
        client.notify()

    def _routes_changed(self) -> None:
        clients = sorted(self._clients, key=id)
        self._client_list = tuple(clients)
        self._record_clients = tuple(c for c in clients if "records" in c.topics)
        self._routes.clear()
        self._event_clients = tuple(c for c in clients if "events" in c.topics)
        stage_clients = self._stage_clients
        self._start_clients = tuple(c for c in self._event_clients if c not in stage_clients)
        self.subscribers = sum(1 for c in clients if c.topics)
        self._records_wanted = self._serving and bool(self._record_clients)

    def _forget(self, client: Connection) -> None:
        if client in self._clients:
            self._dropped += client.pending_drops()
            self._clients.discard(client)
            self._stage_clients.discard(client)
            self.connected = len(self._clients)
            self._routes_changed()
            if not self._clients and self._all_gone is not None:
                self._all_gone.set()

    # ------------------------------------------------------------ writing
    async def _write(self, client: Connection) -> None:
        buffer = bytearray()
        stream = client.stream
        try:
            while True:
                if not client.queue and not client.acks and client.bye is None:
                    client.waiting = True
                    await client.wake.wait()
                    client.wake = anyio.Event()
                if client.bye is not None and not client.flush:
                    break
                self._dropped += client.fill(buffer, self._encoder)
                if not buffer:
                    if client.bye is not None:
                        break
                    continue
                data = bytes(buffer)
                buffer.clear()
                await stream.send(data)
        except _GONE:
            if client.scope is not None:
                client.scope.cancel()
            return
        assert client.bye is not None
        with anyio.move_on_after(_BYE_TIMEOUT):
            try:
                await self._send_now(client, Bye(code=client.bye[0], reason=client.bye[1]))
                await stream.send_eof()
                # Let the client read the bye and close its side before closing ours
                # (closing with input unread would reset the connection and could destroy
                # the bye before the client reads it).
                await client.input_closed.wait()
            except (*_GONE, TimeoutError):
                pass
        if client.scope is not None:
            client.scope.cancel()

    async def _send_now(self, client: Connection, message: Any) -> None:
        buffer = bytearray()
        append_frame(self._encoder, message, buffer)
        with anyio.fail_after(max(self.handshake_timeout, 1.0)):
            await client.stream.send(bytes(buffer))

    async def _say_bye(self, client: Connection, code: str, reason: str) -> None:
        """Turn a client away during the handshake: send the bye, half-close, and discard
        what it still sends until it closes (see :meth:`_write`)."""
        with anyio.move_on_after(_BYE_TIMEOUT):
            try:
                await self._send_now(client, Bye(code=code, reason=reason))
                await client.stream.send_eof()
                discarded = 0
                while discarded < _DISCARD_LIMIT:
                    discarded += len(await client.stream.receive(_RECEIVE_SIZE))
            except (*_GONE, TimeoutError):
                pass
