"""Decoding frames from another process (untrusted input) with bounded nesting.

msgspec decodes a nested value, and skips the value of a key it does not know, by
recursing once per level of nesting, and what stops it is the interpreter's recursion
limit. A process that raised the limit (``sys.setrecursionlimit(50_000)`` is common advice
for deep models and for ``torch.compile``) then overflows its C stack on a frame that is
an array in an array in an array ..., 30,000 levels deep (30 kB of ``0x91`` bytes), and
dies with a segmentation fault. So no frame from another process reaches a decoder that
could recurse into it before :func:`check_nesting` measured its depth (iteratively:
a loop, not recursion), with one exception: frames a *strict* decoder reads whole (every
key known, every array as long as its type; the frames a server of this version sends).
Such a decoder skips nothing, so it never recurses deeper than its types, whatever the
bytes hold; a frame it cannot read is checked, then decoded by the lenient decoder (keys
it does not know are ignored, as the protocol says).
"""

from __future__ import annotations

from functools import reduce
from operator import or_
from types import GenericAlias
from typing import Any, Final

import msgspec

from ._wire import (
    Batch,
    Bye,
    EpochEnded,
    Gap,
    Record,
    ServerMessage,
    StageEnded,
    StageStarted,
    Subscribed,
    Welcome,
)

__all__ = ["MAX_DEPTH", "ServerFrames", "check_nesting", "msgpack_kind"]

#: How many levels arrays and maps may nest in a frame (its outermost map is level 1). The
#: protocol's messages nest at most 3 (a batch's map, its items array, an item); deeper
#: frames are refused before they are decoded.
MAX_DEPTH: Final = 32

# First bytes of MessagePack values: maps and arrays (fix, 16- and 32-bit counts).
_CONTAINER_BYTES = frozenset([*range(0x80, 0xA0), 0xDC, 0xDD, 0xDE, 0xDF])
_NOT_CONTAINER = bytes(b for b in range(256) if b not in _CONTAINER_BYTES)
# Values of a fixed size, by first byte: their size in bytes (0: not one of them).
_FIXED = bytearray(256)
for _b in (*range(0x00, 0x80), *range(0xE0, 0x100), 0xC0, 0xC2, 0xC3):
    _FIXED[_b] = 1
for _b in range(0xA0, 0xC0):  # fixstr
    _FIXED[_b] = 1 + (_b & 0x1F)
for _b, _size in {
    0xCA: 5, 0xCB: 9,  # float 32, 64
    0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9,  # uint 8 .. 64
    0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9,  # int 8 .. 64
    0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18,  # fixext 1 .. 16
}.items():  # fmt: skip
    _FIXED[_b] = _size
# The same, with an empty fixmap or fixarray as a value of one byte (where one more level
# is allowed), and the number of values in a non-empty fixmap or fixarray (0: not one).
_FIXED_OR_EMPTY = bytearray(_FIXED)
_FIXED_OR_EMPTY[0x80] = _FIXED_OR_EMPTY[0x90] = 1
_FIX_COUNT = bytearray(256)
for _b in range(0x81, 0x90):
    _FIX_COUNT[_b] = (_b & 0x0F) * 2
for _b in range(0x91, 0xA0):
    _FIX_COUNT[_b] = _b & 0x0F
# Values with a length field (str, bin, ext): bytes of the length, bytes after it before
# the data (ext's type byte).
_SIZED = {
    0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0),  # bin 8, 16, 32
    0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1),  # ext 8, 16, 32
    0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0),  # str 8, 16, 32
}  # fmt: skip
# Arrays and maps with a count field: bytes of the count, values per counted entry.
_COUNTED = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


def _deeper_than(data: bytes, limit: int) -> bool:
    """Whether the first MessagePack value of ``data`` nests arrays and maps more than
    ``limit`` levels deep (an empty one counts). Reads iteratively; it stops, saying no,
    at a byte that is not MessagePack or at the end of ``data``: up to there the value is
    no deeper than ``limit``, and the decoder that reads it next says what is wrong."""
    end = len(data)
    pos = 0
    left = 1  # values left to read in the innermost open array or map (or the frame)
    outer: list[int] = []  # the same for the arrays and maps around it
    fixed = _FIXED_OR_EMPTY if limit > 0 else _FIXED
    while True:
        while left:
            if pos >= end:
                return False
            first = data[pos]
            size = fixed[first]
            left -= 1
            if size:
                pos += size
                continue
            count = _FIX_COUNT[first]
            if count:
                pos += 1
            elif first in _SIZED:
                width, extra = _SIZED[first]
                pos += 1 + width + extra + int.from_bytes(data[pos + 1 : pos + 1 + width], "big")
                continue
            elif first in _COUNTED:
                width, per_entry = _COUNTED[first]
                count = int.from_bytes(data[pos + 1 : pos + 1 + width], "big") * per_entry
                pos += 1 + width
            elif first == 0xC1:  # never used
                return False
            # An array or map, at level len(outer) + 1.
            if len(outer) >= limit:
                return True
            if count:
                outer.append(left)
                left = count
                if len(outer) >= limit:  # no array or map fits inside this one
                    fixed = _FIXED
        if not outer:
            return False
        left = outer.pop()
        fixed = _FIXED_OR_EMPTY


