"""Checkpoint files: plain values only, written atomically with a completeness marker,
read back with ``torch.load(..., weights_only=True)`` and checked.

Writing (:func:`write_checkpoint`): a temporary file in the target's directory, flush and
fsync, ``os.replace`` onto the target, fsync of the directory, then a completeness marker
``<file>.complete`` (JSON: size, CRC-32, step) written the same way; optionally the
directory's ``last.json`` pointer. A crash at any moment leaves the previous file under
the target name; a reader that finds a marker checks the file against it, so a torn or
modified file is refused with a clear error.

Reading (:func:`load_checkpoint`): ``torch.load(..., weights_only=True)`` only, so a file
holding pickled Python objects is refused and nothing from it runs; then the nesting of
what it holds (at most 100 levels of lists, tuples and dicts, no container that contains
itself: torch's unpickler builds any depth without recursion, but what reads the state
next recurses) and the header (format, version) are checked. A state that nests deeper
is refused when it is saved too.

A sharded checkpoint (``_dcp.py``) is a directory instead of a file: it is written under a
temporary name, its completeness marker (``loopbus.complete``, JSON: the size of every
file in it) goes inside it last, and only then is it renamed to its own name. Pointer,
scan for the newest, removal and the cleaning of temporaries treat both kinds alike.

Markers and pointers are read as untrusted input: at most 1 MiB, nesting measured before
they are decoded, and decoded only into the typed :class:`Marker` and :class:`Pointer`
(keys they do not name are ignored, so files of earlier versions still load); one that is
too large, too deep or of the wrong shape is damaged, like one that is not JSON.

A directory means the checkpoint its ``last.json`` names or, without one or when that one
(or the pointer itself) is missing or damaged, the newest complete one
(:func:`latest_checkpoint`: the marker there, every file of the size it records); the
checkpoints passed over are named, with what is wrong with each, in a ``UserWarning``. A write that fails (a full disk) raises
:class:`CheckpointError` naming the file, the cause and what is on disk since, not the
``RuntimeError`` torch makes of a failed write.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import json
import os
import pickle
import pickletools
import re
import secrets
import shutil
import socket
import stat
import warnings
import zipfile
import zlib
from collections import OrderedDict, deque
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import msgspec
import torch

from .._durable import fsync_dir
from .._exceptions import CheckpointError
from .._untrusted import MAX_STATE_DEPTH, check_json_nesting, check_state_nesting, read_small

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "LAST_POINTER",
    "Marker",
    "Pointer",
    "check_header",
    "checkpoint_info",
    "latest_checkpoint",
    "load_checkpoint",
    "newest",
    "read_json",
    "remove_checkpoint",
    "remove_stale_temporaries",
    "to_plain",
    "write_checkpoint",
]

FORMAT = "loopbus.checkpoint"
#: The checkpoint format this loopbus writes and the newest one it reads.
FORMAT_VERSION = 2
#: The name of the pointer file that names the last checkpoint written into a directory.
LAST_POINTER = "last.json"
MARKER_SUFFIX = ".complete"
#: The completeness marker inside a sharded checkpoint's directory, written last.
SHARDED_MARKER = "loopbus.complete"
_TMP_TAG = ".tmp-"
#: Separates a temporary file's writer (``<pid>-<random>``) from its host's name.
_HOST_SEP = "@"
#: The longest host tag in a temporary file's name.
_HOST_TAG_MAX = 32

PathLike = str | os.PathLike[str]


# ---------------------------------------------------------------- plain values

_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_KEYS = (str, int, float, bool, type(None))


def _fail_plain(where: str, obj: Any) -> CheckpointError:
    text = repr(obj)
    if len(text) > 80:
        text = text[:77] + "..."
    return CheckpointError(
        f"cannot save {where}: it is a value of type {type(obj).__qualname__} ({text}). A "
        "checkpoint holds only tensors and Python primitives (None, bool, int, float, str, "
        "bytes and lists, tuples and dicts of them), so that it loads with "
        "torch.load(..., weights_only=True) and nothing is unpickled. Convert the value "
        "in the component's state_dict() (to a number, a list or a tensor) and back in its "
        "load_state_dict()."
    )


class _Plain:
    """Checks that a state is plain and rebuilds it; with ``copy`` every tensor is copied
    to host memory (storage shared between tensors stays shared)."""

    def __init__(self, copy: bool) -> None:
        self.copy = copy
        self.memo: dict[Any, torch.Tensor] = {}
        self.cuda = False

    def tensor(self, t: torch.Tensor, where: str) -> torch.Tensor:
        cls = type(t)
        if cls is not torch.Tensor and cls is not torch.nn.Parameter:
            raise _fail_plain(where, t)
        if not self.copy:
            return t.detach() if t.requires_grad or cls is not torch.Tensor else t
        key = (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t.dtype,
            t.device,
        )
        copied = self.memo.get(key)
        if copied is None:
            if t.device.type == "cpu":
                copied = t.detach().clone()
            else:
                # One synchronisation for all device tensors, at the end of the walk.
                copied = t.detach().to("cpu", non_blocking=True)
                self.cuda = self.cuda or t.device.type == "cuda"
            self.memo[key] = copied
        return copied

    def walk(self, obj: Any, where: str, depth: int = 1) -> Any:
        cls = type(obj)
        if cls in _LEAVES:
            return obj
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, where)
        if depth > MAX_STATE_DEPTH and cls in (dict, OrderedDict, list, tuple):
            raise CheckpointError(
                f"cannot save {where.split('[', 1)[0]}: it nests lists, tuples and dicts more "
                f"than {MAX_STATE_DEPTH} levels deep (at {where}), and a checkpoint holding "
                "such a state would be refused when it loads. Flatten the component's "
                "state_dict() (join nested keys into one, say) and rebuild it in its "
                "load_state_dict()."
            )
        if cls is dict or cls is OrderedDict:
            out: dict[Any, Any] = {} if cls is dict else OrderedDict()
            for key, value in obj.items():
                if type(key) not in _KEYS:
                    raise CheckpointError(
                        f"cannot save {where}: key {key!r} is a {type(key).__qualname__}; "
                        "state dict keys must be str, int, float, bool or None."
                    )
                out[key] = self.walk(value, f"{where}[{key!r}]", depth + 1)
            metadata = getattr(obj, "_metadata", None)
            if metadata is not None:  # nn.Module.state_dict() versions its entries
                out._metadata = self.walk(metadata, f"{where}._metadata", depth + 1)  # type: ignore[attr-defined]
            return out
        if cls is list:
            return [self.walk(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj)]
        if cls is tuple:
            return tuple(self.walk(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(obj))
        if cls is torch.Size:
            return obj
        raise _fail_plain(where, obj)


def to_plain(state: Any, *, copy: bool = False, where: str = "the state") -> Any:
    """``state`` rebuilt from plain containers; raises :class:`CheckpointError` naming the
    first value that is not a tensor or a Python primitive. With ``copy``, every tensor is
    copied to host memory, so the result stays valid while training goes on."""
    walker = _Plain(copy)
    result = walker.walk(state, where)
    if walker.cuda:
        torch.cuda.synchronize()
    return result


# ---------------------------------------------------------------- writing


def marker_path(path: PathLike) -> Path:
    """The completeness marker of the checkpoint at ``path``: ``<file>.complete`` beside
    a file, ``<directory>/loopbus.complete`` inside a sharded checkpoint's directory."""
    p = Path(path)
    if p.is_dir():
        return p / SHARDED_MARKER
    return p.with_name(p.name + MARKER_SUFFIX)


