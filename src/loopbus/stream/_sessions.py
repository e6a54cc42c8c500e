"""The stream server's connections, each from its handshake to its bye: check the
client's ``Hello`` (version, token, a free slot) and welcome it, then read its messages
(subscriptions, within the limits of ``_limits``: a client that passes one is closed, and
the server's work on subscriptions over all clients is paced) while a writer sends what
the fan-out queues for it, and end it with a reason (``Bye``).

Nothing a client sends reaches the publisher: bad frames end that client's connection
with a reason, and an unexpected error in a connection's task is logged and ends only
that connection."""

from __future__ import annotations

import contextlib
import hmac
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from anyio.abc import SocketAttribute

from .._exceptions import StreamError
from .._version import __version__
from ._connection import Connection, Rejected, decode_client_message
from ._limits import (
    ABORT_PAUSE,
    ACCEPT_BURST,
    BYE_TIMEOUT,
    DISCARD_LIMIT,
    READ_AHEAD,
    RECEIVE_SIZE,
    SUBSCRIBE_WORK,
    WORK_BURST,
    WORK_RATE,
    Allowance,
)
from ._listeners import close_now
from ._wire import TOPICS, Bye, ClientMessage, Hello, Subscribe, Welcome, append_frame

if TYPE_CHECKING:
    from anyio.abc import SocketStream

    from ._fanout import Fanout
    from ._limits import Limits

__all__ = ["Sessions"]

logger = logging.getLogger("loopbus.stream")

_GONE = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)
#: The version whose connections end with their stage (docs/protocol.md, "Versions").
_STAGE_VERSION = 1


def _spoken(versions: tuple[int, ...]) -> str:
    """``"1 and 2"``: the versions a server speaks, in words."""
    words = [str(v) for v in versions]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} and {words[-1]}"


