"""The on-disk format of a checkpoint: the names of its files, its completeness markers
and ``last.json`` pointers, and the header every checkpoint dict starts with.

A checkpoint file ``<file>`` has its completeness marker ``<file>.complete`` beside it
(JSON: size, CRC-32, step); a sharded checkpoint is a directory whose marker,
``loopbus.complete`` (JSON: the size of every file in it), is inside it. A directory's
``last.json`` names the last checkpoint written into it. What is being written has a
temporary name, ``.<name>.tmp-<pid>-<random>@<host>``, that says which process of which
host writes it.

Markers and pointers are read as untrusted input: at most 1 MiB, nesting measured before
they are decoded, and decoded only into the typed :class:`Marker` and :class:`Pointer`
(keys they do not name are ignored, so files of earlier versions still load); one that is
too large, too deep or of the wrong shape is damaged, like one that is not JSON.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec

from .._exceptions import CheckpointError
from .._untrusted import check_json_nesting, read_small
from .._version import __version__
from ..state._run_config import json_safe
from ..storage import RemotePath, Storage, crc32_of, located

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "LAST_POINTER",
    "MARKER_SUFFIX",
    "SHARDED_MARKER",
    "SHARDED_STATE",
    "Marker",
    "PathLike",
    "Pointer",
    "check_header",
    "checkpoint_info",
    "decode_json",
    "describe_os_error",
    "is_sharded_checkpoint",
    "marker_config",
    "marker_path",
    "pointer_to",
    "read_json",
    "read_marker",
    "read_remote_json",
]

FORMAT = "loopbus.checkpoint"
#: The checkpoint format this loopbus writes and the newest one it reads.
FORMAT_VERSION = 2
#: The name of the pointer file that names the last checkpoint written into a directory.
LAST_POINTER = "last.json"
MARKER_SUFFIX = ".complete"
#: The completeness marker inside a sharded checkpoint's directory, written last.
SHARDED_MARKER = "loopbus.complete"
#: The file of a sharded checkpoint that holds everything but the sharded tensors.
SHARDED_STATE = "loopbus_state.pt"

PathLike = str | os.PathLike[str]


# ---------------------------------------------------------------- names


def marker_path(path: PathLike) -> Path:
    """The completeness marker of the checkpoint at ``path``: ``<file>.complete`` beside
    a file, ``<directory>/loopbus.complete`` inside a sharded checkpoint's directory."""
    p = Path(path)
    if p.is_dir():
        return p / SHARDED_MARKER
    return p.with_name(p.name + MARKER_SUFFIX)


def is_sharded_checkpoint(path: PathLike) -> bool:
    """Whether ``path`` is a sharded checkpoint's directory: it holds a completeness
    marker, the torch.distributed.checkpoint metadata or loopbus's state file."""
    store, name = located(path)
    names = store.below(name).listing()  # nothing for a file: it holds no entries
    return any(entry in names for entry in (SHARDED_MARKER, ".metadata", SHARDED_STATE))


# ---------------------------------------------------------------- markers and pointers


class Marker(msgspec.Struct, frozen=True, kw_only=True):
    """A completeness marker as it is read: a checkpoint file's (``size``, ``crc32``) or
    a sharded checkpoint's (``layout``, ``files``: each file's size). Every key is
    optional and keys it does not name are ignored, so markers of earlier and later
    versions load; what a reader needs is checked where it is used."""

    format: str | None = None
    format_version: int | None = None
    layout: str | None = None
    file: str | None = None
    checkpoint: str | None = None
    size: int | None = None
    crc32: int | None = None
    files: dict[str, int] | None = None
    global_step: int | None = None
    epoch: int | None = None
    created: float | None = None
    world_size: int | None = None
    strategy: str | None = None
    config: dict[str, Any] | None = None


class Pointer(msgspec.Struct, frozen=True, kw_only=True):
    """A directory's ``last.json`` as it is read: the name of its last checkpoint (and
    that checkpoint's step, epoch and time of creation, which readers do not need)."""

    checkpoint: str
    global_step: int | None = None
    epoch: int | None = None
    created: float | None = None


_Schema = TypeVar("_Schema", Marker, Pointer)


def read_json(path: Path, schema: type[_Schema]) -> _Schema:
    """The small JSON file ``path`` (a marker, a pointer) decoded into ``schema``: read
    whole only if it is a regular file of at most 1 MiB, decoded only if it nests at most
    64 levels. Raises ``OSError`` (``FileNotFoundError`` when it is absent) or a
    ``ValueError`` whose message is a clause (``"it ..."``) saying what is wrong."""
    return decode_json(read_small(path), schema)


def read_remote_json(store: Storage, name: str, schema: type[_Schema]) -> _Schema:
    """:func:`read_json` for the entry ``name`` of a store."""
    return decode_json(store.read_small(name), schema)


def decode_json(data: bytes, schema: type[_Schema]) -> _Schema:
    """The small JSON document ``data`` decoded into ``schema`` (see :func:`read_json`)."""
    data = check_json_nesting(data)
    try:
        return msgspec.json.decode(data, type=schema)
    except msgspec.ValidationError as exc:
        raise ValueError(f"it is JSON but not of the expected shape ({exc})") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"it is not valid JSON ({exc})") from None