def _temp_path(target: Path) -> Path:
    """``.<name>.tmp-<pid>-<random>@<host>``: the writer's process id and host name, so
    that :func:`remove_stale_temporaries` judges whether the writer still runs only on
    the host where that process id means something."""
    return target.with_name(
        f".{target.name}{_TMP_TAG}{os.getpid()}-{secrets.token_hex(4)}{_HOST_SEP}{_host_tag()}"
    )


def _host_tag() -> str:
    """This host's name as it goes into a temporary file's name: characters other than
    letters, digits and ``-`` become ``_``, and a long name is cut, with a hash of the
    whole name kept, so that the tag stays short and still tells hosts apart."""
    host = socket.gethostname() or "localhost"
    tag = re.sub(r"[^A-Za-z0-9-]", "_", host)
    if len(tag) > _HOST_TAG_MAX:
        digest = hashlib.sha1(host.encode("utf-8", "surrogateescape")).hexdigest()[:8]
        tag = f"{tag[: _HOST_TAG_MAX - 9]}~{digest}"
    return tag


class _ChecksumWriter:
    """A file wrapper that counts and CRC-32s what ``torch.save`` writes through it, and
    keeps the ``OSError`` of a write that fails: torch turns it into a ``RuntimeError``
    about positions in its archive (``unexpected pos``) that names neither the file nor
    the cause."""

    __slots__ = ("crc", "error", "file", "size")

    def __init__(self, file: Any) -> None:
        self.file = file
        self.crc = 0
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            written: int = self.file.write(data)
        except OSError as exc:
            self.error = exc
            raise
        self.crc = zlib.crc32(data, self.crc)
        self.size += written
        return written

    def flush(self) -> None:
        self.file.flush()


def save_plain(obj: Any, file: Any) -> _ChecksumWriter:
    """``torch.save(obj)`` into ``file`` through a :class:`_ChecksumWriter` (its size and
    CRC-32). A write that fails (a full disk) is raised as its own ``OSError``, not as
    the ``RuntimeError`` torch makes of it."""
    writer = _ChecksumWriter(file)
    try:
        torch.save(obj, writer)  # type: ignore[arg-type]  # a file-like writer
    except Exception:
        if writer.error is not None:
            raise writer.error from None
        raise
    return writer


