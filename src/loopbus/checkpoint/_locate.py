"""Finding checkpoints: the last one written into a directory, and the checkpoint a path
means (``ckpt_path="last"`` and ``"best"`` are resolved by the stage, in
``stage/_saving.py``, among the trainer's plugins).

A directory means the checkpoint its ``last.json`` names or, without one or when that one
(or the pointer itself) is missing or damaged, the newest complete one
(:func:`latest_checkpoint`: the marker there, every file of the size it records, and
the CRC-32 of the file taken as its marker records it); the
checkpoints passed over are named, with what is wrong with each, in a ``UserWarning``.
Checkpoint files and sharded checkpoints' directories are treated alike, and so are a
local directory and an object store: the search (:func:`latest`) reads a
:class:`~loopbus.storage.Storage` and goes by what the store guarantees (whether an
entry found without its marker is whole), never by whether it is remote.
"""

from __future__ import annotations

import os
import posixpath
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from .._exceptions import CheckpointError
from ..storage import (
    RemotePath,
    Storage,
    located,
    location,
    store_for,
)
from ._format import (
    LAST_POINTER,
    MARKER_SUFFIX,
    SHARDED_MARKER,
    SHARDED_STATE,
    Marker,
    PathLike,
    Pointer,
    _why,
    decode_json,
    is_sharded_checkpoint,
)

_P = TypeVar("_P", Path, RemotePath, Path | RemotePath)

__all__ = [
    "candidates",
    "follow_pointer",
    "incomplete",
    "latest",
    "latest_checkpoint",
    "newest",
    "resolve_checkpoint",
    "sharded_incomplete",
]


# ---------------------------------------------------------------- in a directory


def newest(candidates: Iterable[_P]) -> _P | None:
    """The newest of ``candidates``: the highest step its completeness marker records,
    then the latest time of creation (without a marker, the time it was last modified,
    where its store says so). None if there are none."""
    best: tuple[Any, ...] | None = None
    chosen: _P | None = None
    for path in candidates:
        store, name = located(path)
        key = _stamp(store, name, sharded=store.size(name) is None)
        if best is None or key > best:
            best, chosen = key, path
    return chosen


def _stamp(store: Storage, name: str, *, sharded: bool) -> tuple[int, float]:
    """How new the checkpoint ``name`` of ``store`` is: the step and the time of creation
    its completeness marker records (-1 without a step; without a time, when it was last
    modified, where the store says so, else 0)."""
    try:
        data = (
            store.below(name).read_small(SHARDED_MARKER)
            if sharded
            else store.read_small(name + MARKER_SUFFIX)
        )
        info = decode_json(data, Marker)
    except (OSError, ValueError, CheckpointError):
        info = Marker()
    step = info.global_step
    created: Any = info.created
    if not isinstance(created, (int, float)):
        try:
            created = store.modified(name) or 0.0
        except OSError:
            created = 0.0
    return (step if isinstance(step, int) else -1, created)


def latest_checkpoint(directory: PathLike) -> Path | None:  # a RemotePath for a URL
    """The last checkpoint written into ``directory``: the one its ``last.json`` pointer
    names or, without a pointer (or when the one it names is missing or damaged), the
    newest complete one: with its completeness marker, and every file of the size the
    marker records. The file taken is also read whole, once, to check its CRC-32 against
    its marker's (a corrupted one is passed over for the next newest). A checkpoint
    passed over this way is named, with what is wrong with it, in a ``UserWarning``.
    None when the directory holds no complete checkpoint.

    A URL (a :class:`~loopbus.RemotePath` carries storage options) is searched alike,
    except that a checkpoint there is taken only with its marker, even when ``last.json``
    names it, and the result is a ``RemotePath``."""
    store = store_for(directory)
    found, skipped = latest(store)
    if skipped:
        warnings.warn(_skipped_message(store, found, skipped), UserWarning, stacklevel=2)
    return None if found is None else store.path(found)  # type: ignore[return-value]


#: The names a checkpoint file is taken to have, marker or not.
_CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth")

#: A checkpoint the search passed over, by name, and what is wrong with it.
Skipped = list[tuple[str, str]]