#: The largest configuration (as JSON) a completeness marker repeats from the header.
_MARKER_CONFIG_MAX = 256 * 1024


def marker_config(header: Mapping[str, Any]) -> dict[str, Any]:
    """``{"config": ...}``: the run's configuration of a checkpoint's ``header``, as its
    completeness marker repeats it (for :func:`checkpoint_info`), JSON-safe; ``{}``
    without one, or for one over 256 KiB (the checkpoint itself still holds it)."""
    config = header.get("config")
    if not isinstance(config, dict):
        return {}
    safe = json_safe(config)
    if len(msgspec.json.encode(safe)) > _MARKER_CONFIG_MAX:
        return {}
    return {"config": safe}


def pointer_to(target: Path | RemotePath, info: Mapping[str, Any]) -> dict[str, Any]:
    """The ``last.json`` that names the checkpoint ``target``, with the step, epoch and
    time of creation its completeness marker ``info`` records."""
    pointer = {k: info[k] for k in ("global_step", "epoch", "created")}
    pointer["checkpoint"] = target.name
    return pointer


_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


def describe_os_error(exc: OSError) -> str:
    """What an ``OSError`` says, for a message: its cause (``No space left on device``),
    the file it names, and what to do about a full file system."""
    text = exc.strerror or str(exc)
    if exc.filename is not None:
        text += f" ({exc.filename})"
    if exc.errno in _FULL:
        text += "; free space on that file system or write somewhere else, then save again"
    return text


def _why(exc: OSError | ValueError) -> str:
    """What :func:`read_json`'s error says, as a clause."""
    if isinstance(exc, OSError):
        return f"it cannot be read ({describe_os_error(exc)})"
    return str(exc)


def checkpoint_info(
    path: PathLike, *, storage_options: Mapping[str, Any] | None = None
) -> dict[str, Any] | None:
    """The completeness marker of the checkpoint at ``path`` (size, CRC-32, step, epoch,
    time of creation; for a sharded checkpoint every file's size; ``config``: the run's
    configuration, ``Trainer.run_config``, as a dict), or None if it has none. Keys that
    the marker leaves out (or sets to null) are left out: ``config`` for a checkpoint of
    a run without one, or written before checkpoints carried it. ``path`` may
    be a URL (``s3://bucket/run/epoch=0-step=10.ckpt``), reached with the fsspec
    ``storage_options`` (None: the backend's standard credentials)."""
    store, name = located(path, storage_options=storage_options)
    if store.size(name) is None:  # a sharded checkpoint: its marker inside
        info = read_marker(store.below(name), SHARDED_MARKER)
    else:
        info = read_marker(store, name + MARKER_SUFFIX)
    if info is None:
        return None
    return {k: v for k, v in msgspec.structs.asdict(info).items() if v is not None}


def file_crc32(file: Path) -> int:
    """The CRC-32 of the file at ``file`` (as a completeness marker records it), read in
    4 MiB pieces."""
    return crc32_of(file)


def read_marker(store: Storage, name: str) -> Marker | None:
    """The completeness marker ``name`` of ``store``, None if there is none; raises
    :class:`CheckpointError` naming it and what is wrong with it."""
    marker = store.path(name)
    try:
        return decode_json(store.read_small(name), Marker)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(
            f"cannot read the completeness marker {marker}: {describe_os_error(exc)}"
        ) from exc
    except ValueError as exc:
        raise CheckpointError(
            f"the completeness marker {marker} is damaged: {exc}. Delete it to load the "
            "checkpoint without the integrity check, or load another checkpoint."
        ) from exc
    except Exception as exc:  # a store's failure, which names the URL and the cause
        raise CheckpointError(
            f"cannot read the completeness marker {marker}: {type(exc).__name__}: {exc}"
        ) from exc


# ---------------------------------------------------------------- the header


def check_header(state: Any, source: str) -> dict[str, Any]:
    """The header of the checkpoint dict ``state`` (``source`` names it in messages).
    Raises :class:`CheckpointError` if it has none or is of another format version."""
    header = state.get("loopbus") if isinstance(state, dict) else None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        keys = sorted(map(str, state))[:8] if isinstance(state, dict) else type(state).__name__
        raise CheckpointError(
            f"{source} is not a loopbus checkpoint (it has no 'loopbus' header; top-level "
            f"keys: {keys}). Checkpoints come from Trainer.state_dict(), "
            "Trainer.save_checkpoint() or the Checkpoint plugin; to load bare module "
            "weights use module.load_state_dict(torch.load(path, weights_only=True))."
        )
    version = header.get("format_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{source} has an invalid format_version {version!r}.")
    if version < FORMAT_VERSION:
        raise CheckpointError(
            f"{source} uses checkpoint format {version}, from an earlier loopbus "
            f"({header.get('version')!r}); this loopbus reads format {FORMAT_VERSION} only "
            "(format 2 composes a checkpoint from the trainer's registry of Stateful parts). "
            "Its module weights can still be read with "
            "torch.load(path, weights_only=True)['module']."
        )
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{source} was written by a newer loopbus ({header.get('version')!r}, checkpoint "
            f"format {version}); this loopbus ({__version__}) reads formats up to "
            f"{FORMAT_VERSION}. Upgrade loopbus to load it."
        )
    return header