def find_os_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind ``exc``: ``exc`` itself, one it was raised from or while
    handling (torch's ``RuntimeError`` for a failed write), or one that
    ``torch.distributed.checkpoint`` gathered from a rank (``CheckpointException``)."""
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        error = pending.pop(0)
        if id(error) in seen:
            continue
        seen.add(id(error))
        if isinstance(error, OSError):
            return error
        for failure in getattr(error, "failures", {}).values():  # rank -> (exception, trace)
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                pending.append(inner)
        pending += [e for e in (error.__cause__, error.__context__) if e is not None]
    return None


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


def _pointer_state(directory: Path) -> str:
    """What the ``last.json`` of ``directory`` names now, for a message."""
    pointer = directory / LAST_POINTER
    try:
        name = read_json(pointer, Pointer).checkpoint
    except FileNotFoundError:
        return f"there is no {LAST_POINTER} in {directory}"
    except (OSError, ValueError):
        return f"{pointer} is as it was"
    return f"{pointer} still names {name!r}"


def _write_durably(target: Path, write: Any, before_replace: Any = None) -> Any:
    """Write ``target`` through a temporary file: ``write(file)``, flush, fsync, rename,
    fsync the directory. The temporary file is removed if anything fails."""
    temp = _temp_path(target)
    try:
        with open(temp, "wb") as file:
            result = write(file)
            file.flush()
            os.fsync(file.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(temp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink()
        raise
    fsync_dir(target.parent)
    return result


def _write_json(target: Path, payload: dict[str, Any]) -> None:
    data = json.dumps(payload, indent=1, sort_keys=True).encode()
    _write_durably(target, lambda f: f.write(data))


def write_checkpoint(state: dict[str, Any], path: PathLike, *, update_last: bool = False) -> Path:
    """Write a checkpoint made by :meth:`Trainer.state_dict` to ``path``, atomically.

    The file appears under its name only once complete and on disk (temporary file in the
    same directory, flush, fsync, rename, directory fsync); its completeness marker
    ``<path>.complete`` follows. With ``update_last`` the directory's ``last.json``
    pointer is then moved to it. A crash at any moment leaves the previous checkpoint
    loadable. Returns the path written.

    A write that fails (a full disk, say) raises :class:`CheckpointError` naming the file
    that could not be written, the cause, and what is on disk since: whether the
    checkpoint file, its marker and the pointer were written, and what the pointer names.
    """
    target = Path(os.fspath(path))
    header = check_header(state, "the state passed to write_checkpoint")
    plain = to_plain(state, where=f"checkpoint (for {target.name})")
    if target.is_dir():
        raise CheckpointError(
            f"cannot write a checkpoint to {target}: it is a directory; pass a file path "
            "such as 'checkpoints/run.ckpt'."
        )
    marker = marker_path(target)
    existed = target.exists()
    unmarked: list[bool] = []  # the old file's marker is removed

    def unmark() -> None:
        # A marker must never describe other content than its file: the old one goes
        # right before the new file replaces the old (which stays loadable without it).
        marker.unlink(missing_ok=True)
        unmarked.append(True)

    stage = "file"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        writer: _ChecksumWriter = _write_durably(target, lambda f: save_plain(plain, f), unmark)
        info = {
            "format": FORMAT,
            "format_version": header["format_version"],
            "file": target.name,
            "size": writer.size,
            "crc32": writer.crc,
            "global_step": header.get("global_step"),
            "epoch": header.get("epoch"),
            "created": header.get("created"),
        }
        stage = "marker"
        _write_json(marker, info)
        if update_last:
            stage = "pointer"
            pointer = {k: info[k] for k in ("global_step", "epoch", "created")}
            pointer["checkpoint"] = target.name
            _write_json(target.parent / LAST_POINTER, pointer)
    except OSError as exc:
        raise CheckpointError(
            _write_failed(target, stage, exc, existed, bool(unmarked), update_last)
        ) from exc
    return target


def _write_failed(
    target: Path, stage: str, exc: OSError, existed: bool, unmarked: bool, update_last: bool
) -> str:
    """Why :func:`write_checkpoint` failed at ``stage`` (``"file"``, ``"marker"`` or
    ``"pointer"``), and what is on disk since."""
    cause = describe_os_error(exc)
    marker = marker_path(target)
    pointer = f" {_pointer_state(target.parent)}." if update_last else ""
    if stage == "file":
        if unmarked:  # only the rename failed, after the old marker went
            kept = (
                "the previous file at that path is unchanged, but its completeness marker "
                "was removed (it still loads, checked only structurally)"
            )
        elif existed:
            kept = "the previous checkpoint at that path is unchanged"
        else:
            kept = "nothing was written under that name"
        return (
            f"could not write the checkpoint {target}: {cause}. Nothing was replaced: "
            f"{kept}.{pointer}"
        )
    if stage == "marker":
        replaced = "It replaced the previous checkpoint of that name. " if existed else ""
        moved = f" The pointer was not moved:{pointer}" if update_last else ""
        return (
            f"the checkpoint {target} was written, but its completeness marker {marker} "
            f"could not be: {cause}. {replaced}Without its marker the file loads only by its "
            "path (checked structurally, not against a checksum), and the search for the "
            f"newest complete checkpoint skips it.{moved}"
        )
    return (
        f"the checkpoint {target} and its completeness marker were written, but the pointer "
        f"{target.parent / LAST_POINTER} could not be moved to it: {cause}. The checkpoint is "
        f"complete and loads by its path;{pointer}"
    )


def remove_checkpoint(path: PathLike) -> None:
    """Delete a checkpoint and its completeness marker (the marker first, so that a crash
    in between never leaves a marker without its file): a file, or a sharded checkpoint's
    whole directory. Missing files are ignored.

    A symbolic link is removed as a link: what it points to (a checkpoint of another run,
    say) is never touched. The marker inside a linked directory belongs to that
    checkpoint, which may be the one its own directory's ``last.json`` names."""
    target = Path(os.fspath(path))
    if target.is_symlink() and target.is_dir():
        target.unlink(missing_ok=True)
        return
    marker_path(target).unlink(missing_ok=True)
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target, ignore_errors=True)
    else:
        target.unlink(missing_ok=True)


def remove_stale_temporaries(directory: PathLike) -> list[Path]:
    """Delete temporary files that writers which no longer run left in ``directory``.

    A temporary's name holds its writer's process id and host name
    (``.<name>.tmp-<pid>-<random>@<host>``). It is removed when it was written on this
    host by a process that no longer runs (or by this process). A temporary written on
    another host (a directory shared between machines) is never removed: a process id
    says nothing about another machine's processes; delete such files by hand once no
    run writes there. A name without a host (written by an earlier loopbus) is taken to
    come from this host."""
    removed: list[Path] = []
    d = Path(directory)
    if not d.is_dir():
        return removed
    here = _host_tag()
    for entry in d.iterdir():
        name = entry.name
        if not name.startswith(".") or _TMP_TAG not in name:
            continue
        writer = _temp_writer(name)
        if writer is None:
            continue
        pid, host = writer
        if host is not None and host != here:
            continue  # another machine's writer: its pid means nothing here
        if pid != os.getpid() and _alive(pid):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir() and not entry.is_symlink():  # a sharded checkpoint's
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
    return removed


