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

This module holds the server's front (the options, publishing, the pump) and its
lifetime; the concerns it puts together live beside it: ``_listeners`` (where it
listens), ``_sessions`` (each connection, from handshake to bye), ``_fanout`` (which
client takes which item, and their queues) and ``_limits`` (the limits, checked once).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import anyio
import sniffio

from .._exceptions import MisconfigurationError
from ._address import Address, parse_address
from ._fanout import EVENT_TYPES, Fanout
from ._limits import Limits
from ._listeners import Listeners, check_endpoint
from ._sessions import Sessions
from ._wire import MAX_CLIENT_FRAME, PROTOCOL_VERSIONS, EpochEnded, StageEnded, StageStarted

if TYPE_CHECKING:
    from anyio.abc import TaskGroup, TaskStatus

    from ..events import PutRecord

__all__ = ["Server"]

logger = logging.getLogger("loopbus.stream")

#: A queue length never reached: the pump is not to be woken.
_NEVER = sys.maxsize

_T = TypeVar("_T")


class _Option(Generic[_T]):
    """An option of a :class:`Server`, read-only: the value of that name in its
    :attr:`Server.limits` (checked once)."""

    __slots__ = ("_name",)

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, server: None, owner: type | None = None) -> _Option[_T]: ...
    @overload
    def __get__(self, server: Server, owner: type | None = None) -> _T: ...
    def __get__(self, server: Server | None, owner: type | None = None) -> _T | _Option[_T]:
        if server is None:
            return self
        value: _T = getattr(server.limits, self._name)
        return value


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


def _serve_in_thread(
    serve: Callable[..., Coroutine[Any, Any, None]], name: str
) -> threading.Thread:
    """Run ``serve`` (:meth:`Server.serve`) on an asyncio event loop of its own in a new
    daemon thread; return the thread once the server listens, or raise why it could not."""
    ready = threading.Event()
    failure: list[BaseException] = []

    async def main() -> None:
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(serve)
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

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    ready.wait()
    if failure:
        thread.join()
        raise failure[0]
    return thread


