"""``loopbus.connect``: read a run's metric stream from another process.

::

    async with loopbus.connect("tcp://127.0.0.1:8765", names=["train/*"]) as stream:
        async for record in stream:
            print(record.name, record.step, record.value)

Iteration yields :class:`~loopbus.PutRecord`s (and, when asked for, lifecycle events
and :class:`Gap` notices) in the order the run produced them, and ends when the server
closes with a normal bye (a trainer's server at the end of the job, or of the stage with
``StreamServer(scope="stage")``). Everything else (the server went away, refused the client, or
broke the protocol) raises :class:`~loopbus.StreamError`. Reconnecting is the caller's
choice: catch the error and connect again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import anyio
import msgspec
from anyio.abc import SocketStream

from .._exceptions import MisconfigurationError, StreamError
from .._validate import check_number
from ..events._types import PutRecord
from ._address import Address, parse_address
from ._nesting import ServerFrames, plain
from ._wire import (
    MAX_SERVER_FRAME,
    PROTOCOL_VERSION,
    TOPICS,
    Batch,
    Bye,
    EpochEnded,
    FrameReader,
    Gap,
    Hello,
    Record,
    StageEnded,
    StageStarted,
    Subscribe,
    Subscribed,
    Welcome,
    append_frame,
)

__all__ = ["Stream", "connect"]

StreamItem = PutRecord | EpochEnded | StageStarted | StageEnded | Gap

_CLIENT_NAME = "loopbus-python"
#: Records reach a client because they were routed to "external"; which other
#: destinations they had in the run is not sent.
_DESTINATIONS = ("external",)
_RECEIVE_SIZE = 256 * 1024
_GONE = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


def _patterns(value: Iterable[str] | str | None, what: str, default: list[str]) -> list[str]:
    if value is None:
        return list(default)
    items = [value] if isinstance(value, str) else list(value)
    for item in items:
        if not isinstance(item, str) or not item or len(item) > 256:
            raise MisconfigurationError(
                f"{what} must be a list of non-empty str of at most 256 characters, got "
                f"{value!r}."
            )
    if len(items) > 64:
        raise MisconfigurationError(f"{what} takes at most 64 entries, got {len(items)}.")
    return items


def connect(
    address: str | Address,
    *,
    names: Iterable[str] | str | None = None,
    topics: Iterable[str] | str | None = None,
    token: str | None = None,
    yield_gaps: bool = False,
    timeout: float = 10.0,
    max_frame: int = MAX_SERVER_FRAME,
) -> Stream:
    """Connect to a run's stream server; use the result with ``async with``.

    * ``address``: ``"tcp://HOST:PORT"`` or ``"unix:///path"`` (what the server printed
      and published as ``ServerStarted.address``).
    * ``names``: globs on record names (``["train/*", "val/loss"]``); default all.
    * ``topics``: ``["records"]`` (default), ``["events"]``, or both; events are
      :class:`~loopbus.stream.StageStarted`, :class:`~loopbus.stream.EpochEnded` and
      :class:`~loopbus.stream.StageEnded`.
    * ``token``: the server's token, when it has one.
    * ``yield_gaps``: also yield a :class:`~loopbus.stream.Gap` where records were
      dropped because this client read too slowly; either way :attr:`Stream.gaps`
      counts the dropped records.
    * ``timeout``: seconds to connect and complete the handshake.
    * ``max_frame``: the largest frame (bytes) accepted from the server. What a server
      sends is untrusted input: a larger frame, or one whose arrays and maps nest more
      than 32 levels deep, ends the stream with :class:`~loopbus.StreamError` before it is
      decoded (``docs/security.md``).

    Records put after the ``async with`` is entered are delivered (the server has
    acknowledged the subscription by then).
    """
    return Stream(
        address,
        names=names,
        topics=topics,
        token=token,
        yield_gaps=yield_gaps,
        timeout=timeout,
        max_frame=max_frame,
    )


class Stream:
    """A connection to a stream server; an async iterator of what it sends.

    Every item of a client's stream (record or event) has a sequence number, counted
    from 0 for this connection; a :class:`Gap` stands for ``count`` of them that were
    dropped because this client read too slowly.

    Attributes: :attr:`address`; :attr:`welcome` (the server's :class:`Welcome`: protocol
    version, stage, step, limits); :attr:`seq` (the sequence number of the item last
    yielded; of the first missing one for a gap); :attr:`gaps` (items dropped for this
    client so far); :attr:`received` (records and events yielded); :attr:`buffered`
    (items ready without waiting); :attr:`bye` (the server's closing :class:`Bye`, once
    the stream ended).
    """

    def __init__(
        self,
        address: str | Address,
        *,
        names: Iterable[str] | str | None = None,
        topics: Iterable[str] | str | None = None,
        token: str | None = None,
        yield_gaps: bool = False,
        timeout: float = 10.0,
        max_frame: int = MAX_SERVER_FRAME,
    ) -> None:
        self.address = parse_address(address)
        self.names = _patterns(names, "names", ["*"])
        self.topics = _patterns(topics, "topics", ["records"])
        unknown = sorted(set(self.topics) - set(TOPICS))
        if unknown:
            raise MisconfigurationError(
                f"unknown topic(s) {unknown}; the topics are {list(TOPICS)}."
            )
        if token is not None and (not isinstance(token, str) or not token):
            raise MisconfigurationError(f"token must be a non-empty str or None, got {token!r}.")
        self.token = token
        self.yield_gaps = bool(yield_gaps)
        self.timeout = check_number(
            "timeout", timeout, exclusive_minimum=0, what="a number of seconds"
        )
        self.welcome: Welcome | None = None
        self.subscribed: Subscribed | None = None
        self.bye: Bye | None = None
        self.seq = -1
        self.next_seq = 0
        self.gaps = 0
        self.received = 0
        self._socket: SocketStream | None = None
        self._reader = FrameReader(max_frame)
        self._decode = ServerFrames().decode
        self._encoder = msgspec.msgpack.Encoder()
        self._items: deque[Any] = deque()
        self._head = 0
        self._error: StreamError | None = None
        self._ended = False

    def __repr__(self) -> str:
        state = "ended" if self._ended else ("open" if self._socket is not None else "closed")
        return f"<Stream {self.address} {state} seq={self.seq} gaps={self.gaps}>"

    @property
    def buffered(self) -> int:
        """Items received and not yet yielded (iterating over them does not wait)."""
        return len(self._items)

    # ------------------------------------------------------------ connection
    async def __aenter__(self) -> Stream:
        if self._socket is not None or self._ended:
            raise RuntimeError("a Stream is entered once; call loopbus.connect() again.")
        try:
            with anyio.fail_after(self.timeout):
                try:
                    self._socket = await self.address.connect()
                except OSError as exc:
                    raise StreamError(
                        f"could not connect to {self.address}: {exc.strerror or exc}. Is the "
                        "run serving its stream there (StreamServer) and still running?"
                    ) from exc
                await self._send(
                    Hello(version=PROTOCOL_VERSION, token=self.token, client=_CLIENT_NAME)
                )
                welcome = await self._expect("welcome")
                if welcome.version != PROTOCOL_VERSION:
                    raise StreamError(
                        f"{self.address} speaks protocol version {welcome.version}, this client "
                        f"version {PROTOCOL_VERSION}."
                    )
                await self._send(Subscribe(names=self.names, topics=self.topics))
                await self._expect("subscribed")
        except TimeoutError:
            await self.aclose()
            raise StreamError(
                f"{self.address} did not complete the handshake within {self.timeout} s."
            ) from None
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Say bye (if the stream is still open) and close the connection."""
        socket, self._socket = self._socket, None
        if socket is None:
            return
        if not self._ended and self._error is None:
            with anyio.move_on_after(1.0, shield=True):
                try:
                    await self._send_on(socket, Bye(code="end", reason="client closed"))
                except _GONE:
                    pass
        await anyio.aclose_forcefully(socket)

    async def subscribe(
        self,
        names: Iterable[str] | str | None = None,
        topics: Iterable[str] | str | None = None,
    ) -> None:
        """Replace the filters. Items after the server's :class:`Subscribed` follow them;
        it arrives in the stream (read :attr:`subscribed`)."""
        self.names = _patterns(names, "names", ["*"])
        self.topics = _patterns(topics, "topics", ["records"])
        await self._send(Subscribe(names=self.names, topics=self.topics))

    async def _send(self, message: Any) -> None:
        if self._socket is None:
            raise StreamError(f"the stream from {self.address} is closed.")
        await self._send_on(self._socket, message)

    async def _send_on(self, socket: SocketStream, message: Any) -> None:
        buffer = bytearray()
        append_frame(self._encoder, message, buffer)
        await socket.send(bytes(buffer))

    async def _expect(self, attribute: str) -> Any:
        """Receive until the handshake message stored in ``attribute`` arrived."""
        while getattr(self, attribute) is None:
            if self._error is not None:
                raise self._error
            if self._ended:
                raise StreamError(f"{self.address} ended the stream during the handshake.")
            await self._fill()
        return getattr(self, attribute)

    # ------------------------------------------------------------ iteration
    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> StreamItem:
        items = self._items
        while True:
            while not items:
                if self._error is not None:
                    raise self._error
                if self._ended:
                    raise StopAsyncIteration
                if self._socket is None:
                    raise StreamError(
                        f"the stream from {self.address} is not open; use `async with`."
                    )
                await self._fill()
            item = items.popleft()
            if type(item) is Gap:
                self._head += item.count
                if not self.yield_gaps:
                    continue
                self.seq = item.seq
                return item
            self.seq = self._head
            self._head += 1
            self.received += 1
            return item  # type: ignore[no-any-return]

    async def _fill(self) -> None:
        """Receive at least one chunk and queue what it completes."""
        socket = self._socket
        assert socket is not None
        try:
            data = await socket.receive(_RECEIVE_SIZE)
        except _GONE as exc:
            self._fail(
                f"the connection to {self.address} closed without a bye after "
                f"{self.next_seq} items: the run went away (it failed or was killed).",
                exc,
            )
            return
        try:
            frames = self._reader.feed(data)
        except StreamError as exc:
            self._fail(f"{self.address}: {exc}", exc)
            return
        decode = self._decode
        for frame in frames:
            try:
                message = decode(frame)
            except Exception as exc:  # untrusted input: any decoding failure
                self._fail(f"{self.address} sent an invalid frame: {exc}", exc)
                return
            if not self._take(message):
                return

    def _take(self, message: Any) -> bool:
        """Handle one message from the server; False when the stream stops here (it
        ended, or the message was wrong)."""
        if isinstance(message, Batch):
            return self._take_batch(message)
        kind = type(message)
        if kind is Gap:
            if message.seq != self.next_seq or message.count < 1:
                self._fail(
                    f"{self.address} sent a gap at {message.seq} (count {message.count}), "
                    f"expected one at {self.next_seq}: the stream is corrupt.",
                    None,
                )
                return False
            self.next_seq += message.count
            self.gaps += message.count
            self._items.append(message)
        elif kind is Subscribed:
            self.subscribed = message
        elif kind is Bye:
            self.bye = message
            if message.code != "end":
                self._fail(
                    f"{self.address} closed the stream ({message.code}): {message.reason}", None
                )
                return False
            self._ended = True
            return False
        elif kind is Welcome and self.welcome is None:
            self.welcome = message
        else:
            self._fail(f"{self.address} sent an unexpected {kind.__name__}.", None)
            return False
        return True

    def _take_batch(self, message: Batch) -> bool:
        """Queue a batch's records and events, which must start at the next sequence
        number."""
        if message.seq != self.next_seq:
            self._fail(
                f"{self.address} sent items from sequence number {message.seq}, "
                f"expected {self.next_seq}: the stream is corrupt.",
                None,
            )
            return False
        items = message.items
        self._items.extend(
            [
                PutRecord(
                    name=x.name,
                    value=x.value,
                    step=x.step,
                    epoch=x.epoch,
                    time=x.time,
                    source=x.source,
                    destinations=_DESTINATIONS,
                )
                if isinstance(x, Record)
                else plain(x)
                for x in items
            ]
        )
        self.next_seq += len(items)
        return True

    def _fail(self, message: str, cause: BaseException | None) -> None:
        error = StreamError(message)
        error.__cause__ = cause
        self._error = error