def _temp_writer(name: str) -> tuple[int, str | None] | None:
    """The writer's process id and host tag from a temporary file's name (host None for
    a name without one), or None if ``name`` is not a checkpoint temporary."""
    tail = name.rsplit(_TMP_TAG, 1)[1]
    host: str | None = None
    if _HOST_SEP in tail:
        tail, host = tail.rsplit(_HOST_SEP, 1)
    pid_text = tail.split("-", 1)[0]
    if not pid_text.isdigit():
        return None
    return int(pid_text), host


def _alive(pid: int) -> bool:
    """Whether a process with this id runs on this host (a permission error means that
    one does, owned by another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


# ---------------------------------------------------------------- reading


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
    data = check_json_nesting(read_small(path))
    try:
        return msgspec.json.decode(data, type=schema)
    except msgspec.ValidationError as exc:
        raise ValueError(f"it is JSON but not of the expected shape ({exc})") from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"it is not valid JSON ({exc})") from None


def _why(exc: OSError | ValueError) -> str:
    """What :func:`read_json`'s error says, as a clause."""
    if isinstance(exc, OSError):
        return f"it cannot be read ({describe_os_error(exc)})"
    return str(exc)


def checkpoint_info(path: PathLike) -> dict[str, Any] | None:
    """The completeness marker of the checkpoint at ``path`` (size, CRC-32, step, epoch,
    time of creation; for a sharded checkpoint every file's size), or None if it has
    none. Keys that the marker leaves out (or sets to null) are left out."""
    info = _read_marker(marker_path(path))
    if info is None:
        return None
    return {k: v for k, v in msgspec.structs.asdict(info).items() if v is not None}


def _read_marker(marker: Path) -> Marker | None:
    """The completeness marker at ``marker``, None if there is none; raises
    :class:`CheckpointError` naming it and what is wrong with it."""
    try:
        return read_json(marker, Marker)
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


def _verify(file: Path) -> None:
    info = _read_marker(marker_path(file))
    if info is None:
        return
    try:
        _check_against_marker(file, info)
    except OSError as exc:
        raise CheckpointError(f"cannot read the checkpoint {file}: {exc}") from exc


def _check_against_marker(file: Path, info: Marker) -> None:
    size = file.stat().st_size
    expected = info.size
    if size != expected:
        raise CheckpointError(
            f"the checkpoint {file} is torn or truncated: its completeness marker records "
            f"{expected} bytes but the file has {size}. It was not written completely (or was "
            "modified after it was written); load another checkpoint, for example the "
            "previous one in the same directory."
        )
    crc = 0
    with open(file, "rb") as handle:
        while chunk := handle.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    if crc != info.crc32:
        raise CheckpointError(
            f"the checkpoint {file} is corrupted: its CRC-32 does not match the one its "
            "completeness marker recorded when it was written. Load another checkpoint, for "
            "example the previous one in the same directory."
        )


def newest(candidates: Iterable[Path]) -> Path | None:
    best: tuple[Any, ...] | None = None
    chosen: Path | None = None
    for path in candidates:
        try:
            info = checkpoint_info(path) or {}
        except CheckpointError:
            info = {}
        step = info.get("global_step")
        created = info.get("created")
        if not isinstance(created, (int, float)):
            try:
                created = path.stat().st_mtime
            except OSError:
                created = 0.0
        key = (step if isinstance(step, int) else -1, created)
        if best is None or key > best:
            best, chosen = key, path
    return chosen


def latest_checkpoint(directory: PathLike) -> Path | None:
    """The last checkpoint written into ``directory``: the one its ``last.json`` pointer
    names or, without a pointer (or when the one it names is missing or damaged), the
    newest complete one: with its completeness marker, and every file of the size the
    marker records. A checkpoint passed over this way is named, with what is wrong with
    it, in a ``UserWarning``. None when the directory holds no complete checkpoint."""
    d = Path(os.fspath(directory))
    found, skipped = _latest(d)
    if skipped:
        warnings.warn(_skipped_message(d, found, skipped), UserWarning, stacklevel=2)
    return found


#: The names a checkpoint file is taken to have, marker or not.
_CHECKPOINT_SUFFIXES = (".ckpt", ".pt", ".pth")