class Server:
    """Serve records and lifecycle events to clients in other processes.

    * ``host``, ``port``: the TCP address (``port=0`` picks a free port; read it from
      :attr:`address`). Loopback by default; any other host needs a ``token``.
      ``host=None`` serves no TCP.
    * ``path``: also (or, with ``host=None``, only) serve on this Unix socket (created
      with mode 0600; a stale socket file is replaced, a live one is an error).
    * ``token``: a shared secret clients must present (compared in constant time), needed
      beyond loopback. It authenticates, it does not encrypt: tunnel the port instead.
    * ``client_buffer``: items queued per client (sent to clients as
      ``Welcome.buffer``); when a client falls this far behind, its oldest items are
      dropped and it receives a gap notice.
    * ``send_buffer``: bytes the operating system may buffer per client (``SO_SNDBUF``);
      None keeps its default, which grows to megabytes for a client that stops reading.
    * ``max_clients``: clients served at once; a ``Hello`` beyond this is turned away
      (``busy``), however many arrive together.
    * ``max_frame``: the largest frame (bytes) a client may send.
    * ``flush_interval``: seconds between two hand-overs of items to the clients'
      writers, so that items published meanwhile go out together (an item after a quiet
      spell goes at once; half a ``client_buffer`` waiting ends the wait). 0: at once.
    * ``linger``: when the server closes, seconds to let clients receive what is queued
      and the closing bye before they are disconnected.
    * ``handshake_timeout``: seconds a new connection has to send its ``Hello``.
    * ``subscribe_rate``: ``Subscribe`` frames a client may send a second (after 20); more
      close it at once (``too_large``). ``docs/security.md`` lists the fixed bounds.
    * ``accept_rate``: connections accepted a second, over all addresses (after 64);
      beyond it they wait their turn, unread, in the listen queue.

    Serve with ``async with server:`` (or ``await server.serve()`` in a task group) on
    the current event loop, or :meth:`start_in_thread`; stop with :meth:`close` (any
    thread) or :meth:`aclose`. A server serves once. Counters for monitoring:
    :attr:`connected`, :attr:`subscribers`, :attr:`accepted`, :attr:`rejected`,
    :attr:`aborted`, :attr:`paced`, :attr:`dropped`, :attr:`errors`. It speaks every
    protocol version of :attr:`versions`; each connection the one its ``Hello`` names.
    """

    #: The protocol versions spoken (``Welcome.versions``; named when refusing others).
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
        subscribe_rate: float = 10.0,
        accept_rate: float = 10.0,
        owner: str = "Server",
    ) -> None:
        check_endpoint(owner, host, port, path, token)
        self._limits = limits = Limits.checked(
            client_buffer=client_buffer,
            send_buffer=send_buffer,
            max_clients=max_clients,
            max_frame=max_frame,
            flush_interval=flush_interval,
            linger=linger,
            handshake_timeout=handshake_timeout,
            subscribe_rate=subscribe_rate,
            accept_rate=accept_rate,
            owner=owner,
        )
        self.host = host.strip() if host is not None else None
        self.port = port
        self.path = os.fspath(path) if path is not None else None
        self.token = token
        self._owner = owner
        #: Where the server listens while it serves ("tcp://127.0.0.1:PORT" first).
        self.addresses: tuple[str, ...] = ()
        # Items waiting for the pump, the length that wakes it, whether records are wanted.
        self._pending: deque[Any] = deque()
        self._pump_at = _NEVER
        self._records_wanted = False
        self._fanout = Fanout(self._pending, self._want_records)
        secret = token.encode() if token is not None else None
        self.run_dir: str | os.PathLike[str] | None = None  # told in Welcome.run_dir
        self._sessions = Sessions(
            self._fanout, limits, token=secret, versions=self.versions, accepting=self._accepting
        )
        self._sessions.run_dir = lambda: self.run_dir
        self._serving = False
        self._state = "new"
        self._close_reason = "the server closed"
        # Set while serving: the loop's thread, how to call on it from another thread.
        self._loop_thread: int | None = None
        self._call_soon: Callable[[Callable[[], None]], None] | None = None
        self._pump_event: anyio.Event | None = None
        self._close_event: anyio.Event | None = None
        self._finished: anyio.Event | None = None
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

    # ------------------------------------------------------------ options (checked once)
    client_buffer: _Option[int] = _Option()
    send_buffer: _Option[int | None] = _Option()
    max_clients: _Option[int] = _Option()
    max_frame: _Option[int] = _Option()
    flush_interval: _Option[float] = _Option()
    linger: _Option[float] = _Option()
    handshake_timeout: _Option[float] = _Option()
    subscribe_rate: _Option[float] = _Option()
    accept_rate: _Option[float] = _Option()

    @property
    def limits(self) -> Limits:
        """The options above, each checked once (one frozen value)."""
        return self._limits

    # ------------------------------------------------------------ counters and position
    @property
    def connected(self) -> int:
        """Clients connected now."""
        return self._fanout.connected

    @property
    def subscribers(self) -> int:
        """Connected clients that subscribed."""
        return self._fanout.subscribers

    @property
    def accepted(self) -> int:
        """Handshakes accepted so far."""
        return self._sessions.accepted

    @property
    def rejected(self) -> int:
        """Connections turned away or closed for a protocol violation or a bound so far."""
        return self._sessions.rejected

    @property
    def aborted(self) -> int:
        """Connections closed at once for passing a bound (also in :attr:`rejected`)."""
        return self._sessions.aborted

    @property
    def paced(self) -> int:
        """Times the server waited before accepting a connection (``accept_rate``)."""
        return self._sessions.paced

    @property
    def errors(self) -> int:
        """Unexpected errors in connection tasks so far (logged; each ends its connection)."""
        return self._sessions.errors

    @property
    def dropped(self) -> int:
        """Items dropped for slow clients so far, over all clients (each client's share
        is reported to it in gap notices)."""
        return self._fanout.dropped

    @property
    def stage(self) -> str | None:
        """The stage of the last item published (told to new clients in ``Welcome``)."""
        return self._fanout.stage

    @property
    def step(self) -> int:
        """The step of the last item published."""
        return self._fanout.step

    @property
    def epoch(self) -> int:
        """The epoch of the last item published."""
        return self._fanout.epoch

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
        tcp = f"tcp://{self.host}:{self.port}"
        where = self.address or (tcp if self.host is not None else f"unix://{self.path}")
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
        if not isinstance(event, EVENT_TYPES):
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
            self._fanout.note(event)

    def _want_records(self, wanted: bool) -> None:
        """The fan-out says whether any client takes records now."""
        self._records_wanted = self._serving and wanted

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

    async def _pump(self) -> None:
        """Hand published items to the clients' queues: at once after a quiet spell, then
        at most once per ``flush_interval`` (or when half a client buffer waits)."""
        pending = self._pending
        interval = self._limits.flush_interval
        early = self._limits.early_flush
        distribute = self._fanout.distribute
        while True:
            self._pump_at = 1
            if not pending:
                await self._wait_for_items()
            distribute()
            if interval:
                self._pump_at = early
                with anyio.move_on_after(interval):
                    await self._wait_for_items()

    async def _wait_for_items(self) -> None:
        event = self._pump_event
        assert event is not None
        await event.wait()
        self._pump_event = anyio.Event()

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
        if self._state != "new":
            raise RuntimeError(f"{self!r} already served; a server serves once.")
        self._thread = _serve_in_thread(self.serve, name)

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
            listeners = await Listeners.open(self.host, self.port, self.path, self._owner)
        except BaseException:
            self._state = "closed"
            raise
        self.addresses = listeners.addresses
        finished = self._finished = anyio.Event()
        self._close_event = anyio.Event()
        self._pump_event = anyio.Event()
        self._loop_thread = threading.get_ident()
        self._call_soon = _threadsafe_caller()
        try:
            await self._serve_until_closed(listeners, task_status)
        finally:
            await self._stop(listeners, finished)

    async def _serve_until_closed(self, listeners: Listeners, started: TaskStatus[None]) -> None:
        """Accept clients and hand items over until :meth:`close`; then let every client
        receive what is queued and its bye (for at most ``linger`` seconds)."""
        close_event = self._close_event
        assert close_event is not None
        accepting = anyio.CancelScope()
        async with anyio.create_task_group() as tg:
            sessions = self._sessions
            tg.start_soon(listeners.accept, sessions.handle, tg, accepting, sessions.turn)
            tg.start_soon(self._pump, name="loopbus stream pump")
            self._serving = True
            self._state = "serving"
            started.started()
            await close_event.wait()
            accepting.cancel()
            await self._fanout.close_all(self._close_reason, self._limits.linger)
            tg.cancel_scope.cancel()

    async def _stop(self, listeners: Listeners, finished: anyio.Event) -> None:
        """Stop publishing and listening, forget the clients, and say the server stopped."""
        self._serving = False
        self._records_wanted = False
        self._state = "closed"
        self._call_soon = None
        self._pending.clear()
        try:
            await listeners.close()
        finally:
            self.addresses = ()
            self._fanout.clear()
            finished.set()

    def _accepting(self) -> bool:
        """Whether a client whose handshake is done may be welcomed."""
        return self._serving and self._state == "serving"
