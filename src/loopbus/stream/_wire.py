"""The metric stream's wire protocol: message types and framing (no I/O).

Every message is a tagged msgspec Struct (``{"type": "<Name>", ...}`` as a msgpack map)
sent in a frame: a 4-byte big-endian unsigned length, then that many bytes of msgpack.
``docs/protocol.md`` is the specification; this module is its reference implementation.
The stream server (``loopbus.stream.Server``, which ``loopbus.plugins.StreamServer``
feeds from a trainer) and the client (``loopbus.connect``) share it. Nothing here imports torch or the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Final

import msgspec

from .._exceptions import StreamError

__all__ = [
    "BYE_CODES",
    "HEADER_SIZE",
    "MAX_CLIENT_FRAME",
    "MAX_PATTERNS",
    "MAX_PATTERN_LENGTH",
    "MAX_SERVER_FRAME",
    "PROTOCOL_VERSION",
    "PROTOCOL_VERSIONS",
    "TOPICS",
    "Record",
    "Batch",
    "Bye",
    "ClientMessage",
    "EpochEnded",
    "FrameReader",
    "Gap",
    "Hello",
    "Item",
    "RawBatch",
    "ServerMessage",
    "StageEnded",
    "Subscribe",
    "StageStarted",
    "Subscribed",
    "Welcome",
    "append_frame",
    "record_fields",
]

#: The newest protocol version, the one the Python client says in its ``Hello``.
PROTOCOL_VERSION: Final = 2
#: Every protocol version a server speaks (``Welcome.versions``): a client's ``Hello``
#: names one, and the server keeps that version's promises for the whole connection
#: (``docs/protocol.md``, "Versions"). Version 1 ends every connection with its stage;
#: version 2 keeps a connection across stages and adds the ``StageStarted`` item.
PROTOCOL_VERSIONS: Final = (1, 2)
#: Bytes of the length prefix in front of every frame.
HEADER_SIZE: Final = 4
#: Default limit on the payload of a frame a client sends (servers may configure it).
MAX_CLIENT_FRAME: Final = 64 * 1024
#: Servers never send a frame with a larger payload; clients refuse larger ones.
MAX_SERVER_FRAME: Final = 16 * 1024 * 1024
#: The most name patterns a ``Subscribe`` carries, and the most characters in one.
MAX_PATTERNS: Final = 64
MAX_PATTERN_LENGTH: Final = 256
#: What a client can subscribe to: put records, and the lifecycle events below.
TOPICS: Final = ("records", "events")
#: ``Bye.code`` values. ``"end"`` is a normal end (the server closed, or the client is
#: leaving); the others name what the receiver did wrong or why it was turned away.
BYE_CODES: Final = (
    "end",
    "auth",
    "version",
    "too_large",
    "malformed",
    "unexpected",
    "timeout",
    "busy",
)

_Str = Annotated[str, msgspec.Meta(max_length=256)]
_Pattern = Annotated[str, msgspec.Meta(max_length=MAX_PATTERN_LENGTH)]
_Patterns = Annotated[list[_Pattern], msgspec.Meta(max_length=MAX_PATTERNS)]
_Topics = Annotated[list[Annotated[str, msgspec.Meta(max_length=32)]], msgspec.Meta(max_length=8)]


class _Message(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """Base of the wire messages: tag field ``"type"``, tag the class name."""


# ---------------------------------------------------------------- client -> server


class Hello(_Message, frozen=True, kw_only=True):
    """The first frame a client sends. ``token`` is required when the server has one.
    Any integer ``version`` decodes (a server answers one it does not speak with
    ``Bye(code="version")``, not as a malformed message)."""

    version: int
    token: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    client: _Str = ""


class Subscribe(_Message, frozen=True, kw_only=True):
    """Choose what to receive: records whose name matches one of the ``names`` globs
    (``*``, ``?``, ``[abc]``; case-sensitive), from the ``topics`` of :data:`TOPICS`.
    May be sent again to replace the filters."""

    names: _Patterns = msgspec.field(default_factory=lambda: ["*"])
    topics: _Topics = msgspec.field(default_factory=lambda: ["records"])


class Bye(_Message, frozen=True, kw_only=True):
    """The last frame of a connection, from either side. ``code`` is one of
    :data:`BYE_CODES`; ``reason`` says it in words."""

    code: Annotated[str, msgspec.Meta(max_length=32)] = "end"
    reason: Annotated[str, msgspec.Meta(max_length=1024)] = ""


# ---------------------------------------------------------------- server -> client


class Welcome(_Message, frozen=True, kw_only=True):
    """The server accepted the client's Hello. Describes the run and the server's limits.
    ``version`` is the version the client asked for (the one this connection speaks),
    ``versions`` every version the server speaks. ``run_dir`` is the run folder the job
    writes its logs into (``Server.run_dir``), when it has one: a dashboard reads the run's
    history there (an optional key added within version 2; clients that do not know it
    ignore it)."""

    version: int
    server: str
    stage: str | None = None
    step: int = 0
    epoch: int = 0
    time: float = 0.0
    max_frame: int = MAX_CLIENT_FRAME
    buffer: int = 0
    topics: list[str] = msgspec.field(default_factory=lambda: list(TOPICS))
    versions: list[int] = msgspec.field(default_factory=lambda: list(PROTOCOL_VERSIONS))
    run_dir: Annotated[str, msgspec.Meta(max_length=4096)] | None = None


class Subscribed(_Message, frozen=True, kw_only=True):
    """The server applied a Subscribe: items from sequence number ``seq`` on are
    selected by these filters."""

    seq: int
    names: list[str]
    topics: list[str]


class Record(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag="R"):
    """Topic ``"records"``: one put record, as the array
    ``["R", name, value, step, epoch, time, source]`` (compact: it is most of the
    traffic). The Python client turns it into a :class:`~loopbus.PutRecord`."""

    name: str
    value: float | int | bool
    step: int = 0
    epoch: int = 0
    time: float = 0.0
    source: str = ""


class EpochEnded(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag=True):
    """Topic ``"events"``: an epoch of ``fit`` ended (training pass and validation done);
    the array ``["EpochEnded", epoch, step, time]``."""

    epoch: int
    step: int
    time: float


class StageEnded(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag=True):
    """Topic ``"events"``: a stage (``"fit"``, ``"validate"``, ...) ended; ``reason`` is
    ``"completed"``, ``"stopped"``, ``"cancelled"`` or ``"failed"``; the array
    ``["StageEnded", stage, reason, step, epoch, time]``."""

    stage: str
    reason: str
    step: int
    epoch: int
    time: float


class StageStarted(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag=True):
    """Topic ``"events"``: a stage (``"fit"``, ``"validate"``, ``"test"``, ``"predict"``)
    started, before its first record; the array
    ``["StageStarted", stage, step, epoch, time]``."""

    stage: str
    step: int
    epoch: int
    time: float


#: What a batch carries: arrays whose first element names their type.
Item = Record | EpochEnded | StageStarted | StageEnded


class Batch(_Message, frozen=True, kw_only=True):
    """Consecutive items of the client's stream: ``items[i]`` has sequence number
    ``seq + i``."""

    seq: int
    items: list[Item]


class RawBatch(msgspec.Struct, frozen=True, kw_only=True, tag="Batch"):
    """:class:`Batch` with items already encoded (how servers send one item to many
    clients while encoding it once)."""

    seq: int
    items: list[msgspec.Raw]


class Gap(msgspec.Struct, frozen=True, kw_only=True, tag=True):
    """The ``count`` items from sequence number ``seq`` on were dropped for this client
    (it read too slowly and its queue overflowed)."""

    seq: int
    count: int


ClientMessage = Hello | Subscribe | Bye
ServerMessage = Welcome | Subscribed | Batch | Gap | Bye


def record_fields(record: Any) -> tuple[Any, ...]:
    """The wire form of a :class:`~loopbus.PutRecord` (encodes like a :class:`Record`)."""
    return ("R", record.name, record.value, record.step, record.epoch, record.time, record.source)


# ---------------------------------------------------------------- framing


def append_frame(encoder: msgspec.msgpack.Encoder, message: object, buffer: bytearray) -> int:
    """Encode ``message`` as one frame at the end of ``buffer``; return its payload size."""
    start = len(buffer)
    buffer += b"\0\0\0\0"
    encoder.encode_into(message, buffer, start + HEADER_SIZE)
    size = len(buffer) - start - HEADER_SIZE
    buffer[start : start + HEADER_SIZE] = size.to_bytes(HEADER_SIZE, "big")
    return size


class FrameReader:
    """Split a byte stream into frame payloads, refusing (:class:`StreamError`) a length
    prefix above ``limit`` before reading its payload.

    Either ``feed`` bytes and get every frame they complete (it raises at the first
    prefix above the limit), or ``push`` bytes and take the frames one at a time with
    ``next_frame``, which raises only when it reaches such a prefix: the frames before
    it can be judged first (how a server answers a client's frames in order)."""

    __slots__ = ("_buffer", "_pos", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._buffer = bytearray()
        self._pos = 0

    @property
    def pending(self) -> int:
        """Bytes received that were not yet returned as (part of) a frame."""
        return len(self._buffer) - self._pos

    def push(self, data: bytes) -> None:
        """Append received bytes (see :meth:`next_frame`)."""
        if self._pos:
            del self._buffer[: self._pos]
            self._pos = 0
        self._buffer += data

    def clear(self) -> None:
        """Forget every byte received and not yet returned."""
        self._buffer = bytearray()
        self._pos = 0

    def next_frame(self) -> bytes | None:
        """The next whole frame's payload, or None until more bytes are pushed."""
        buffer, pos = self._buffer, self._pos
        if len(buffer) - pos < HEADER_SIZE:
            return None
        size = int.from_bytes(buffer[pos : pos + HEADER_SIZE], "big")
        if size > self.limit:
            raise StreamError(
                f"a frame announces {size} bytes, more than the limit of {self.limit} bytes."
            )
        stop = pos + HEADER_SIZE + size
        if stop > len(buffer):
            return None
        self._pos = stop
        return bytes(buffer[pos + HEADER_SIZE : stop])

    def feed(self, data: bytes) -> list[bytes]:
        self.push(data)
        frames: list[bytes] = []
        while (frame := self.next_frame()) is not None:
            frames.append(frame)
        return frames
