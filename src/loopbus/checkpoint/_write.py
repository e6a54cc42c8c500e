"""Writing checkpoint files: a state checked to hold only plain values, written
atomically, then its completeness marker and, if asked, the directory's pointer.

:func:`write_checkpoint` writes a temporary file in the target's directory, flushes and
fsyncs it, ``os.replace``s it onto the target and fsyncs the directory, then writes the
completeness marker ``<file>.complete`` (JSON: size, CRC-32, step) the same way, and
optionally the directory's ``last.json`` pointer. A crash at any moment leaves the
previous file under the target name; a reader that finds a marker checks the file
against it, so a torn or modified file is refused with a clear error.

A checkpoint holds only tensors and Python primitives, so that it loads with
``torch.load(..., weights_only=True)``; a state that holds anything else, or nests
deeper than a checkpoint may (it would be refused when it loads), is refused here. A
write that fails (a full disk) raises :class:`CheckpointError` naming the file, the
cause and what is on disk since, not the ``RuntimeError`` torch makes of a failed write.
"""

from __future__ import annotations

import json
import zlib
from collections import OrderedDict
from pathlib import Path
from typing import Any, TypeVar

import torch

from .._exceptions import CheckpointError
from .._untrusted import MAX_STATE_DEPTH
from ..storage import RemotePath, located, store_for
from ._format import (
    FORMAT,
    LAST_POINTER,
    MARKER_SUFFIX,
    PathLike,
    Pointer,
    check_header,
    describe_os_error,
    marker_config,
    marker_path,
    pointer_to,
    read_remote_json,
)

__all__ = [
    "find_os_error",
    "save_plain",
    "to_plain",
    "write_checkpoint",
]

_T = TypeVar("_T")


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


# ---------------------------------------------------------------- atomic writes


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


def _pointer_state(directory: Path | RemotePath) -> str:
    """What the ``last.json`` of ``directory`` names now, for a message."""
    pointer = directory / LAST_POINTER
    try:
        # One try: this only words a failure, perhaps of this very store.
        name = read_remote_json(store_for(directory, retries=0), LAST_POINTER, Pointer).checkpoint
    except FileNotFoundError:
        return f"there is no {LAST_POINTER} in {directory}"
    except Exception:  # unreadable, damaged, or the store unreachable
        return f"{pointer} is as it was"
    return f"{pointer} still names {name!r}"


def _json_bytes(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, indent=1, sort_keys=True).encode()


def write_checkpoint(
    state: dict[str, Any], path: PathLike, *, update_last: bool = False, retries: int = 0
) -> Path:
    """Write a checkpoint made by :meth:`Trainer.state_dict` to ``path``, atomically.

    The file appears under its name only once complete and on disk (temporary file in the
    same directory, flush, fsync, rename, directory fsync); its completeness marker
    ``<path>.complete`` follows. With ``update_last`` the directory's ``last.json``
    pointer is then moved to it. A crash at any moment leaves the previous checkpoint
    loadable. Returns the path written.

    A write that fails (a full disk) raises :class:`CheckpointError` naming the file
    that could not be written, the cause, and what is on disk since: whether the
    checkpoint file, its marker and the pointer were written, and what the pointer names.

    ``path`` may be a URL (``s3://bucket/run/x.ckpt``; a :class:`~loopbus.RemotePath`
    carries storage options): an object store has no atomic rename, but an object appears
    whole or not at all; so the file is serialised to a local temporary file and uploaded
    under its final name, then its marker (which a reader needs to take it as complete)
    and, with ``update_last``, the pointer are written. Each upload is held to the URL's
    :class:`~loopbus.StoreDeadlines` (one abandoned at ``call_s``) and tried again up to
    ``retries`` times with exponential backoff. Returns the ``RemotePath`` written.
    Either way, an earlier checkpoint's marker of that name goes right before the new
    file appears: a marker never describes other content than its file."""
    store, name = located(path, retries=retries)
    target = store.path(name)
    header = check_header(state, "the state passed to write_checkpoint")
    plain = to_plain(state, where=f"checkpoint (for {name})")
    marker = name + MARKER_SUFFIX
    whole = store.whole_without_marker()  # a failed write leaves the old file as it was
    existed = whole and store.size(name) is not None
    unmarked: list[bool] = []  # the old file's marker is removed

    def unmark() -> None:
        store.remove(marker)
        unmarked.append(True)

    stage = "file"
    try:
        writer = store.publish(name, lambda f: save_plain(plain, f), before=unmark)
        info = _file_marker(target, header, writer)
        stage = "marker"
        store.write(marker, _json_bytes(info))
        if update_last:
            stage = "pointer"
            store.write(LAST_POINTER, _json_bytes(pointer_to(target, info)))
    except IsADirectoryError as exc:
        raise CheckpointError(
            f"cannot write a checkpoint to {target}: it is a directory; pass a file path "
            "such as 'checkpoints/run.ckpt'."
        ) from exc
    except (OSError, CheckpointError) as exc:
        failed = _write_failed if whole else _upload_failed
        raise CheckpointError(
            failed(target, stage, _cause(exc), existed, bool(unmarked), update_last)
        ) from exc
    return target  # type: ignore[return-value]  # a RemotePath for a URL


def _file_marker(
    target: Path | RemotePath, header: dict[str, Any], writer: _ChecksumWriter
) -> dict[str, Any]:
    """What the completeness marker of the checkpoint file just written to ``target``
    records: its size and CRC-32 as ``writer`` counted them, and the step, epoch and time
    of creation of its ``header``."""
    return {
        "format": FORMAT,
        "format_version": header["format_version"],
        "file": target.name,
        "size": writer.size,
        "crc32": writer.crc,
        "global_step": header.get("global_step"),
        "epoch": header.get("epoch"),
        "created": header.get("created"),
        **marker_config(header),
    }


def _cause(exc: BaseException) -> str:
    """What a failed write's error says: a store's own message (it names the URL, the
    cause and the tries), a local file's error, or the error as it is."""
    if isinstance(exc, CheckpointError):
        return str(exc).rstrip(".")
    return describe_os_error(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"


def _write_failed(
    target: Any, stage: str, cause: str, existed: bool, unmarked: bool, update_last: bool
) -> str:
    """Why :func:`write_checkpoint` failed at ``stage`` (``"file"``, ``"marker"`` or
    ``"pointer"``) in a store that renames entries into place, and what is on disk
    since."""
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


def _upload_failed(
    target: Any, stage: str, cause: str, existed: bool, unmarked: bool, update_last: bool
) -> str:
    """Why :func:`write_checkpoint` failed at ``stage`` in an object store (written in
    place, complete only with its marker), and what is in the store since."""
    pointer = f" {LAST_POINTER} was not moved." if update_last else ""
    if stage == "file":
        return (
            f"could not upload the checkpoint {target}: {cause}. It is not complete (no "
            f"marker).{pointer}"
        )
    if stage == "marker":
        return (
            f"the checkpoint {target} was uploaded, but its completeness marker could not be "
            f"written: {cause}. Without it no reader takes the checkpoint as complete.{pointer}"
        )
    return (
        f"the checkpoint {target} and its completeness marker were uploaded, but "
        f"{target.parent / LAST_POINTER} could not be moved to it: {cause}. The checkpoint "
        "is complete and loads by its URL."
    )