def check_nesting(data: bytes, limit: int = MAX_DEPTH) -> None:
    """Raise ``msgspec.DecodeError`` if the MessagePack value ``data`` starts with nests
    arrays and maps more than ``limit`` levels deep; return at once when ``data`` holds
    too few bytes that can start an array or a map to nest that deep."""
    if len(data.translate(None, _NOT_CONTAINER)) <= limit:
        return
    if _deeper_than(data, limit):
        raise msgspec.DecodeError(
            f"it nests arrays and maps more than {limit} levels deep (the messages of "
            "the protocol nest at most 3)"
        )


def msgpack_kind(first: int) -> str:
    """What a MessagePack value whose first byte is ``first`` is called in the protocol's
    words (``docs/protocol.md``)."""
    if first <= 0x7F or first >= 0xE0 or 0xCC <= first <= 0xD3:
        return "int"
    if first <= 0x8F or first in (0xDE, 0xDF):
        return "map"
    if first <= 0x9F or first in (0xDC, 0xDD):
        return "array"
    if first <= 0xBF or 0xD9 <= first <= 0xDB:
        return "str"
    names = {0xC0: "nil", 0xC1: "an invalid byte", 0xC2: "bool", 0xC3: "bool"}
    names |= {0xC4: "bin", 0xC5: "bin", 0xC6: "bin", 0xCA: "float", 0xCB: "float"}
    return names.get(first, "ext")


# ---------------------------------------------------------------- what servers send


def _strict(cls: Any, **fields: Any) -> Any:
    """A subclass of the wire message ``cls`` that refuses keys and array elements it does
    not know (instead of skipping them), with ``fields`` retyped."""
    config = cls.__struct_config__
    return msgspec.defstruct(
        cls.__name__,
        list(fields.items()),
        bases=(cls,),
        module=__name__,
        tag=config.tag,
        tag_field=config.tag_field,
        array_like=config.array_like,
        frozen=True,
        kw_only=True,
        forbid_unknown_fields=True,
    )


_EVENTS = (EpochEnded, StageStarted, StageEnded)
_STRICT_ITEMS = tuple(_strict(cls) for cls in (Record, *_EVENTS))
_STRICT_BATCH = _strict(Batch, items=GenericAlias(list, reduce(or_, _STRICT_ITEMS)))
_STRICT_OTHERS = tuple(_strict(cls) for cls in (Welcome, Subscribed, Gap, Bye))
_STRICT_MESSAGE = reduce(or_, _STRICT_OTHERS, _STRICT_BATCH)
#: Strict subclass -> the wire class (records stay strict: they are converted anyway).
_PLAIN: dict[type, type] = {
    strict: strict.__bases__[0] for strict in (*_STRICT_ITEMS[1:], *_STRICT_OTHERS)
}
# A frame a strict decoder may read: a map of at most 15 keys whose first key is "type",
# so that finding the message's type skips no value.
_FAST_HEADS = frozenset(range(0x81, 0x90))
_TYPE_FIRST = b"\xa4type"


def plain(item: Any) -> Any:
    """``item`` as an instance of its wire class (:class:`ServerFrames` hands out batches
    whose items may be strict subclasses)."""
    cls = _PLAIN.get(type(item))
    return item if cls is None else cls(**msgspec.structs.asdict(item))


class ServerFrames:
    """Decodes the frames a server sends (untrusted input) into ``ServerMessage``\\ s.

    Every message but a :class:`Batch` comes back as an instance of its wire class. A
    batch may come back as a strict subclass of :class:`Batch` whose items are instances
    of subclasses of :class:`Record` and the event classes; :func:`plain` turns an event
    into its wire class. Raises ``msgspec.DecodeError`` or ``msgspec.ValidationError``
    (with the problem in words) for a frame that is not a valid message."""

    __slots__ = ("_lenient", "_strict")

    def __init__(self) -> None:
        self._strict = msgspec.msgpack.Decoder(_STRICT_MESSAGE).decode
        self._lenient = msgspec.msgpack.Decoder(ServerMessage).decode

    def decode(self, frame: bytes) -> Any:
        if frame[:1] and frame[0] in _FAST_HEADS and frame[1:6] == _TYPE_FIRST:
            try:
                message = self._strict(frame)
            except Exception:  # a key or element it does not know, or invalid: see below
                pass
            else:
                if type(message) is _STRICT_BATCH:
                    return message
                return plain(message)
        check_nesting(frame)
        return self._lenient(frame)
