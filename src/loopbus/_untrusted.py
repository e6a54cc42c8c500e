"""Reading files that another process wrote (untrusted input): bounded size and nesting.

Python's ``json`` module and msgspec's JSON decoder decode a nested value, and msgspec
skips the value of a key it does not know, by recursing once per level of nesting; what
stops them is the interpreter's recursion limit. A process that raised it
(``sys.setrecursionlimit(100_000)`` is common advice for deep models and for
``torch.compile``) then overflows its C stack on a file that holds an array in an array
in an array ..., 100,000 levels deep (200 kB of brackets), and dies with a segmentation
fault. So no JSON text from a file reaches a decoder before :func:`check_json_nesting`
measured its depth, without recursion; and a small file (a checkpoint's completeness
marker, the ``last.json`` pointer) is read by :func:`read_small`, which refuses one
larger than it can be, or one that is not a regular file (a FIFO would block the read).

This module imports nothing from loopbus and nothing from torch, so every layer may use
it. Plugins reach the check as
``loopbus.check_json_nesting``.
"""

from __future__ import annotations

import itertools
import os
import re
import stat
from typing import Any, Final

import msgspec

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_SMALL_FILE",
    "MAX_STATE_DEPTH",
    "check_json_nesting",
    "check_state_nesting",
    "read_small",
]

#: How many levels arrays and objects may nest in the JSON files loopbus reads (the
#: outermost one is level 1). Its own files nest at most 2 (a sharded checkpoint's marker,
#: a record's ``destinations``); deeper text is refused before it is decoded.
MAX_JSON_DEPTH: Final = 64
#: The largest completeness marker or ``last.json`` pointer that is read: 1 MiB. loopbus
#: writes a few hundred bytes (a sharded checkpoint's marker: about 40 per file).
MAX_SMALL_FILE: Final = 1 << 20

