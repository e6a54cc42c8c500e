"""What the stream server keeps for each client, apart from the I/O: the bounded queue and
its sequence numbers, batching into frames with exact gap notices, the name filter and
what it allows the client to subscribe, and decoding what clients send (untrusted
input)."""

from __future__ import annotations

import fnmatch
import re
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from ._limits import (
    PATTERN_BURST,
    PATTERN_RATE,
    ROUTE_CACHE_LIMIT,
    SUBSCRIBE_BURST,
    UNREAD_ACKS,
    Allowance,
)
from ._nesting import check_nesting, msgpack_kind
from ._wire import (
    MAX_PATTERN_LENGTH,
    MAX_PATTERNS,
    MAX_SERVER_FRAME,
    PROTOCOL_VERSIONS,
    FrameReader,
    Gap,
    Hello,
    RawBatch,
    Subscribe,
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
    "pattern_cost",
]

#: Items per batch frame (about 45 bytes each for typical records).
BATCH_ITEMS = 1024
#: The message types a client may send.
CLIENT_TYPES = ("Hello", "Subscribe", "Bye")


class Rejected(Exception):
    """End a client's connection with ``Bye(code, reason)``. ``abort`` for a client that
    passed a bound: it is closed at once, without reading more of what it sent (its bye
    may be lost); otherwise the server lets it read the bye first."""

    def __init__(self, code: str, reason: str, *, abort: bool = False) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason
        self.abort = abort


class Connection:
    """One connected client: its filters, its queue, its sequence numbers, what its
    writer task is asked to do, and what it may still subscribe (``subscribe_rate``
    Subscribe frames a second; see :mod:`._limits`)."""

    __slots__ = (
        "_patterns",
        "_seen",
        "_subscribes",
        "acks",
        "bye",
        "dropped",
        "flush",
        "input_closed",
        "match",
        "names",
        "next_seq",
        "peer",
        "queue",
        "reader",
        "scope",
        "sent_seq",
        "stream",
        "subscribe_rate",
        "topics",
        "waiting",
        "wake",
    )

    def __init__(
        self,
        stream: SocketStream,
        buffer: int,
        max_frame: int,
        peer: str,
        *,
        subscribe_rate: float,
    ) -> None:
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
        #: The filters in force: the name patterns, compiled, and the topics.
        self.names: tuple[str, ...] = ()
        self.match: Callable[[str], bool] = match_nothing
        self.topics: frozenset[str] = frozenset()
        # Whether the filters take a record name, remembered per name until they change.
        self._seen: dict[str, bool] = {}
        #: ``Subscribed`` answers the writer has yet to send (at most ``UNREAD_ACKS``).
        self.acks: list[Subscribed] = []
        self.subscribe_rate = subscribe_rate
        self._subscribes = Allowance(subscribe_rate, SUBSCRIBE_BURST)
        self._patterns = Allowance(PATTERN_RATE, PATTERN_BURST)
        self.bye: tuple[str, str] | None = None
        self.flush = False
        self.scope: anyio.CancelScope | None = None
        #: Set when the client closed its side (or left): nothing more will be read.
        self.input_closed = anyio.Event()

    def allow(self, message: Subscribe, now: float) -> int:
        """Count a Subscribe the client sent at ``now`` (seconds) and return what its
        patterns cost (:func:`pattern_cost`), or raise :class:`Rejected` (code
        ``too_large``, ``abort``) naming the bound it passes: more Subscribe frames than
        ``subscribe_rate`` a second, more characters of name patterns than
        ``PATTERN_RATE`` a second (each after its burst), or more unread ``Subscribed``
        answers than ``UNREAD_ACKS``."""
        if not self._subscribes.take(1, now):
            raise Rejected(
                "too_large",
                f"more than {self.subscribe_rate:g} Subscribe frames a second (after "
                f"{SUBSCRIBE_BURST} at once); subscribe once and change the filters "
                "only when they change.",
                abort=True,
            )
        cost = sum(map(pattern_cost, message.names))
        if not self._patterns.take(cost, now):
            raise Rejected(
                "too_large",
                f"more than {PATTERN_RATE:,} characters of name patterns a second in "
                f"Subscribe frames (after {PATTERN_BURST:,} at once; a range of "
                "characters x-y counts a quarter of its width more).",
                abort=True,
            )
        if len(self.acks) >= UNREAD_ACKS:
            raise Rejected(
                "too_large",
                f"more than {UNREAD_ACKS} Subscribed answers waiting for the client to "
                "read them; read what the server sends.",
                abort=True,
            )
        return cost

    def set_filters(self, names: list[str], topics: list[str]) -> bool:
        """Take these filters; False (and nothing changes) if they are those in force."""
        patterns = tuple(names)
        chosen = frozenset(topics)
        if patterns == self.names and chosen == self.topics:
            return False
        if patterns != self.names:
            self.names = patterns
            self.match = matcher(names)
            self._seen = {}
        self.topics = chosen
        return True

    def takes(self, name: str) -> bool:
        """Whether the name filters accept the record name ``name`` (matched once per name
        until the filters change; at most ``ROUTE_CACHE_LIMIT`` names are remembered)."""
        seen = self._seen
        taken = seen.get(name)
        if taken is None:
            if len(seen) >= ROUTE_CACHE_LIMIT:
                seen.clear()
            taken = seen[name] = self.match(name)
        return taken

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