def latest(store: Storage) -> tuple[str | None, Skipped]:
    """The name of the last checkpoint in ``store`` and the checkpoints passed over for
    it, each with what is wrong with it (see :func:`latest_checkpoint`). Where an entry
    is whole without its marker (published by a rename), the checkpoint ``last.json``
    names is taken without its marker and, when nothing else is complete, as it is
    (loading it says what is wrong); in an object store only a marked, complete
    checkpoint is taken. The listing is read twice when the first finds no complete
    checkpoint: a save that replaced ``last.json`` and evicted the checkpoint it named
    meanwhile is then seen whole."""
    found, skipped = _latest_once(store)
    if found is None and skipped:
        found, skipped = _latest_once(store)
    return found, skipped


def _latest_once(store: Storage) -> tuple[str | None, Skipped]:
    objects, prefixes = store.contents()
    named: str | None = None
    skipped: Skipped = []
    if LAST_POINTER in objects:
        try:
            named = follow_pointer(store)
        except (OSError, ValueError) as exc:  # damaged: the newest complete one is taken
            skipped.append((LAST_POINTER, f"this pointer is ignored: {_why(exc)}"))
        else:
            # A file without a marker that the pointer names is taken where files are
            # renamed into place (checked structurally when it loads); a sharded
            # checkpoint that replaces one of the same name moves it aside for a moment
            # (a directory cannot be replaced atomically).
            why = incomplete(
                store, objects, prefixes, named, unmarked_file=store.whole_without_marker()
            ) or _corrupted(store, named, prefixes)
            if why is None:
                return named, []
            skipped.append((named, f"{LAST_POINTER} names it, but {why}"))
    complete, others = _complete(store, objects, prefixes, exclude=named)
    skipped += others
    while (found := _newest(store, complete, prefixes)) is not None:
        why = _corrupted(store, found, prefixes)
        if why is None:
            return found, skipped
        skipped.append((found, why))
        complete.remove(found)
    if named is not None and store.whole_without_marker():
        return named, []  # nothing to fall back to: loading it says what is wrong
    return None, skipped


def _newest(store: Storage, names: list[str], prefixes: set[str]) -> str | None:
    """The newest of the checkpoints ``names`` of ``store`` (see :func:`newest`)."""
    stamps = {name: _stamp(store, name, sharded=name in prefixes) for name in names}
    return max(names, key=stamps.__getitem__, default=None)


def candidates(store: Storage, objects: dict[str, int], prefixes: set[str]) -> list[str]:
    """The names in ``store`` that are checkpoints, complete or not: the files with a
    checkpoint's suffix or a completeness marker, and the directories of sharded
    checkpoints (where entries are renamed into place, one holding a sharded
    checkpoint's files; in an object store, where a checkpoint's prefix fills up under
    its final name, one with a checkpoint's suffix). Markers and hidden names are left
    out."""
    found: list[str] = []
    for name in sorted(set(objects) | prefixes):
        if name.startswith(".") or name == LAST_POINTER or name.endswith(MARKER_SUFFIX):
            continue
        if name in prefixes and name not in objects:
            if store.whole_without_marker():
                held = store.below(name).listing()
                if not any(n in held for n in (SHARDED_MARKER, ".metadata", SHARDED_STATE)):
                    continue
            elif posixpath.splitext(name)[1] not in _CHECKPOINT_SUFFIXES:
                continue
        elif (
            posixpath.splitext(name)[1] not in _CHECKPOINT_SUFFIXES
            and name + MARKER_SUFFIX not in objects
        ):
            continue
        found.append(name)
    return found


def _complete(
    store: Storage, objects: dict[str, int], prefixes: set[str], *, exclude: str | None
) -> tuple[list[str], Skipped]:
    """The complete checkpoints in ``store`` (files and sharded directories, each of the
    sizes its marker records), and, in the order of their names, the incomplete ones and
    the markers left alone, each with what is wrong with it; ``exclude`` is left out of
    both."""
    complete: list[str] = []
    skipped: list[tuple[str, str, str]] = []  # (listed as, checkpoint, why)
    for name in sorted(objects):
        base = name[: -len(MARKER_SUFFIX)]
        if name.endswith(MARKER_SUFFIX) and not name.startswith("."):
            if base not in objects and base not in prefixes and base != exclude:
                skipped.append((name, base, f"only its completeness marker {name} is left"))
    for name in candidates(store, objects, prefixes):
        if name == exclude:
            continue
        why = incomplete(store, objects, prefixes, name)
        if why is None:
            complete.append(name)
        else:
            skipped.append((name, name, why))
    skipped.sort(key=lambda entry: entry[0])
    return complete, [(name, why) for _, name, why in skipped]