def _folder(value: object) -> str | None:
    """A run folder as ``Welcome.run_dir`` tells it: a path as a string; anything else
    (a value that is no path) is not told, with a warning in the log."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)  # type: ignore[no-any-return]
    logger.warning("Server.run_dir must be a folder path or None, got %r: not told", value)
    return None


class Sessions:
    """Serves each connection a server accepts (:meth:`handle`), and counts them.

    * ``fanout``: where a welcomed client is counted in, subscribes, and is forgotten;
    * ``limits``: the server's limits;
    * ``token``: the encoded token clients must present, or None;
    * ``versions``: the protocol versions spoken;
    * ``accepting``: whether the server takes new clients (False once it is closing).
    """

    def __init__(
        self,
        fanout: Fanout,
        limits: Limits,
        *,
        token: bytes | None,
        versions: tuple[int, ...],
        accepting: Callable[[], bool],
    ) -> None:
        self.fanout = fanout
        self.limits = limits
        self.versions = versions
        self._token = token
        self._accepting = accepting
        #: The run folder to tell a client in ``Welcome.run_dir`` now (the server's
        #: ``run_dir``; None: not told), asked at each handshake.
        self.run_dir: Callable[[], object] = lambda: None
        #: Handshakes accepted; connections turned away or closed for a protocol
        #: violation; unexpected errors in connection tasks (logged, they end only that
        #: connection).
        self.accepted = 0
        self.rejected = 0
        self.errors = 0
        #: Connections closed at once for passing a bound (counted in ``rejected`` too);
        #: times a connection waited for its turn to be accepted (``accept_rate``).
        self.aborted = 0
        self.paced = 0
        self._encoder = msgspec.msgpack.Encoder()
        self._decode = msgspec.msgpack.Decoder(ClientMessage).decode
        # The work on subscriptions the server may still do, over all its clients; the
        # connections it may still accept.
        self._work = Allowance(WORK_RATE, WORK_BURST)
        self._accepts = Allowance(limits.accept_rate, ACCEPT_BURST)

    async def turn(self) -> None:
        """Wait until the server may accept one more connection (``accept_rate`` a
        second after a burst of ``ACCEPT_BURST``, over all listeners, in turn)."""
        wait = self._accepts.reserve(1, anyio.current_time())
        if wait:
            self.paced += 1
            await anyio.sleep(wait)

    async def handle(self, stream: SocketStream) -> None:
        """Serve one connection until it ends, then close it."""
        try:
            peer = str(stream.extra(SocketAttribute.remote_address, "?"))
        except Exception:
            peer = "?"
        limits = self.limits
        send_buffer = limits.send_buffer
        if send_buffer is not None:
            raw = stream.extra(SocketAttribute.raw_socket, None)
            if raw is not None:
                with contextlib.suppress(OSError):
                    raw.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        client = Connection(
            stream,
            limits.client_buffer,
            limits.max_frame,
            peer or "unix",
            subscribe_rate=limits.subscribe_rate,
        )
        try:
            try:
                await self._serve(client)
            except Rejected as rejected:
                self.rejected += 1
                logger.info("stream server: closing %s: %s", client.peer, rejected.reason)
                await self._turn_away(client, rejected.code, rejected.reason)
        except _GONE:
            pass
        except Exception:
            self.errors += 1
            logger.exception("stream server: unexpected error serving %s", client.peer)
        finally:
            self.fanout.forget(client)
            await close_now(stream)

    # ------------------------------------------------------------ the handshake
    async def _serve(self, client: Connection) -> None:
        hello = await self._hello(client)
        if hello is None:
            return
        self._admission(hello)
        # Take the slot before the first await: counting the client only once its welcome
        # is sent would let every handshake waiting in that send pass the check above.
        self.fanout.admit(client, stage_bound=hello.version == _STAGE_VERSION)
        await self._send_now(client, self._welcome(hello.version))
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

    async def _hello(self, client: Connection) -> Hello | None:
        """The client's first message, which must be a ``Hello`` sent in time; None if
        the client left first."""
        timeout = self.limits.handshake_timeout
        hello: Any = None
        with anyio.move_on_after(timeout):
            hello = await self._receive(client)
            if hello is None:
                return None
        if hello is None:
            raise Rejected("timeout", f"no Hello within {timeout:g} s.")
        if not isinstance(hello, Hello):
            raise Rejected(
                "unexpected", f"the first message must be Hello, got {type(hello).__name__}."
            )
        return hello

    def _admission(self, hello: Hello) -> None:
        """Raise :class:`Rejected` unless the server takes the client that said ``hello``:
        a version it speaks, the token if it has one, a free slot, not closing."""
        if hello.version not in self.versions:
            raise Rejected(
                "version",
                f"this server speaks protocol versions {_spoken(self.versions)}; the client "
                f"asked for version {hello.version}.",
            )
        if self._token is not None:
            if hello.token is None:
                raise Rejected("auth", "this server requires a token; none was given.")
            if not hmac.compare_digest(hello.token.encode(), self._token):
                raise Rejected("auth", "wrong token.")
        max_clients = self.limits.max_clients
        if len(self.fanout.clients) >= max_clients:
            raise Rejected("busy", f"the server already has {max_clients} clients.")
        if not self._accepting():
            raise Rejected("busy", "the server is closing.")

    def _welcome(self, version: int) -> Welcome:
        fanout = self.fanout
        return Welcome(
            version=version,
            server=f"loopbus {__version__}",
            stage=fanout.stage,
            step=fanout.step,
            epoch=fanout.epoch,
            time=time.time(),
            max_frame=self.limits.max_frame,
            buffer=self.limits.client_buffer,
            topics=list(TOPICS),
            versions=list(self.versions),
            run_dir=_folder(self.run_dir()),
        )

    # ------------------------------------------------------------ reading
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
                data = await client.stream.receive(RECEIVE_SIZE)
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
                if not isinstance(message, Subscribe):
                    raise Rejected("unexpected", f"unexpected {type(message).__name__} message.")
                unknown = sorted(set(message.topics) - set(TOPICS))
                if unknown:
                    raise Rejected(
                        "malformed", f"unknown topic(s) {unknown}; topics are {list(TOPICS)}."
                    )
                await self._subscribe(client, message)
        except Rejected as rejected:
            self.rejected += 1
            logger.info("stream server: closing %s: %s", client.peer, rejected.reason)
            client.close(rejected.code, rejected.reason, flush=False)
            # The writer may be stuck sending to a client that does not read: the
            # connection ends BYE_TIMEOUT from now, with its bye sent or not.
            if client.scope is not None:
                client.scope.deadline = anyio.current_time() + BYE_TIMEOUT
            if rejected.abort:
                self._abort(client)
                return
        discarded = 0
        while discarded < DISCARD_LIMIT:
            try:
                discarded += len(await client.stream.receive(RECEIVE_SIZE))
            except _GONE:
                return

    def _abort(self, client: Connection) -> None:
        """``client`` passed a bound: read nothing more of it (the writer sends its bye
        if the socket takes it; closing with its input unread resets the connection),
        and pause accepting for ``ABORT_PAUSE`` seconds (a listener already waiting for
        a connection still takes that one), so that no client can make the server read
        and close connections as fast as it opens them."""
        self.aborted += 1
        client.reader.clear()
        self._accepts.pause(ABORT_PAUSE, anyio.current_time())

    async def _subscribe(self, client: Connection, message: Subscribe) -> None:
        """Apply a Subscribe if the client may send it (else raise :class:`Rejected`),
        once the server's work on subscriptions allows it: a Subscribe beyond that waits
        its turn (and every Subscribe lets other tasks run before it is applied)."""
        now = anyio.current_time()
        cost = client.allow(message, now)
        await self._take_input(client)
        work = SUBSCRIBE_WORK + cost
        await anyio.sleep(self._work.reserve(work, now))
        self.fanout.subscribe(client, message)

    async def _take_input(self, client: Connection) -> None:
        """Take what the client sent ahead into its frame reader until nothing more has
        arrived, or raise :class:`Rejected` past ``READ_AHEAD`` bytes. Some event loops
        read a new connection without bound until a read finds nothing waiting; after
        that, its socket is read only while the server waits for more."""
        reader = client.reader
        while True:
            data = b""
            with anyio.move_on_after(0.005):
                try:
                    data = await client.stream.receive(RECEIVE_SIZE)
                except _GONE:
                    return
            if not data:
                return
            reader.push(data)
            if reader.pending > READ_AHEAD:
                raise Rejected(
                    "too_large",
                    f"more than {READ_AHEAD:,} bytes sent ahead of what the server handled.",
                    abort=True,
                )

    # ------------------------------------------------------------ writing
    async def _write(self, client: Connection) -> None:
        buffer = bytearray()
        stream = client.stream
        fanout = self.fanout
        try:
            while True:
                if not client.queue and not client.acks and client.bye is None:
                    client.waiting = True
                    await client.wake.wait()
                    client.wake = anyio.Event()
                if client.bye is not None and not client.flush:
                    break
                fanout.drops += client.fill(buffer, self._encoder)
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
        await self._say_bye(client, *client.bye)

    async def _say_bye(self, client: Connection, code: str, reason: str) -> None:
        """Send the bye, half-close, and let the client read it and close its side before
        closing ours (closing with input unread would reset the connection and could
        destroy the bye before the client reads it)."""
        with anyio.move_on_after(BYE_TIMEOUT):
            try:
                await self._send_now(client, Bye(code=code, reason=reason))
                await client.stream.send_eof()
                await client.input_closed.wait()
            except (*_GONE, TimeoutError):
                pass
        if client.scope is not None:
            client.scope.cancel()

    async def _turn_away(self, client: Connection, code: str, reason: str) -> None:
        """Turn a client away during the handshake: send the bye, half-close, and discard
        what it still sends until it closes (see :meth:`_say_bye`)."""
        with anyio.move_on_after(BYE_TIMEOUT):
            try:
                await self._send_now(client, Bye(code=code, reason=reason))
                await client.stream.send_eof()
                discarded = 0
                while discarded < DISCARD_LIMIT:
                    discarded += len(await client.stream.receive(RECEIVE_SIZE))
            except (*_GONE, TimeoutError):
                pass

    async def _send_now(self, client: Connection, message: Any) -> None:
        buffer = bytearray()
        append_frame(self._encoder, message, buffer)
        with anyio.fail_after(max(self.limits.handshake_timeout, 1.0)):
            await client.stream.send(bytes(buffer))