def _latest(d: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The last checkpoint in ``d`` and the checkpoints passed over for it, each with
    what is wrong with it (see :func:`latest_checkpoint`)."""
    pointer = d / LAST_POINTER
    named: Path | None = None
    skipped: list[tuple[Path, str]] = []
    if pointer.exists():
        try:
            named = _follow_pointer(pointer)
        except (OSError, ValueError) as exc:  # damaged: the newest complete one is taken
            skipped.append((pointer, f"this pointer is ignored: {_why(exc)}"))
        else:
            # A file without a marker that the pointer names is taken (checked
            # structurally when it loads); a sharded checkpoint that replaces one of the
            # same name moves it aside for a moment (a directory cannot be replaced
            # atomically).
            why = _incomplete(named, unmarked_file=True)
            if why is None:
                return named, []
            skipped.append((named, f"{LAST_POINTER} names it, but {why}"))
    elif not d.is_dir():
        return None, []
    found, others = _newest_complete(d)
    if found is None and named is not None:
        return named, []  # nothing to fall back to: loading it says what is wrong
    return found, skipped + [(p, why) for p, why in others if p != named]


def _newest_complete(d: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint in ``d`` (files and sharded directories), and the
    incomplete ones, each with what is wrong with it."""
    complete: list[Path] = []
    skipped: list[tuple[Path, str]] = []
    for entry in sorted(d.iterdir()):
        name = entry.name
        if name.startswith(".") or name == LAST_POINTER:
            continue
        if name.endswith(MARKER_SUFFIX):
            file = entry.with_name(name[: -len(MARKER_SUFFIX)])
            if not file.exists() and not file.is_symlink():
                skipped.append((file, f"only its completeness marker {name} is left"))
            continue
        if entry.is_dir():
            if not is_sharded_checkpoint(entry):
                continue
        elif entry.suffix not in _CHECKPOINT_SUFFIXES and not marker_path(entry).exists():
            continue
        why = _incomplete(entry)
        if why is None:
            complete.append(entry)
        else:
            skipped.append((entry, why))
    return newest(complete), skipped


def _incomplete(path: Path, *, unmarked_file: bool = False) -> str | None:
    """What keeps the checkpoint at ``path`` from being complete, or None: it is missing,
    it has no completeness marker (a file without one passes with ``unmarked_file``), or
    a file of it has another size than its marker records. Sizes only: a file's CRC-32
    is checked when it loads."""
    try:
        if path.is_dir():
            return _sharded_incomplete(path)
        if not path.is_file():
            return "it does not exist"
        try:
            info = read_json(marker_path(path), Marker)
        except FileNotFoundError:
            if unmarked_file:
                return None
            return (
                f"it has no completeness marker {marker_path(path).name} (its save did not "
                "finish, or the marker was deleted)"
            )
        except (OSError, ValueError) as exc:
            return f"its completeness marker {marker_path(path).name} is damaged: {_why(exc)}"
        size, expected = path.stat().st_size, info.size
    except OSError as exc:
        return f"it cannot be read ({describe_os_error(exc)})"
    if size != expected:
        return (
            f"it has {size} bytes where its completeness marker records {expected} (it is "
            "truncated or was modified)"
        )
    return None


def _sharded_incomplete(path: Path) -> str | None:
    """:func:`_incomplete` for a sharded checkpoint's directory: the marker is there and
    every file it lists has the size it records."""
    marker = path / SHARDED_MARKER
    try:
        files = read_json(marker, Marker).files
    except FileNotFoundError:
        return (
            f"it has no completeness marker {SHARDED_MARKER} (its save did not finish, or "
            "the marker was deleted)"
        )
    except (OSError, ValueError) as exc:
        return f"its completeness marker {SHARDED_MARKER} is damaged: {_why(exc)}"
    if not files:
        return f"its completeness marker {SHARDED_MARKER} lists no files"
    for name, size in files.items():
        file = path / str(name)
        try:
            actual = file.stat().st_size
        except FileNotFoundError:
            return f"its file {name} is missing"
        except OSError as exc:
            return f"its file {name} cannot be read ({describe_os_error(exc)})"
        if actual != size:
            return (
                f"its file {name} has {actual} bytes where its completeness marker records "
                f"{size} (it is truncated or was modified)"
            )
    return None


def _skipped_message(d: Path, found: Path | None, skipped: list[tuple[Path, str]]) -> str:
    shown = "; ".join(f"{p.name}: {why}" for p, why in skipped[:5])
    if len(skipped) > 5:
        shown += f"; and {len(skipped) - 5} more"
    if found is None:
        then = "no complete checkpoint is left there"
    else:
        then = f"the newest complete checkpoint there, {found.name}, is taken instead"
    return f"skipped checkpoints in {d} that are not complete ({shown}); {then}."


def _follow_pointer(pointer: Path) -> Path:
    """The checkpoint the ``last.json`` at ``pointer`` names. Raises what
    :func:`read_json` raises, and ``ValueError`` for a name that is not a file name in
    the pointer's directory."""
    try:
        name = read_json(pointer, Pointer).checkpoint
    except ValueError as exc:
        raise ValueError(
            f'{exc}; it should be JSON like {{"checkpoint": "epoch=0-step=100.ckpt"}}'
        ) from None
    separators = [s for s in (os.sep, os.altsep) if s]
    if not name or name in (".", "..") or any(s in name for s in separators):
        raise ValueError(f"it names {name!r}, which is not a file name in its directory")
    return pointer.parent / name


def resolve_checkpoint(path: PathLike) -> Path:
    """The checkpoint file ``path`` means: a file, a directory (its last checkpoint) or a
    ``last.json`` pointer."""
    p = Path(os.fspath(path))
    if p.is_dir() and is_sharded_checkpoint(p):
        return p
    if p.is_dir() or (p.name == LAST_POINTER and p.is_file()):
        directory = p if p.is_dir() else p.parent
        found, skipped = _latest(directory)
        if found is None:
            # Files without a marker are named by the advice; the rest is listed here.
            damaged = [
                f"{q.name}: {why}"
                for q, why in skipped
                if q.is_dir()
                or not q.exists()
                or marker_path(q).exists()
                or q == directory / LAST_POINTER
            ]
            listed = f" Skipped as not complete: {'; '.join(damaged[:5])}." if damaged else ""
            raise CheckpointError(
                f"no checkpoint in the directory {directory}: it is a directory without "
                f"checkpoints (it has no {LAST_POINTER} pointer and no complete checkpoint "
                f"file, one with its {MARKER_SUFFIX} marker).{listed} {_unmarked_files(directory)}"
            )
        if skipped:
            warnings.warn(_skipped_message(directory, found, skipped), UserWarning, stacklevel=3)
        p = found
    if not p.exists():
        nearby = ""
        if p.parent.is_dir():
            names = sorted(x.name for x in p.parent.glob("*.ckpt"))[:10]
            if names:
                nearby = f" Checkpoints in {p.parent}: {', '.join(names)}."
        raise CheckpointError(f"no checkpoint at {p}: the file does not exist.{nearby}")
    return p


def is_sharded_checkpoint(path: PathLike) -> bool:
    """Whether ``path`` is a sharded checkpoint's directory: it holds a completeness
    marker, the torch.distributed.checkpoint metadata or loopbus's state file."""
    p = Path(os.fspath(path))
    return p.is_dir() and any(
        (p / name).is_file() for name in (SHARDED_MARKER, ".metadata", SHARDED_STATE)
    )


#: The file of a sharded checkpoint that holds everything but the sharded tensors.
SHARDED_STATE = "loopbus_state.pt"


def _unmarked_files(directory: Path) -> str:
    """The advice for a directory without checkpoints: the checkpoint-like files in it
    that have no marker, if any."""
    try:
        names = sorted(
            x.name
            for x in directory.iterdir()
            if x.suffix in (".ckpt", ".pt", ".pth") and not marker_path(x).exists()
        )
    except OSError:
        names = []
    if not names:
        return "Pass the path of a checkpoint file."
    shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
    return f"It holds {shown} without completeness markers; pass one of them explicitly."


def _short(exc: BaseException) -> str:
    """The first sentence of the telling line of an exception's message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    chosen = next((x for x in lines if "GLOBAL" in x or "Unsupported" in x), None)
    if chosen is None:
        chosen = lines[0] if lines else type(exc).__name__
    end = chosen.find(". ")
    if end > 0:
        chosen = chosen[:end]
    return chosen.rstrip(".")[:300]


# What a file that cannot be a checkpoint is: first the two torch.save containers, then
# a few formats that are often mistaken for one.

#: A zip archive (the torch.save format since PyTorch 1.6) starts with a local file header.
_ZIP_HEAD = b"PK\x03\x04"
#: An empty or a spanned zip archive starts with one of these instead.
_OTHER_ZIP_HEADS = (b"PK\x05\x06", b"PK\x07\x08")
#: A legacy torch.save file (``_use_new_zipfile_serialization=False``) starts with this
#: number (``torch.serialization.MAGIC_NUMBER``) pickled on its own.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_HEADS = tuple(
    {pickle.dumps(_LEGACY_MAGIC, protocol=p) for p in range(pickle.HIGHEST_PROTOCOL + 1)}
)
#: The pickles at the start of a legacy file: magic number, protocol version, system
#: info, the object, the storage keys (the storages' bytes follow).
_LEGACY_PICKLES = ("magic number", "protocol version", "system info", "object", "storage keys")
_FOREIGN_HEADS = (
    (b"\x1f\x8b", "gzip-compressed data"),
    (b"\xfd7zXZ\x00", "xz-compressed data"),
    (b"\x28\xb5\x2f\xfd", "zstd-compressed data"),
    (b"\x93NUMPY", "a NumPy .npy array"),
    (b"\x89HDF\r\n\x1a\n", "an HDF5 file"),
    (b"ustar", "a tar archive"),  # at offset 257
)
#: Torch's weights-only refusals that mean "this pickle builds objects it does not allow".
_OBJECT_REFUSALS = (
    "GLOBAL",
    "unrecognized function",
    "Can only create new object",
    "Can only build",
    "must be imported",
)
#: Words in torch.load errors that come from the arguments or the machine, not the file.
_NOT_THE_FILE = ("deserialize", "map_location", "device", "memory")
_HEAD_SIZE = 512
_MAX_LINE = 1 << 20
_STRING_OPS = frozenset(
    {
        "SHORT_BINUNICODE",
        "BINUNICODE",
        "BINUNICODE8",
        "UNICODE",
        "SHORT_BINSTRING",
        "BINSTRING",
        "STRING",
    }
)
_AGAIN = "Load another checkpoint, for example the previous one in the same directory."


class _Bounded:
    """A binary file seen by a pickle parser: no read goes past the end of the file, so a
    corrupt length field cannot make it allocate more than the file holds."""

    def __init__(self, file: Any, size: int) -> None:
        self.file = file
        self.size = size

    def read(self, n: int = -1) -> bytes:
        left = max(self.size - self.file.tell(), 0)
        data: bytes = self.file.read(left if n < 0 or n > left else n)
        return data

    def readline(self) -> bytes:
        line: bytes = self.file.readline(_MAX_LINE)
        return line

    def tell(self) -> int:
        pos: int = self.file.tell()
        return pos


def _scan_pickle(stream: Any) -> list[str] | None:
    """Parse one pickle from ``stream`` without running it (opcodes only, nothing is
    built or imported). The globals it names, or None if it is not a complete pickle."""
    found: list[str] = []
    memo: dict[int, str | None] = {}
    recent: deque[str | None] = deque([None, None], maxlen=2)
    try:
        for opcode, arg, _pos in pickletools.genops(stream):
            name = opcode.name
            if name in _STRING_OPS:
                recent.append(arg if isinstance(arg, str) else None)
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                recent.append(memo.get(arg) if isinstance(arg, int) else None)
            elif name == "MEMOIZE":
                memo[len(memo)] = recent[-1]
            elif name in ("PUT", "BINPUT", "LONG_BINPUT") and isinstance(arg, int):
                memo[arg] = recent[-1]
            elif name in ("GLOBAL", "INST"):
                found.append(str(arg).replace(" ", ".", 1))
                recent.append(None)
            elif name == "STACK_GLOBAL":
                module, qualname = recent
                found.append(f"{module or '?'}.{qualname or '?'}")
                recent.append(None)
            else:
                recent.append(None)
    except Exception:  # any malformed stream: truncated, garbage, bad argument
        return None
    return found


def _describe(head: bytes, size: int) -> str:
    """What a file that is not a torch file looks like, from its first bytes."""
    for magic, what in _FOREIGN_HEADS:
        at = 257 if magic == b"ustar" else 0
        if head[at : at + len(magic)] == magic:
            return f"it is {what}"
    if head[:3] == b"BZh" and head[3:4].isdigit() and head[3:4] != b"0":
        return "it is bzip2-compressed data"
    if len(head) > 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= size - 8:
        return "it is a safetensors file; read it with safetensors.torch.load_file()"
    for cut in range(4):  # the head may end inside a multi-byte character
        try:
            text = head[: len(head) - cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        if text and all(c.isprintable() or c in "\t\n\r\f\v" for c in text):
            first = text.strip().splitlines()[0][:40] if text.strip() else ""
            return f"it looks like a text file, starting with {first!r}"
        break
    return f"it starts with the bytes {head[:16]!r}"


_WRITTEN_BY = (
    "loopbus checkpoints are written by Trainer.save_checkpoint(), the Checkpoint plugin "
    "or write_checkpoint()."
)


def _not_torch(file: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"cannot load {file}: it is not a torch checkpoint (not a zip archive, the torch.save "
        f"format, and not a legacy torch.save file either; {what}). {_WRITTEN_BY}"
    )


def _foreign_zip(file: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"cannot load {file}: it is not a torch checkpoint: it is a zip archive but not a "
        f"torch.save file ({what}). {_WRITTEN_BY}"
    )


def _bare_pickle(file: Path, handle: Any, size: int) -> CheckpointError | None:
    """The error for a bare pickle (pickle.dump, not torch.save), or None if the file is
    not one. The pickle is parsed, never run."""
    handle.seek(0)
    found = _scan_pickle(_Bounded(handle, size))
    if found is None:
        return None
    if found:
        names = ", ".join(dict.fromkeys(found))
        return CheckpointError(
            f"refusing to load {file}: it is not a torch checkpoint but a bare pickle "
            "(written by pickle.dump, not torch.save) that holds pickled Python objects "
            f"({names}). Nothing from the file was run: loopbus never unpickles such a "
            "file. If you trust its source, read it yourself."
        )
    return CheckpointError(
        f"cannot load {file}: it is not a torch checkpoint but a bare pickle (written by "
        "pickle.dump, not torch.save). loopbus never unpickles such a file; if you trust "
        "its source, read it yourself."
    )


def _torn(file: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"cannot read the checkpoint {file}: it is torn or truncated (an interrupted write or "
        f"copy) or otherwise corrupt: {what}. {_AGAIN}"
    )


def _sniff(file: Path) -> str:
    """``"zip"`` or ``"legacy"``: the torch.save container ``file`` starts with. Raises
    :class:`CheckpointError` for anything else, before torch reads a byte of it."""
    try:
        st = file.stat()
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"cannot load {file}: it is not a regular file.")
        with open(file, "rb") as handle:
            head = handle.read(_HEAD_SIZE)
            if not head:
                raise CheckpointError(
                    f"cannot load {file}: it is empty (0 bytes), so it is not a checkpoint; "
                    f"an interrupted copy or a write that never started leaves such a file. "
                    f"{_AGAIN}"
                )
            if head.startswith(_ZIP_HEAD):
                return "zip"
            if head.startswith(_OTHER_ZIP_HEADS):
                raise _zip_problem(file) or _foreign_zip(file, "it has no members")
            if head.startswith(_LEGACY_HEADS):
                return "legacy"
            if len(head) >= 4 and any(h.startswith(head) for h in _LEGACY_HEADS):
                raise _torn(
                    file,
                    f"it has only {len(head)} bytes, the start of a legacy torch.save file",
                )
            if head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
                error = _bare_pickle(file, handle, st.st_size)
                if error is not None:
                    raise error
    except OSError as exc:
        raise CheckpointError(f"cannot read the checkpoint {file}: {exc}") from exc
    raise _not_torch(file, _describe(head, st.st_size))


def _zip_problem(file: Path) -> CheckpointError | None:
    """What is wrong with the zip archive ``file`` as a torch.save file: damaged, another
    kind of archive, TorchScript, or a corrupt member. None if nothing is found."""
    try:
        archive = zipfile.ZipFile(file)
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError):
        return _torn(
            file,
            "it starts as a zip archive (the torch.save format) but its end, the zip "
            "central directory, is missing or damaged",
        )
    with archive:
        names = archive.namelist()
        if not names:
            return _foreign_zip(file, "it is empty")
        prefix = names[0].split("/", 1)[0]
        if "/" not in names[0]:
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            return _foreign_zip(
                file, f"it holds {shown}, where a torch.save archive holds <name>/data.pkl"
            )
        if f"{prefix}/constants.pkl" in names:
            return CheckpointError(
                f"cannot load {file}: it is a TorchScript archive (torch.jit.save), not a "
                "torch.save checkpoint; load it with torch.jit.load()."
            )
        data = f"{prefix}/data.pkl"
        if data not in names:
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            return _foreign_zip(file, f"it holds {shown} but no {data}")
        try:
            pickled = archive.read(data)
        except Exception as exc:  # a bad CRC, a damaged header, a decompression error
            return _torn(file, f"its member {data} cannot be read ({exc})")
        if _scan_pickle(_Bounded(io.BytesIO(pickled), len(pickled))) is None:
            return _torn(file, f"its member {data} is not a complete pickle")
        try:
            bad = archive.testzip()
        except Exception as exc:
            return _torn(file, f"a member of its zip archive cannot be read ({exc})")
        if bad is not None:
            return _torn(file, f"its member {bad} fails its CRC-32 check")
    return None


def _legacy_problem(file: Path) -> CheckpointError | None:
    """The error for a legacy torch.save file whose pickles are incomplete, or None."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            stream = _Bounded(handle, size)
            for part in _LEGACY_PICKLES:
                if _scan_pickle(stream) is None:
                    return _torn(
                        file,
                        f"it is a legacy torch.save file whose {part} pickle is incomplete "
                        "or damaged",
                    )
    except OSError as exc:
        return CheckpointError(f"cannot read the checkpoint {file}: {exc}")
    return None


def _refusal(exc: BaseException) -> str:
    """Torch's reason for a weights-only refusal, without its advice."""
    text = " ".join(str(exc).split())
    key = "WeightsUnpickler error:"
    at = text.find(key)
    if at >= 0:
        text = text[at + len(key) :]
    for advice in (" Please use", " Check the documentation"):
        cut = text.find(advice)
        if cut > 0:
            text = text[:cut]
    return text.strip().rstrip(".") or type(exc).__name__


def _load_failed(file: Path, container: str, exc: Exception) -> NoReturn:
    """Raise why torch.load failed on a file that starts as a torch.save container: the
    file is inspected (parsed, never unpickled) to tell damage from refused objects."""
    problem = _zip_problem(file) if container == "zip" else _legacy_problem(file)
    if problem is not None:
        raise problem from exc
    if isinstance(exc, pickle.UnpicklingError):
        reason = _refusal(exc)
        if any(key in reason for key in _OBJECT_REFUSALS):
            raise CheckpointError(
                f"refusing to load {file}: it is a torch file but holds pickled Python "
                f"objects that weights_only loading refuses ({reason}). Nothing from the "
                "file was run. loopbus checkpoints hold only tensors and Python primitives; "
                "if this is another kind of file and you trust its source, read it yourself "
                "with torch.load(..., weights_only=False)."
            ) from None
        # Torch's own writer emits nothing else that a weights-only load refuses.
        raise _torn(file, f"torch cannot read its pickled data ({reason})") from exc
    if container == "legacy" and (isinstance(exc, EOFError) or "EOF" in str(exc)):
        raise _torn(
            file, f"it is a legacy torch.save file whose tensor data ends early ({_short(exc)})"
        ) from exc
    if isinstance(exc, (OSError, MemoryError)) or any(k in str(exc) for k in _NOT_THE_FILE):
        raise CheckpointError(
            f"cannot load the checkpoint {file}: torch.load failed ({type(exc).__name__}: "
            f"{_short(exc)})."
        ) from exc
    # A damaged zip directory or record that Python's zipfile module tolerates.
    raise _torn(file, f"torch cannot read it ({type(exc).__name__}: {_short(exc)})") from exc


def load_checkpoint(
    path: PathLike, *, map_location: Any = "cpu", verify: bool = True
) -> dict[str, Any]:
    """Read a checkpoint written by loopbus, safely.

    ``path`` is a checkpoint file, a sharded checkpoint's directory (consolidated here,
    in this process, into the same full dict a file holds), a directory (its last
    checkpoint) or a ``last.json`` pointer. The file is read with ``torch.load(..., weights_only=True)``: a file holding
    pickled Python objects is refused and nothing from it runs. With ``verify`` the file
    is first checked against its completeness marker (size and CRC-32) when it has one.
    Raises :class:`CheckpointError` naming the file and what is wrong with it for a
    missing, empty, foreign (not a torch.save file), truncated or corrupt, refused
    (pickled objects) or newer checkpoint; a file that is not a torch.save container is
    never handed to an unpickler.
    """
    file = resolve_checkpoint(path)
    if file.is_dir():
        from ._sharded import consolidate  # it builds on this module

        return consolidate(file)
    if verify:
        _verify(file)
    container = _sniff(file)
    try:
        state = torch.load(file, map_location=map_location, weights_only=True)
    except Exception as exc:
        _load_failed(file, container, exc)
    check_loaded(state, file)
    check_header(state, str(file))
    return state  # type: ignore[no-any-return]


def check_loaded(state: Any, file: Path) -> None:
    """Raise :class:`CheckpointError` if what ``torch.load`` built from ``file`` nests
    deeper than a checkpoint may (or holds a container that contains itself): torch's
    unpickler builds any depth without recursion, but what reads the state next
    recurses, and a process that raised its recursion limit would overflow its stack."""
    try:
        check_state_nesting(state)
    except ValueError as exc:
        raise CheckpointError(
            f"refusing to load {file}: {exc}. loopbus never writes such a checkpoint (a state "
            f"that nests more than {MAX_STATE_DEPTH} levels is refused when it is saved): the "
            "file was modified or comes from elsewhere."
        ) from None


def check_header(state: Any, source: str) -> dict[str, Any]:
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
        import loopbus

        raise CheckpointError(
            f"{source} was written by a newer loopbus ({header.get('version')!r}, checkpoint "
            f"format {version}); this loopbus ({loopbus.__version__}) reads formats up to "
            f"{FORMAT_VERSION}. Upgrade loopbus to load it."
        )
    return header