def _corrupted(store: Storage, name: str, prefixes: set[str]) -> str | None:
    """What is wrong with the contents of the checkpoint file ``name`` (of the size its
    marker records), or None: its CRC-32 against the one its marker records, where the
    store reads it in place. Only the checkpoint about to be taken is read this way; a
    file without a marker, and a sharded checkpoint, pass (their structure is checked
    when they load)."""
    if name in prefixes:
        return None
    marker = name + MARKER_SUFFIX
    try:
        actual = store.crc32(name)
        if actual is None:
            return None
        info = decode_json(store.read_small(marker), Marker)
        if info.crc32 is None or actual == info.crc32:
            return None
    except (OSError, ValueError):
        return None  # reported as what it is when the file loads
    return (
        f"its CRC-32 does not match the one its completeness marker {marker} records (it is "
        "corrupted)"
    )


def incomplete(
    store: Storage,
    objects: dict[str, int],
    prefixes: set[str],
    name: str,
    *,
    unmarked_file: bool = False,
) -> str | None:
    """What keeps the checkpoint ``name`` of ``store`` (whose listing is ``objects`` and
    ``prefixes``) from being complete, or None: it is missing, it has no completeness
    marker (a file without one passes with ``unmarked_file``), or it has another size
    than its marker records. Sizes only: a file's CRC-32 is checked when it loads. A
    sharded checkpoint: see :func:`sharded_incomplete`."""
    if name in prefixes and name not in objects:
        return sharded_incomplete(store.below(name))
    marker = name + MARKER_SUFFIX
    if name not in objects:
        return "it does not exist"
    if marker not in objects:
        if unmarked_file:
            return None
        return (
            f"it has no completeness marker {marker} (its save did not finish, or the "
            "marker was deleted)"
        )
    info = _marker(store, marker)
    if isinstance(info, str):
        return info
    if objects[name] != info.size:
        return (
            f"it has {objects[name]} bytes where its completeness marker records {info.size} "
            "(it is truncated or was modified)"
        )
    return None


def _marker(store: Storage, marker: str) -> Marker | str:
    """The completeness marker ``marker`` of ``store``, or why it cannot be had."""
    try:
        return decode_json(store.read_small(marker), Marker)
    except FileNotFoundError:
        return f"it has no completeness marker {marker} (it was deleted meanwhile)"
    except (OSError, ValueError) as exc:
        return f"its completeness marker {marker} is damaged: {_why(exc)}"
    except Exception as exc:
        return f"its completeness marker {marker} cannot be read ({type(exc).__name__}: {exc})"


def sharded_incomplete(inside: Storage) -> str | None:
    """What keeps the sharded checkpoint whose directory is ``inside`` from being
    complete, or None: its marker (written last, once every rank's shards are) is
    missing or damaged, or a file it lists is missing or has another size."""
    objects = inside.listing()
    if SHARDED_MARKER not in objects:
        return (
            f"it has no completeness marker {SHARDED_MARKER} (its save did not finish, or "
            "the marker was deleted)"
        )
    info = _marker(inside, SHARDED_MARKER)
    if isinstance(info, str):
        return info
    files = info.files
    if not files:
        return f"its completeness marker {SHARDED_MARKER} lists no files"
    for file, size in files.items():
        if file not in objects:
            return f"its {inside.noun} {file} is missing"
        if objects[file] != size:
            return (
                f"its {inside.noun} {file} has {objects[file]} bytes where its completeness "
                f"marker records {size} (it is truncated or was modified)"
            )
    return None


def _skipped_message(store: Storage, found: str | None, skipped: Skipped) -> str:
    shown = "; ".join(f"{name}: {why}" for name, why in skipped[:5])
    if len(skipped) > 5:
        shown += f"; and {len(skipped) - 5} more"
    if found is None:
        then = "no complete checkpoint is left there"
    else:
        then = f"the newest complete checkpoint there, {found}, is taken instead"
    return f"skipped checkpoints in {store.directory} that are not complete ({shown}); {then}."