# What changes the depth: a string (skipped whole, escapes included; one left open runs
# to the end of the text), an opening bracket and a closing one.
_TOKENS = re.compile(rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"?|[\[{\]}]', re.DOTALL)
_OPENING = frozenset(b"[{")
_QUOTE = ord('"')


def check_json_nesting(data: bytes, limit: int = MAX_JSON_DEPTH) -> bytes:
    """Return ``data`` if the JSON text it holds nests arrays and objects at most
    ``limit`` levels deep (the outermost one is level 1); raise ``msgspec.DecodeError``
    (a ``ValueError``) saying so otherwise. Brackets inside strings do not count.

    The text is measured with a loop, not by recursion, and only as deep as it has to
    be: at once when it holds at most ``limit`` opening brackets (every record, marker
    and pointer loopbus writes), else in one pass that stops at the first level too
    deep. Text that is not JSON is measured all the same; the decoder that reads it next
    says what is wrong with it."""
    if data.count(b"[") + data.count(b"{") <= limit:
        return data
    depth = 0
    for match in _TOKENS.finditer(data):
        first = data[match.start()]
        if first == _QUOTE:
            continue
        if first in _OPENING:
            depth += 1
            if depth > limit:
                raise msgspec.DecodeError(
                    f"it nests arrays and objects more than {limit} levels deep (loopbus "
                    "writes at most 2); it was not decoded"
                )
        elif depth:
            depth -= 1
    return data


def read_small(path: str | os.PathLike[str], limit: int = MAX_SMALL_FILE) -> bytes:
    """The bytes of the regular file at ``path``, at most ``limit`` of them. Raises
    ``FileNotFoundError`` (and other ``OSError``\\ s) as ``open`` does, and
    ``ValueError`` for a file that is not a regular file or is larger than ``limit``
    (the message says which; neither is read)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError("it is not a regular file; it was not read")
        data = file.read(limit + 1)
    if len(data) > limit:
        raise ValueError(
            f"it is larger than {limit:,} bytes, far more than loopbus writes there; it was "
            "not decoded"
        )
    return data


#: How many levels lists, tuples and dicts may nest in the state a checkpoint file holds
#: (the state itself is level 1). loopbus's own parts nest at most 8; a component whose
#: state nests deeper cannot be saved. torch's weights-only unpickler builds any depth
#: without recursion, but whoever reads the state next (``str()`` of a value, an
#: optimizer's ``load_state_dict``) recurses, and overflows the C stack of a process that
#: raised its recursion limit: deeper states are refused before anything reads them.
MAX_STATE_DEPTH: Final = 100

_CONTAINERS = (dict, list, tuple)
_SCALAR_KEYS = (str, int, float, bool, type(None))


def _children(obj: Any) -> list[Any]:
    """The entries of a container that are containers: a dict's values, its keys that are
    tuples and its attributes' values, a list's or a tuple's items."""
    if isinstance(obj, dict):
        found = [v for v in obj.values() if isinstance(v, _CONTAINERS)]
        found += [k for k in obj if isinstance(k, tuple)]
        attributes = getattr(obj, "__dict__", None)  # an OrderedDict's (``_metadata``)
        if attributes:
            found += [v for v in attributes.values() if isinstance(v, _CONTAINERS)]
        return found
    return [v for v in obj if isinstance(v, _CONTAINERS)]


def _key(parent: Any, child: Any) -> str:
    """How ``child`` is reached from ``parent``, for a message (``repr`` is called on
    nothing but short scalars: on a container it could recurse)."""
    if isinstance(parent, dict):
        for key, value in parent.items():
            if key is child:
                return " (a key)"
            if value is child:
                break
        else:
            attributes = getattr(parent, "__dict__", {})
            name = next((k for k, v in attributes.items() if v is child), "?")
            return f".{name}"
    else:
        key = next(i for i, item in enumerate(parent) if item is child)
    if isinstance(key, _SCALAR_KEYS):
        text = repr(key)
        return f"[{text if len(text) <= 40 else text[:37] + '...'}]"
    return f"[<{type(key).__name__}>]"


def _where(path: list[Any]) -> str:
    """The keys from ``path[0]`` to ``path[-1]`` (containers, each holding the next),
    the middle of a long path left out."""
    keys = [_key(parent, child) for parent, child in itertools.pairwise(path)]
    if len(keys) > 12:
        keys = [*keys[:8], f"...({len(keys) - 11} more)...", *keys[-3:]]
    return "".join(keys) or "the top level"


def check_state_nesting(state: Any, limit: int = MAX_STATE_DEPTH) -> None:
    """Raise ``ValueError`` if the lists, tuples and dicts of ``state`` (the values an
    unpickler built, dict keys included) nest more than ``limit`` levels deep, or one of
    them contains itself (its depth has no end); the message is a clause (``"it ..."``)
    naming the entry. Walks without recursion, each container once, however often it is
    shared."""
    if not isinstance(state, _CONTAINERS):
        return
    heights: dict[int, int] = {}  # containers done -> how many levels they nest
    on_path = {id(state)}
    path = [state]  # the open containers, from ``state`` down
    # For each open container: its children that are containers, how many of them were
    # looked at, the highest of them so far.
    pending: list[list[Any]] = [[_children(state), 0, 0]]
    while pending:
        top = pending[-1]
        children, depth = top[0], len(pending)
        while top[1] < len(children):
            child = children[top[1]]
            top[1] += 1
            if id(child) in on_path:
                raise ValueError(
                    f"it holds a {type(child).__name__} that contains itself (at "
                    f"{_where([*path, child])}); loopbus refuses it before anything reads it"
                )
            height = heights.get(id(child), 1 if depth >= limit else None)
            if height is None:
                on_path.add(id(child))
                path.append(child)
                pending.append([_children(child), 0, 0])
                break
            if depth + height > limit:
                raise ValueError(
                    f"it nests lists, tuples and dicts more than {limit} levels deep (at "
                    f"{_where([*path, child])}); loopbus refuses deeper states before "
                    "anything reads them"
                )
            top[2] = max(top[2], height)
        else:
            pending.pop()
            done = path.pop()
            on_path.discard(id(done))
            heights[id(done)] = top[2] + 1
            if pending:
                pending[-1][2] = max(pending[-1][2], top[2] + 1)