def match_nothing(name: str) -> bool:
    return False


def matcher(patterns: list[str]) -> Callable[[str], bool]:
    """A function that tells whether any of ``patterns`` (shell globs, case-sensitive)
    matches a name whole.

    Each pattern is compiled on its own (``re.compile`` of ``fnmatch.translate``): the
    module cache of ``re`` then holds at most its 512 last patterns, each of one glob of
    at most 256 characters (some 50 KB at the very most), never a client's whole
    Subscribe at once."""
    if not patterns:
        return match_nothing
    matches = [re.compile(fnmatch.translate(p)).match for p in dict.fromkeys(patterns)]
    if len(matches) == 1:
        first = matches[0]
        return lambda name: first(name) is not None
    return lambda name: any(match(name) is not None for match in matches)


def pattern_cost(pattern: str) -> int:
    """What compiling ``pattern`` costs the server, in characters of an ordinary pattern:
    its length, plus a quarter of the width of each range of characters written
    ``x-y`` in it (wherever it is: a character class over a wide range of Unicode takes
    the ``re`` compiler time in proportion to the range, up to 65,536 characters)."""
    cost = len(pattern)
    start = pattern.find("-", 1)
    while 0 < start < len(pattern) - 1:
        low, high = ord(pattern[start - 1]), min(ord(pattern[start + 1]), 0xFFFF)
        if high > low:
            cost += (high - low) // 4
        start = pattern.find("-", start + 1)
    return cost


class _Head(msgspec.Struct):
    """What the server reads of a frame it cannot decode as a client message, to say
    why: the encoded values of its ``"type"`` and ``"version"`` keys (empty if absent)."""

    type: msgspec.Raw = msgspec.Raw(b"")
    version: msgspec.Raw = msgspec.Raw(b"")


_decode_head = msgspec.msgpack.Decoder(_Head).decode


class _Names(msgspec.Struct):
    """A Subscribe's ``names`` without their limits: read to say which limit a frame
    that failed them passed."""

    names: list[str] = msgspec.field(default_factory=list)


_decode_names = msgspec.msgpack.Decoder(_Names).decode


def _pattern_limit(frame: bytes) -> str | None:
    """Which pattern limit the Subscribe ``frame`` passes, in words (None: none, or its
    names are not a list of str)."""
    try:
        names = _decode_names(frame).names
    except Exception:
        return None
    if len(names) > MAX_PATTERNS:
        return (
            f"a Subscribe carries at most {MAX_PATTERNS} name patterns; this one has "
            f"{len(names)}."
        )
    for i, name in enumerate(names):
        if len(name) > MAX_PATTERN_LENGTH:
            return (
                f"a name pattern has at most {MAX_PATTERN_LENGTH} characters; names[{i}] "
                f"has {len(name)}."
            )
    return None


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
    * a ``Subscribe`` with more than ``MAX_PATTERNS`` (64) name patterns or a pattern
      longer than ``MAX_PATTERN_LENGTH`` (256): ``malformed``, naming that limit;
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
    if kind == "Subscribe" and (limit := _pattern_limit(frame)) is not None:
        raise Rejected("malformed", f"invalid Subscribe message: {limit}")
    if kind in CLIENT_TYPES:
        raise Rejected("malformed", f"invalid {kind} message: {invalid}")
    raise Rejected(
        "unexpected",
        f"unknown message type {kind!r}; clients send {', '.join(CLIENT_TYPES)} "
        "(maps with a 'type' key).",
    )