def follow_pointer(store: Storage) -> str:
    """The name of the checkpoint the ``last.json`` of ``store`` names. Raises
    ``OSError`` (``FileNotFoundError`` without one) or ``ValueError`` (a clause saying
    what is wrong): a pointer that is damaged, or names something that is not a file
    name in its directory."""
    try:
        name = decode_json(store.read_small(LAST_POINTER), Pointer).checkpoint
    except ValueError as exc:
        raise ValueError(
            f'{exc}; it should be JSON like {{"checkpoint": "epoch=0-step=100.ckpt"}}'
        ) from None
    separators = [s for s in ("/", os.sep, os.altsep) if s]
    if not name or name in (".", "..") or any(s in name for s in separators):
        raise ValueError(f"it names {name!r}, which is not a file name in its directory")
    return name


def resolve_checkpoint(path: PathLike) -> Path | RemotePath:
    """The checkpoint ``path`` means: a checkpoint file (an object, for a URL), a sharded
    checkpoint's directory, another directory (its last checkpoint) or a ``last.json``
    pointer (its directory's last checkpoint). Whether a file or a sharded checkpoint is
    whole is checked when it loads. Raises :class:`CheckpointError` saying what is there
    instead: a directory's checkpoints that are not complete and why, the files without a
    completeness marker, the checkpoints beside a path that does not exist."""
    target = location(path)
    parent, name = located(target)
    if parent.size(name) is not None:  # a file (an object)
        return target if name != LAST_POINTER else _last_in(parent)
    if parent.is_directory(name):
        return target if is_sharded_checkpoint(target) else _last_in(store_for(target))
    nearby = ""
    try:
        objects, prefixes = parent.contents()
    except (OSError, CheckpointError):  # what is beside it is only advice
        objects, prefixes = {}, set()
    names = sorted(n for n in set(objects) | prefixes if n.endswith(".ckpt"))[:10]
    if names:
        nearby = f" Checkpoints in {parent.directory}: {', '.join(names)}."
    raise CheckpointError(f"no checkpoint at {target}: the {parent.noun} does not exist.{nearby}")


def _last_in(store: Storage) -> Path | RemotePath:
    """The last checkpoint in the directory of ``store`` (see :func:`latest`), with a
    warning naming the newer ones passed over; an error that names them, and the files
    without a completeness marker, when there is none."""
    found, skipped = latest(store)
    if found is None:
        objects, prefixes = store.contents()
        # Files without a marker are named by the advice; the rest is listed here.
        damaged = [
            f"{name}: {why}"
            for name, why in skipped
            if name in prefixes
            or name not in objects
            or name + MARKER_SUFFIX in objects
            or name == LAST_POINTER
        ]
        listed = f" Skipped as not complete: {'; '.join(damaged[:5])}." if damaged else ""
        raise CheckpointError(
            f"no checkpoint in the directory {store.directory}: it is a directory without "
            f"checkpoints (it has no {LAST_POINTER} pointer and no complete checkpoint "
            f"file, one with its {MARKER_SUFFIX} marker).{listed} "
            f"{_unmarked_files(store, objects, prefixes)}"
        )
    if skipped:
        warnings.warn(_skipped_message(store, found, skipped), UserWarning, stacklevel=4)
    return store.path(found)


def _unmarked_files(store: Storage, objects: dict[str, int], prefixes: set[str]) -> str:
    """The advice for a directory without checkpoints (``store``, whose listing is
    ``objects`` and ``prefixes``): the checkpoint-like entries in it that have no
    marker, if any."""
    names = sorted(
        name
        for name in set(objects) | prefixes
        if posixpath.splitext(name)[1] in _CHECKPOINT_SUFFIXES
        and (
            SHARDED_MARKER not in store.below(name).listing()
            if name in prefixes
            else name + MARKER_SUFFIX not in objects
        )
    )
    if not names:
        return "Pass the path of a checkpoint file."
    shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
    return f"It holds {shown} without completeness markers; pass one of them explicitly."
