"""What the stream server keeps for each client, apart from the I/O: the bounded queue and
its sequence numbers, batching into frames with exact gap notices, the name filter, and
decoding what clients send (untrusted input)."""

from __future__ import annotations

import fnmatch
import re
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from ._untrusted import check_nesting, msgpack_kind
from ._wire import (
    MAX_SERVER_FRAME,
    PROTOCOL_VERSIONS,
    FrameReader,
    Gap,
    Hello,
    RawBatch,
    Subscribed,
    append_frame,
)

if TYPE_CHECKING:
    from anyio.abc import SocketStream

__all__ = [
    "BATCH_ITEMS",
    "CLIENT_TYPES",
    "Connection",
    "Rejected",
    "decode_client_message",
    "match_nothing",
    "matcher",
]

#: Items per batch frame (about 45 bytes each for typical records).
BATCH_ITEMS = 1024
#: The message types a client may send.
CLIENT_TYPES = ("Hello", "Subscribe", "Bye")


class Rejected(Exception):
    """End a client's connection with ``Bye(code, reason)``."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


class Connection:
    """One connected client: its filters, its queue, its sequence numbers and what its
    writer task is asked to do."""

    __slots__ = (
        "acks",
        "bye",
        "dropped",
        "flush",
        "input_closed",
        "match",
        "next_seq",
        "peer",
        "queue",
        "reader",
        "scope",
        "sent_seq",
        "stream",
        "topics",
        "waiting",
        "wake",
    )

    def __init__(self, stream: SocketStream, buffer: int, max_frame: int, peer: str) -> None:
        self.stream = stream
        self.peer = peer
        #: What the client sent that was not yet handled (the server reads it one
        #: frame at a time).
        self.reader = FrameReader(max_frame)
        #: Encoded items waiting for the writer; the oldest fall off when it is full.
        self.queue: deque[msgspec.Raw] = deque(maxlen=buffer)
        #: Sequence number the next queued item gets / the writer sends next.
        self.next_seq = 0
        self.sent_seq = 0
        self.dropped = 0
        #: The writer waits on ``wake`` (``waiting`` is then true) until there is
        #: something to send; the server's pump sets it after queueing items.
        self.wake = anyio.Event()
        self.waiting = False
        self.match: Callable[[str], Any] = match_nothing
        self.topics: frozenset[str] = frozenset()
        self.acks: list[Subscribed] = []
        self.bye: tuple[str, str] | None = None
        self.flush = False
        self.scope: anyio.CancelScope | None = None
        #: Set when the client closed its side (or left): nothing more will be read.
        self.input_closed = anyio.Event()

    def pending_drops(self) -> int:
        """Items that fell off the queue and are not yet reported in a gap notice."""
        return self.next_seq - len(self.queue) - self.sent_seq

    def notify(self) -> None:
        """Wake the writer (if it waits)."""
        if self.waiting:
            self.waiting = False
            self.wake.set()

    def close(self, code: str, reason: str, *, flush: bool) -> None:
        """Ask the writer to send ``Bye(code, reason)`` (after the queue, if ``flush``)."""
        if self.bye is None:
            self.bye = (code, reason)
            self.flush = flush
        self.notify()

    def fill(self, buffer: bytearray, encoder: msgspec.msgpack.Encoder) -> int:
        """Encode what is pending into ``buffer``: a gap notice for what fell off the queue,
        acknowledgements, and the queued items in batches. Returns how many items this
        reported as dropped."""
        dropped = 0
        queue = self.queue
        items = list(queue)
        queue.clear()
        first = self.next_seq - len(items)
        if first > self.sent_seq:
            missing = first - self.sent_seq
            self.dropped += missing
            dropped += missing
            append_frame(encoder, Gap(seq=self.sent_seq, count=missing), buffer)
        pos = 0
        if self.acks:
            acks, self.acks = self.acks, []
            for ack in acks:
                upto = min(len(items), max(pos, ack.seq - first))
                dropped += _append_items(buffer, encoder, first + pos, items[pos:upto])
                pos = upto
                append_frame(encoder, ack, buffer)
        dropped += _append_items(buffer, encoder, first + pos, items[pos:])
        self.sent_seq = self.next_seq
        return dropped


def _append_items(
    buffer: bytearray, encoder: msgspec.msgpack.Encoder, seq: int, items: list[msgspec.Raw]
) -> int:
    """Append ``items`` as batch frames from sequence number ``seq``; an item too large
    for any frame becomes a one-item gap. Returns the number of such items."""
    dropped = 0
    for start in range(0, len(items), BATCH_ITEMS):
        chunk = items[start : start + BATCH_ITEMS]
        mark = len(buffer)
        if append_frame(encoder, RawBatch(seq=seq + start, items=chunk), buffer) <= (
            MAX_SERVER_FRAME
        ):
            continue
        # Too big for one frame (very long names): split it, one item per frame.
        del buffer[mark:]
        for offset, item in enumerate(chunk):
            mark = len(buffer)
            size = append_frame(
                encoder, RawBatch(seq=seq + start + offset, items=[item]), buffer
            )
            if size > MAX_SERVER_FRAME:
                del buffer[mark:]
                dropped += 1
                append_frame(encoder, Gap(seq=seq + start + offset, count=1), buffer)
    return dropped


def match_nothing(name: str) -> None:
    return None


def matcher(patterns: list[str]) -> Callable[[str], Any]:
    if not patterns:
        return match_nothing
    regex = "|".join(f"(?:{fnmatch.translate(p)})" for p in patterns)
    return re.compile(regex).match


class _Head(msgspec.Struct):
    """What the server reads of a frame it cannot decode as a client message, to say
    why: the encoded values of its ``"type"`` and ``"version"`` keys (empty if absent)."""

    type: msgspec.Raw = msgspec.Raw(b"")
    version: msgspec.Raw = msgspec.Raw(b"")


_decode_head = msgspec.msgpack.Decoder(_Head).decode


def decode_client_message(decode: Callable[[bytes], Any], frame: bytes) -> Any:
    """Decode one client frame, or raise :class:`Rejected` saying what is wrong with it
    (the ``Bye`` codes of ``docs/protocol.md``). Untrusted input: any failure to decode
    is the frame's fault.

    * not MessagePack, nested more than ``MAX_DEPTH`` (32) levels deep (checked before
      anything decodes it), not a map, no ``"type"`` key or a ``"type"`` that is not a
      str: ``malformed`` (not a message of the protocol at all);
    * a ``"type"`` that is no client message's name: ``unexpected``;
    * a ``Hello`` whose ``version`` is an integer: decoded by its version alone when the
      rest is invalid, so that a Hello of another protocol version gets ``version``
      whatever its other keys hold;
    * any other invalid key or value of a client message: ``malformed``.
    """
    try:
        # Bound the nesting first: decoders recurse per level, skipped values included.
        check_nesting(frame)
        return decode(frame)
    except msgspec.ValidationError as exc:
        invalid = exc
    except Exception as exc:  # DecodeError, UnicodeDecodeError, ...
        raise Rejected("malformed", f"malformed frame: {exc}") from None
    expected = "a message must be a msgpack map with a string 'type' key, got"
    try:
        head = _decode_head(frame)
    except msgspec.ValidationError:
        got = msgpack_kind(frame[0])
        got = "a map with a key that is not a str" if got == "map" else got
        raise Rejected("malformed", f"{expected} {got}.") from None
    except Exception as exc:
        raise Rejected("malformed", f"malformed frame: {exc}") from None
    if not head.type:
        raise Rejected("malformed", f"{expected} a map without 'type'.")
    try:
        kind = msgspec.msgpack.decode(head.type, type=str)
    except msgspec.ValidationError:
        got = msgpack_kind(bytes(head.type)[0])
        raise Rejected("malformed", f"{expected} a map whose 'type' is {got}.") from None
    except Exception as exc:
        raise Rejected("malformed", f"malformed frame: {exc}") from None
    if kind == "Hello" and head.version:
        try:
            version = msgspec.msgpack.decode(head.version, type=int)
        except Exception:
            pass  # not an integer: invalid like any other key
        else:
            if version not in PROTOCOL_VERSIONS:
                return Hello(version=version)
    if kind in CLIENT_TYPES:
        raise Rejected("malformed", f"invalid {kind} message: {invalid}")
    raise Rejected(
        "unexpected",
        f"unknown message type {kind!r}; clients send {', '.join(CLIENT_TYPES)} "
        "(maps with a 'type' key).",
    )
