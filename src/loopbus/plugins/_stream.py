"""``StreamServer``: serve a run's put records and lifecycle events to other processes.

A dashboard, a notebook or ``loopbus watch`` connects over TCP or a Unix socket, says
which record names it wants, and receives them in the order they were put, each with a
per-client sequence number. The protocol is specified in ``docs/protocol.md``.

How it stays off the step's critical path: the record handler encodes each record once
and appends it to the bounded queue (a ``deque``) of every client that wants it, which
is all the step ever pays; a writer task per client drains its queue in batches (many
records per frame, many frames per ``send``). A client that reads too slowly loses its
oldest queued records, never slows the run, and is told exactly how many it lost (a
``Gap``). Nothing a client sends reaches the run: bad frames end that client's
connection with a reason (``Bye``), and an unexpected error in a connection's task is
logged and ends only that connection.

The handlers subscribe *inline*: the handler never awaits and costs about a
microsecond per record, cheaper than a hop through a bus queue, and one handler sees
records and lifecycle events in the single order the run produced them (separate bus
queues per event type would let an ``EpochEnded`` overtake that epoch's last records).
The per-client queues are the queued part.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import stat
import sys
import time
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from anyio.abc import SocketAttribute

import loopbus
from loopbus import MisconfigurationError, PutRecord, StreamError, check_int, check_number
from loopbus.events import EpochCompleted, Teardown
from loopbus.stream import (
    MAX_CLIENT_FRAME,
    PROTOCOL_VERSION,
    TOPICS,
    Address,
    Bye,
    ClientMessage,
    EpochEnded,
    Hello,
    StageEnded,
    Subscribe,
    Subscribed,
    Welcome,
    append_frame,
    is_loopback,
    parse_address,
    record_fields,
)

from ._stream_state import NEVER, Connection, Rejected, decode_client_message, matcher

if TYPE_CHECKING:
    from anyio.abc import Listener, SocketStream, TaskGroup

__all__ = ["ServerStarted", "StreamServer"]

logger = logging.getLogger("loopbus.stream")

_OWNER = "StreamServer"
_FREE_PORT = "0 picks a free port"
_GONE = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)
_RECEIVE_SIZE = 65536
_CACHE_LIMIT = 4096
_BYE_TIMEOUT = 1.0
_DISCARD_LIMIT = 1 << 20


class ServerStarted(loopbus.Event, frozen=True, kw_only=True):
    """Published by :class:`StreamServer` once it listens, before the stage's first loop
    event. ``address`` is where to connect (the first of ``addresses``)."""

    address: str
    addresses: tuple[str, ...]
    stage: str


async def _close(resource: Any) -> None:
    """Close ``resource`` now, even in a cancelled scope (shielded, then forcefully)."""
    with anyio.CancelScope(shield=True):
        await anyio.aclose_forcefully(resource)


def _format_address(kind: str, sockname: Any) -> str:
    if kind == "unix":
        return str(Address("unix", path=str(sockname)))
    host, port = sockname[0], sockname[1]
    return str(Address("tcp", host=host, port=port))


class StreamServer(loopbus.Plugin):
    """Serve the run's put records (destination ``"external"``) and lifecycle events to
    clients in other processes, for the duration of each stage.

    * ``host``, ``port``: the TCP address (``port=0`` picks a free port; read it from
      :attr:`address`, the :class:`ServerStarted` event or the printed line). Loopback
      by default; any other host needs a ``token``. ``host=None`` serves no TCP.
    * ``path``: also (or, with ``host=None``, only) serve on this Unix socket (created
      with mode 0600; a stale socket file is replaced, a live one is an error).
    * ``token``: a shared secret clients must present (compared in constant time).
      Required to bind beyond loopback. It authenticates, it does not encrypt: across
      untrusted networks, tunnel the port (``ssh -L``) instead.
    * ``client_buffer``: records queued per client (sent to clients as
      ``Welcome.buffer``); when a client falls this far behind, its oldest records are
      dropped and it receives a gap notice. Under the inline executor the queue must
      also hold what the run puts between two yields to the event loop.
    * ``send_buffer``: bytes the operating system may buffer per client (``SO_SNDBUF``);
      None keeps its default, which grows to megabytes for a client that stops reading.
      Smaller means a stalled client holds less stale data and learns of its gap sooner.
    * ``max_clients``: clients served at once; a ``Hello`` beyond this is turned away
      (``busy``), however many arrive together.
    * ``max_frame``: the largest frame (bytes) a client may send.
    * ``flush_interval``: after a send, a client's writer pauses until the next tick of
      this period (s) so that records put meanwhile go out together: at most one send
      per tick, 10 per second by default. A record put after a quiet spell goes out at
      once, and a queue half full ends the pause early. 0 sends whenever there is
      something to send.
    * ``linger``: at the end of a stage, seconds to let clients receive what is queued
      and the closing bye before they are disconnected.
    * ``handshake_timeout``: seconds a new connection has to send its ``Hello``.
    * ``announce``: print the address to stderr when listening.

    Use :meth:`from_address` to build one from ``"tcp://HOST:PORT"`` or
    ``"unix:///path"``. Counters for monitoring: :attr:`connected`, :attr:`subscribers`,
    :attr:`accepted`, :attr:`rejected`, :attr:`dropped`, :attr:`errors`.
    """

    destination = "external"
    #: Acts on rank 0 only in a distributed run.
    ranks = "zero"
    mode = "inline"

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
        announce: bool = True,
    ) -> None:
        if host is None and path is None:
            raise MisconfigurationError(
                "StreamServer needs somewhere to listen: a TCP host (host='127.0.0.1') "
                "and/or a Unix socket path (path='/tmp/run.sock')."
            )
        if host is not None and (not isinstance(host, str) or not host.strip()):
            raise MisconfigurationError(
                f"StreamServer(host=...) must be a host name or IP address such as "
                f"'127.0.0.1', got {host!r}; use host=None to serve only a Unix socket."
            )
        check_int("port", port, minimum=0, maximum=65535, owner=_OWNER, hint=_FREE_PORT)
        if token is not None and (not isinstance(token, str) or not token):
            raise MisconfigurationError(
                f"StreamServer(token=...) must be a non-empty str or None, got {token!r}."
            )
        if host is not None and not is_loopback(host) and token is None:
            raise MisconfigurationError(
                f"StreamServer(host={host!r}) would accept connections from other machines, "
                "which requires a token: pass token='<a long random secret>' (clients give "
                "it to loopbus.connect(..., token=...) or `loopbus watch --token`), or bind "
                "to a loopback address such as host='127.0.0.1'."
            )
        check_int("client_buffer", client_buffer, owner=_OWNER, hint="it counts records")
        check_int("max_clients", max_clients, owner=_OWNER)
        check_int("max_frame", max_frame, minimum=64, owner=_OWNER, hint="it counts bytes")
        check_int(
            "send_buffer",
            send_buffer,
            minimum=1024,
            allow_none=True,
            owner=_OWNER,
            hint="it counts bytes, and None keeps the system's default",
        )
        seconds = "a number of seconds"
        check_number("flush_interval", flush_interval, minimum=0, owner=_OWNER, what=seconds)
        check_number("linger", linger, minimum=0, owner=_OWNER, what=seconds)
        check_number("handshake_timeout", handshake_timeout, minimum=0, owner=_OWNER, what=seconds)
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
        self.announce = announce
        #: Where the server listens while a stage runs ("tcp://127.0.0.1:PORT" first).
        self.addresses: tuple[str, ...] = ()
        #: Clients connected now, and how many of them subscribed; in total: handshakes
        #: accepted, connections turned away or closed for a protocol violation, items
        #: dropped for slow clients, and unexpected errors in connection tasks (logged to
        #: the "loopbus.stream" logger; they end only that connection).
        self.connected = 0
        self.subscribers = 0
        self.accepted = 0
        self.rejected = 0
        self.errors = 0
        self._dropped = 0
        self._token = token.encode() if token is not None else b""
        self._encode = msgspec.msgpack.Encoder().encode
        self._encoder = msgspec.msgpack.Encoder()
        self._decode = msgspec.msgpack.Decoder(ClientMessage).decode
        self._clients: set[Connection] = set()
        self._record_clients: tuple[Connection, ...] = ()
        self._routes: dict[str, tuple[Connection, ...]] = {}
        self._event_clients: tuple[Connection, ...] = ()
        self._trainer: loopbus.Trainer | None = None
        self._stage: str | None = None
        self._scope: anyio.CancelScope | None = None
        self._accept_scope: anyio.CancelScope | None = None
        self._stopped: anyio.Event | None = None
        self._all_gone: anyio.Event | None = None
        self._conn_tg: TaskGroup | None = None

    @classmethod
    def from_address(cls, address: str | Address, **options: Any) -> StreamServer:
        """``StreamServer.from_address("tcp://127.0.0.1:8765")`` or
        ``("unix:///tmp/run.sock")``; ``options`` are the constructor's."""
        where = parse_address(address)
        if where.kind == "unix":
            return cls(host=None, path=where.path, **options)
        return cls(host=where.host, port=where.port, **options)

    @property
    def dropped(self) -> int:
        """Items dropped for slow clients so far, over all clients (each client's share
        is reported to it in gap notices)."""
        return self._dropped + sum(c.pending_drops() for c in self._clients)

    @property
    def address(self) -> str | None:
        """The first address served, while a stage runs (None otherwise)."""
        return self.addresses[0] if self.addresses else None

    def __repr__(self) -> str:
        where = self.address or (
            f"tcp://{self.host}:{self.port}" if self.host is not None else f"unix://{self.path}"
        )
        return f"<StreamServer {where} clients={self.connected}>"

    # ------------------------------------------------------------ lifecycle
    async def start(self, trainer: loopbus.Trainer, stage: str, task_group: TaskGroup) -> None:
        listeners: list[tuple[str, Listener[Any]]] = []
        try:
            if self.host is not None:
                try:
                    multi = await anyio.create_tcp_listener(
                        local_host=self.host, local_port=self.port
                    )
                except OSError as exc:
                    raise StreamError(
                        f"StreamServer could not listen on {Address('tcp', host=self.host, port=self.port)}: "
                        f"{exc.strerror or exc}. Choose another port (port=0 picks a free one)."
                    ) from exc
                listeners += [("tcp", listener) for listener in multi.listeners]
            if self.path is not None:
                await self._check_unix_path(self.path)
                try:
                    unix = await anyio.create_unix_listener(self.path, mode=0o600)
                except OSError as exc:
                    raise StreamError(
                        f"StreamServer could not listen on unix://{self.path}: "
                        f"{exc.strerror or exc}."
                    ) from exc
                listeners.append(("unix", unix))
        except BaseException:
            for _, listener in listeners:
                await _close(listener)
            raise
        addresses: list[str] = []
        for kind, listener in listeners:
            sockname = listener.extra(SocketAttribute.local_address)
            address = _format_address(kind, sockname)
            if address not in addresses:
                addresses.append(address)
        self.addresses = tuple(addresses)
        self._trainer = trainer
        self._stage = stage
        self._scope = anyio.CancelScope()
        self._accept_scope = anyio.CancelScope()
        self._stopped = anyio.Event()
        self._all_gone = anyio.Event()
        task_group.start_soon(
            self._serve, [listener for _, listener in listeners], name="loopbus stream server"
        )
        if self.announce:
            print(
                f"loopbus: streaming records on {self.addresses[0]} "
                f"(watch them with: loopbus watch {self.addresses[0]})",
                file=sys.stderr,
                flush=True,
            )
        await trainer.publish(
            ServerStarted(address=self.addresses[0], addresses=self.addresses, stage=stage)
        )

    async def stop(self, trainer: loopbus.Trainer, stage: str) -> None:
        if self._scope is None or self._stopped is None:
            return
        if self._accept_scope is not None:
            self._accept_scope.cancel()
        for client in list(self._clients):
            client.close("end", f"the {stage} stage ended", flush=True)
        if self._clients and self._all_gone is not None:
            with anyio.move_on_after(self.linger):
                await self._all_gone.wait()
        self._scope.cancel()
        await self._stopped.wait()

    def teardown(self, trainer: loopbus.Trainer, stage: str) -> None:
        self.addresses = ()
        self._trainer = None
        self._stage = None
        self._scope = self._accept_scope = None
        self._stopped = self._all_gone = None
        self._conn_tg = None
        self._clients.clear()
        self._record_clients = self._event_clients = ()
        self._routes.clear()
        self.connected = self.subscribers = 0

    async def _check_unix_path(self, path: str) -> None:
        try:
            mode = os.stat(path).st_mode
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(mode):
            raise StreamError(
                f"StreamServer cannot listen on unix://{path}: the path exists and is not a "
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
            f"StreamServer cannot listen on unix://{path}: another server is listening there. "
            "Choose another path."
        )

    # ------------------------------------------------------------ handlers (inline)
    @loopbus.on(PutRecord)
    def on_record(self, record: PutRecord) -> None:
        if not self._record_clients:
            return
        targets = self._routes.get(record.name)
        if targets is None:
            targets = self._route(record.name)
        if not targets:
            return
        raw = msgspec.Raw(self._encode(record_fields(record)))
        for client in targets:
            queue = client.queue
            queue.append(raw)
            client.next_seq += 1
            if len(queue) >= client.threshold:
                client.threshold = NEVER
                client.wake.set()

    def _route(self, name: str) -> tuple[Connection, ...]:
        """The subscribed clients whose name filters accept ``name`` (cached per name
        until the subscriptions change)."""
        routes = self._routes
        if len(routes) >= _CACHE_LIMIT:
            routes.clear()
        targets = routes[name] = tuple(c for c in self._record_clients if c.match(name))
        return targets

    @loopbus.on(EpochCompleted)
    def on_epoch_completed(self, event: EpochCompleted) -> None:
        if self._event_clients:
            self._offer_event(EpochEnded(epoch=event.epoch, step=event.step, time=time.time()))

    @loopbus.on(Teardown)
    def on_teardown(self, event: Teardown) -> None:
        if self._event_clients:
            self._offer_event(
                StageEnded(
                    stage=event.stage,
                    reason=event.reason,
                    step=event.step,
                    epoch=event.epoch,
                    time=time.time(),
                )
            )

    def _offer_event(self, event: EpochEnded | StageEnded) -> None:
        raw = msgspec.Raw(self._encode(event))
        for client in self._event_clients:
            client.queue.append(raw)
            client.next_seq += 1
            if len(client.queue) >= client.threshold:
                client.notify()

    # ------------------------------------------------------------ serving
    async def _serve(self, listeners: list[Listener[Any]]) -> None:
        assert self._scope is not None
        assert self._stopped is not None
        try:
            with self._scope:
                async with anyio.create_task_group() as tg:
                    self._conn_tg = tg
                    tg.start_soon(self._accept_all, listeners)
                    if self.flush_interval:
                        tg.start_soon(self._tick, name="loopbus stream ticker")
        finally:
            try:
                for listener in listeners:
                    await _close(listener)
                self._remove_unix_path()
            finally:
                self._stopped.set()

    async def _tick(self) -> None:
        """End the pause of every paused writer each ``flush_interval``: one timer for
        all clients, so a pause costs a client nothing but an event."""
        interval = self.flush_interval
        while True:
            await anyio.sleep(interval)
            for client in self._clients:
                if client.paused:
                    client.notify()

    async def _accept_all(self, listeners: list[Listener[Any]]) -> None:
        assert self._accept_scope is not None
        try:
            with self._accept_scope:
                async with anyio.create_task_group() as tg:
                    for listener in listeners:
                        tg.start_soon(self._accept_loop, listener)
        finally:
            for listener in listeners:
                await _close(listener)
            self._remove_unix_path()

    def _remove_unix_path(self) -> None:
        if self.path is not None:
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(os.stat(self.path).st_mode):
                    os.unlink(self.path)

    async def _accept_loop(self, listener: Listener[Any]) -> None:
        assert self._conn_tg is not None
        while True:
            try:
                stream = await listener.accept()  # type: ignore[attr-defined]
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                return
            except OSError as exc:  # out of file descriptors, aborted connection, ...
                logger.warning("stream server: accept failed: %s", exc)
                await anyio.sleep(0.1)
                continue
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
        if hello.version != PROTOCOL_VERSION:
            raise Rejected(
                "version",
                f"this server speaks protocol version {PROTOCOL_VERSION}; the client asked "
                f"for version {hello.version}.",
            )
        if self.token is not None:
            if hello.token is None:
                raise Rejected("auth", "this server requires a token; none was given.")
            if not hmac.compare_digest(hello.token.encode(), self._token):
                raise Rejected("auth", "wrong token.")
        if len(self._clients) >= self.max_clients:
            raise Rejected("busy", f"the server already has {self.max_clients} clients.")
        # Take the slot before the first await: counting the client only once its welcome
        # is sent would let every handshake waiting in that send pass the check above.
        self._clients.add(client)
        self.connected = len(self._clients)
        trainer = self._trainer
        welcome = Welcome(
            version=PROTOCOL_VERSION,
            server=f"loopbus {loopbus.__version__}",
            stage=self._stage,
            step=trainer.global_step if trainer is not None else 0,
            epoch=trainer.current_epoch if trainer is not None else 0,
            time=time.time(),
            max_frame=self.max_frame,
            buffer=self.client_buffer,
            topics=list(TOPICS),
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
        client.match = matcher(message.names)
        client.topics = frozenset(message.topics)
        self._routes_changed()
        client.acks.append(
            Subscribed(seq=client.next_seq, names=list(message.names), topics=list(message.topics))
        )
        client.notify()

    def _routes_changed(self) -> None:
        clients = sorted(self._clients, key=id)
        self._record_clients = tuple(c for c in clients if "records" in c.topics)
        self._routes.clear()
        self._event_clients = tuple(c for c in clients if "events" in c.topics)
        self.subscribers = sum(1 for c in clients if c.topics)

    def _forget(self, client: Connection) -> None:
        if client in self._clients:
            self._dropped += client.pending_drops()
            self._clients.discard(client)
            self.connected = len(self._clients)
            self._routes_changed()
            if not self._clients and self._all_gone is not None:
                self._all_gone.set()

    # ------------------------------------------------------------ writing
    async def _write(self, client: Connection) -> None:
        buffer = bytearray()
        stream = client.stream
        flush_interval = self.flush_interval > 0
        try:
            while True:
                if not client.queue and not client.acks and client.bye is None:
                    client.threshold = 1
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
                if flush_interval and client.bye is None:
                    # Let records gather until the next tick (see _tick), or until half
                    # the queue fills (a fast producer), a close or a subscription.
                    client.threshold = client.high
                    client.paused = True
                    await client.wake.wait()
                    client.paused = False
                    client.threshold = NEVER
                    client.wake = anyio.Event()
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
