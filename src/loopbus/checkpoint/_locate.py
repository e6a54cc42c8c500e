"""Finding checkpoints: the last one written into a directory, the checkpoint a path
means, and the one ``ckpt_path="last"`` or ``"best"`` means among the trainer's plugins.

A directory means the checkpoint its ``last.json`` names or, without one or when that one
(or the pointer itself) is missing or damaged, the newest complete one
(:func:`latest_checkpoint`: the marker there, every file of the size it records, and
the CRC-32 of the file taken as its marker records it); the
checkpoints passed over are named, with what is wrong with each, in a ``UserWarning``.
Checkpoint files and sharded checkpoints' directories are treated alike.
"""

from __future__ import annotations

import os
import posixpath
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from .._exceptions import CheckpointError, MisconfigurationError
from .._validate import check_local_path
from ..storage import RemotePath, Store, is_url, remote_path, require_backend
from ._format import (
    LAST_POINTER,
    MARKER_SUFFIX,
    SHARDED_MARKER,
    Marker,
    PathLike,
    Pointer,
    _why,
    checkpoint_info,
    describe_os_error,
    file_crc32,
    is_sharded_checkpoint,
    marker_path,
    read_json,
    read_remote_json,
)

_P = TypeVar("_P", Path, RemotePath, Path | RemotePath)

__all__ = [
    "latest_checkpoint",
    "newest",
    "resolve_best",
    "resolve_checkpoint",
    "resolve_last",
    "resolve_resume_path",
    "resolve_weights_path",
]


# ---------------------------------------------------------------- in a directory


def newest(candidates: Iterable[_P]) -> _P | None:
    """The newest of ``candidates``: the highest step its completeness marker records,
    then the latest time of creation (without a marker, the time it was last modified).
    None if there are none."""
    best: tuple[Any, ...] | None = None
    chosen: _P | None = None
    for path in candidates:
        try:
            info = checkpoint_info(path) or {}
        except CheckpointError:
            info = {}
        step = info.get("global_step")
        created = info.get("created")
        if not isinstance(created, (int, float)):
            try:  # a RemotePath's time is its marker's
                created = 0.0 if isinstance(path, RemotePath) else path.stat().st_mtime
            except OSError:
                created = 0.0
        key = (step if isinstance(step, int) else -1, created)
        if best is None or key > best:
            best, chosen = key, path
    return chosen


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
    if is_url(directory):
        remote = remote_path(directory)
        found_remote, skipped_remote = _latest_remote(remote)
        if skipped_remote:
            message = _skipped_message(remote, found_remote, skipped_remote)
            warnings.warn(message, UserWarning, stacklevel=2)
        return found_remote  # type: ignore[return-value]
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
            why = _incomplete(named, unmarked_file=True) or _corrupted(named)
            if why is None:
                return named, []
            skipped.append((named, f"{LAST_POINTER} names it, but {why}"))
    elif not d.is_dir():
        return None, []
    complete, others = _complete(d)
    skipped += [(p, why) for p, why in others if p != named]
    candidates = [p for p in complete if p != named]
    while (found := newest(candidates)) is not None:
        why = _corrupted(found)
        if why is None:
            return found, skipped
        skipped.append((found, why))
        candidates.remove(found)
    if named is not None:
        return named, []  # nothing to fall back to: loading it says what is wrong
    return None, skipped


def _complete(d: Path) -> tuple[list[Path], list[tuple[Path, str]]]:
    """The complete checkpoints in ``d`` (files and sharded directories, each of the
    sizes its marker records), and the incomplete ones, each with what is wrong with
    it."""
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
    return complete, skipped


def _corrupted(path: Path) -> str | None:
    """What is wrong with the contents of the checkpoint file at ``path`` (of the size
    its marker records), or None: its CRC-32 against the one its marker records. Only
    the checkpoint about to be taken is read this way; a file without a marker, and a
    sharded checkpoint, pass (their structure is checked when they load)."""
    if path.is_dir():
        return None
    try:
        info = read_json(marker_path(path), Marker)
        if info.crc32 is None or file_crc32(path) == info.crc32:
            return None
    except (OSError, ValueError):
        return None  # reported as what it is when the file loads
    return (
        f"its CRC-32 does not match the one its completeness marker {marker_path(path).name} "
        "records (it is corrupted)"
    )


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


def _skipped_message(d: Any, found: Any, skipped: list[tuple[Any, str]]) -> str:
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
    if is_url(path):
        return resolve_remote(remote_path(path))  # type: ignore[return-value]
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


# ---------------------------------------------------------------- named by ckpt_path


def resolve_last(plugins: Iterable[Any], *, warn: bool = True) -> Path | RemotePath | None:
    """The checkpoint ``ckpt_path="last"`` means: the newest of those the plugins report,
    each looked up now through its method ``latest_checkpoint()`` (``Checkpoint``'s) or,
    without one, its ``last_checkpoint_path`` (a property; a plugin's method of that name
    is called); None (with a warning unless ``warn`` is false) if none has written one."""
    providers = [p for p in plugins if hasattr(p, "last_checkpoint_path")]
    if not providers:
        raise MisconfigurationError(
            "ckpt_path='last' needs a plugin that knows where checkpoints are written, such "
            "as loopbus.plugins.Checkpoint(dirpath), among the trainer's plugins; add one or "
            "pass the path of a checkpoint (or of its directory)."
        )
    found: list[Path | RemotePath] = []
    for plugin in providers:
        look_up = getattr(plugin, "latest_checkpoint", None)
        path = look_up() if callable(look_up) else plugin.last_checkpoint_path
        if not isinstance(path, (str, os.PathLike)) and callable(path):
            path = path()
        if path is not None:
            found.append(path if isinstance(path, RemotePath) else Path(os.fspath(path)))
    if not found:
        if not warn:
            return None
        where = ", ".join(str(getattr(p, "dirpath", None) or type(p).__name__) for p in providers)
        warnings.warn(
            f"ckpt_path='last' but no checkpoint has been written yet (looked in {where}); "
            "training starts from the beginning.",
            UserWarning,
            stacklevel=4,
        )
        return None
    return newest(found) if len(found) > 1 else found[0]


def resolve_best(plugins: Iterable[Any]) -> Path | RemotePath:
    """The checkpoint ``ckpt_path="best"`` means: the ``best_checkpoint_path`` of the
    plugin that saves checkpoints on a monitored value (``Checkpoint(dirpath,
    monitor=...)``; of a plugin of another kind, its ``best_model_path``, Lightning's
    name). Raises :class:`MisconfigurationError` when there is no such plugin, when
    several could answer, or when it has saved no best checkpoint yet."""
    savers = [p for p in plugins if _best_attribute(p) is not None and hasattr(p, "monitor")]
    monitored = [p for p in savers if p.monitor is not None]
    if not monitored:
        extra = (
            f" (the trainer's {', '.join(repr(p) for p in savers)} monitor nothing, so "
            "they rank no checkpoint as best)"
            if savers
            else ""
        )
        raise MisconfigurationError(
            "ckpt_path='best' needs a Checkpoint plugin that monitors a record, such as "
            "loopbus.plugins.Checkpoint(dirpath, monitor='val/loss'), among the trainer's "
            f"plugins{extra}; add one and fit first, or pass ckpt_path='last' or the path "
            "of a checkpoint."
        )
    best = [(p, getattr(p, str(_best_attribute(p)))) for p in monitored]
    found = [(p, path) for p, path in best if path is not None]
    if not found:
        names = ", ".join(f"{p!r} (monitor {p.monitor!r})" for p in monitored)
        raise MisconfigurationError(
            f"ckpt_path='best' but {names} has saved no best checkpoint yet: it ranks the "
            "checkpoints that fit saves on this trainer after a validation that put the "
            "monitored record (a new Trainer knows nothing of an earlier one's best). Fit "
            "with validation data first, or pass the path of a checkpoint."
        )
    if len(found) > 1:
        listing = "; ".join(f"{p!r} (monitor {p.monitor!r}): {path}" for p, path in found)
        raise MisconfigurationError(
            f"ckpt_path='best' is ambiguous: several Checkpoint plugins have a best "
            f"checkpoint ({listing}). Pass the one you mean, as "
            "ckpt_path=plugin.best_checkpoint_path."
        )
    best_path = found[0][1]
    return best_path if isinstance(best_path, RemotePath) else Path(os.fspath(best_path))


def _best_attribute(plugin: Any) -> str | None:
    """The name under which ``plugin`` says its best checkpoint: ``best_checkpoint_path``,
    or Lightning's ``best_model_path`` for a plugin that has only that; None for one
    that has neither."""
    for name in ("best_checkpoint_path", "best_model_path"):
        if hasattr(plugin, name):
            return name
    return None


def resolve_weights_path(
    ckpt_path: str | os.PathLike[str], plugins: Iterable[Any], strategy: Any
) -> str | os.PathLike[str]:
    """The checkpoint ``ckpt_path`` names for loading weights: ``"best"`` (the best of
    the plugin that monitors a record), ``"last"`` (the newest; an error if none was
    written) or a path as it is. The names are resolved once, on rank 0, and broadcast
    (``strategy.broadcast_object``), so every rank raises the same error or loads the
    same file."""
    _check_ckpt_path(ckpt_path)
    if ckpt_path not in ("best", "last"):
        return ckpt_path
    found: Path | RemotePath | None = None
    problem: str | None = None
    if strategy.is_global_zero:
        try:
            if ckpt_path == "best":
                found = resolve_best(plugins)
            else:
                found = resolve_last(plugins, warn=False)
                if found is None:
                    problem = (
                        "ckpt_path='last' but no checkpoint has been written yet, so "
                        "there are no weights to load; fit first, or pass the path "
                        "of a checkpoint."
                    )
        except MisconfigurationError as exc:
            problem = str(exc)
    found, problem = strategy.broadcast_object((found, problem))
    if problem is not None:
        raise MisconfigurationError(problem)
    assert found is not None
    return found


def resolve_resume_path(
    ckpt_path: str | os.PathLike[str], plugins: Iterable[Any], strategy: Any
) -> str | os.PathLike[str] | None:
    """The checkpoint ``fit(ckpt_path=...)`` resumes from: ``"last"`` is the newest of
    the plugins that write them (None, with a warning, when there is none yet), resolved
    once on rank 0 and broadcast so that every rank loads the same file; anything else
    as it is."""
    _check_ckpt_path(ckpt_path)
    if ckpt_path != "last":
        return ckpt_path
    found = resolve_last(plugins) if strategy.is_global_zero else None
    return strategy.broadcast_object(found)  # type: ignore[no-any-return]


def _check_ckpt_path(ckpt_path: str | os.PathLike[str]) -> None:
    """Before anything runs: a URL's scheme must have its package installed."""
    if is_url(ckpt_path):
        require_backend(ckpt_path, owner=f"ckpt_path={str(ckpt_path)!r}")
    else:
        check_local_path("ckpt_path", ckpt_path)


# ---------------------------------------------------------------- remote


def _remote_incomplete(
    store: Store, objects: dict[str, int], name: str, prefixes: frozenset[str] = frozenset()
) -> str | None:
    """What keeps the remote checkpoint ``name`` from being complete, or None: its object
    or its marker is missing, or the object has another size than the marker records. A
    sharded checkpoint (the prefix ``name``): see :func:`_remote_sharded_incomplete`."""
    if name in prefixes and name not in objects:
        return _remote_sharded_incomplete(store.below(name))
    marker = name + MARKER_SUFFIX
    if name not in objects:
        return "it does not exist"
    if marker not in objects:
        return f"it has no completeness marker {marker} (its upload did not finish, or the marker was deleted)"
    info = _remote_marker(store, marker)
    if isinstance(info, str):
        return info
    expected = info.size
    if objects[name] != expected:
        return (
            f"it has {objects[name]} bytes where its completeness marker records {expected} "
            "(it is truncated or was modified)"
        )
    return None


def _remote_marker(store: Store, marker: str) -> Marker | str:
    """The remote completeness marker ``marker``, or why it cannot be had."""
    try:
        return read_remote_json(store, marker, Marker)
    except FileNotFoundError:
        return f"it has no completeness marker {marker} (it was deleted meanwhile)"
    except ValueError as exc:
        return f"its completeness marker {marker} is damaged: {exc}"
    except Exception as exc:
        return f"its completeness marker {marker} cannot be read ({type(exc).__name__}: {exc})"


def _remote_sharded_incomplete(inside: Store) -> str | None:
    """What keeps the sharded checkpoint whose prefix is ``inside`` from being complete,
    or None: its marker (written last, once every rank's shards are) is missing or
    damaged, or an object it lists is missing or has another size."""
    objects = inside.listing()
    if SHARDED_MARKER not in objects:
        return (
            f"it has no completeness marker {SHARDED_MARKER} (its writers did not finish, "
            "or the marker was deleted)"
        )
    info = _remote_marker(inside, SHARDED_MARKER)
    if isinstance(info, str):
        return info
    files = info.files
    if not files:
        return f"its completeness marker {SHARDED_MARKER} lists no files"
    for file, size in files.items():
        if file not in objects:
            return f"it is missing its object {file}, which its marker lists"
        if objects[file] != size:
            return (
                f"its object {file} has {objects[file]} bytes where its marker records {size} "
                "(it is truncated or was modified)"
            )
    return None


def _remote_pointer(store: Store) -> str:
    """The name the remote ``last.json`` holds; raises ``OSError`` or ``ValueError``."""
    name = read_remote_json(store, LAST_POINTER, Pointer).checkpoint
    if not name or name in (".", "..") or "/" in name:
        raise ValueError(f"it names {name!r}, which is not a name in its directory")
    return name


def _latest_remote(d: RemotePath) -> tuple[RemotePath | None, list[tuple[RemotePath, str]]]:
    """:func:`_latest` for a remote directory: the checkpoint ``last.json`` names, or the
    newest complete one; a checkpoint without its marker is never taken. Its listing is
    read twice when the first finds no complete checkpoint: a save that replaced
    ``last.json`` and evicted the checkpoint it named meanwhile is then seen whole."""
    found, skipped = _latest_remote_once(d)
    if found is None and skipped:
        found, skipped = _latest_remote_once(d)
    return found, skipped


def _latest_remote_once(d: RemotePath) -> tuple[RemotePath | None, list[tuple[RemotePath, str]]]:
    store = Store(d)
    objects, found_prefixes = store.contents()
    prefixes = frozenset(p for p in found_prefixes if posixpath.splitext(p)[1] in _CHECKPOINT_SUFFIXES)
    skipped: list[tuple[RemotePath, str]] = []
    if LAST_POINTER in objects:
        try:
            name = _remote_pointer(store)
        except (OSError, ValueError) as exc:
            skipped.append((d / LAST_POINTER, f"this pointer is ignored: {_why(exc)}"))
        else:
            why = _remote_incomplete(store, objects, name, prefixes)
            if why is None:
                return d / name, []
            skipped.append((d / name, f"{LAST_POINTER} names it, but {why}"))
    complete: list[RemotePath] = []
    for name in sorted(set(objects) | prefixes):
        if name.startswith(".") or name == LAST_POINTER:
            continue
        if name.endswith(MARKER_SUFFIX) and name not in prefixes:
            if name[: -len(MARKER_SUFFIX)] not in objects:
                skipped.append((d / name[: -len(MARKER_SUFFIX)], f"only its completeness marker {name} is left"))
            continue
        if name not in prefixes and posixpath.splitext(name)[1] not in _CHECKPOINT_SUFFIXES and name + MARKER_SUFFIX not in objects:
            continue
        why = _remote_incomplete(store, objects, name, prefixes)
        if why is None:
            complete.append(d / name)
        elif all(p.name != name for p, _ in skipped):
            skipped.append((d / name, why))
    return newest(complete), skipped


def resolve_remote(target: RemotePath) -> RemotePath:
    """:func:`resolve_checkpoint` for a URL: an object is the checkpoint; ``last.json`` or
    a directory (a prefix) means its last complete checkpoint."""
    store = Store(target.parent)
    if target.name != LAST_POINTER and store.size(target.name) is not None:
        return target
    if target.name != LAST_POINTER and is_sharded_checkpoint(target):
        why = _remote_sharded_incomplete(store.below(target.name))
        if why is not None:
            raise CheckpointError(
                f"the sharded checkpoint {target} is not complete: {why}. Load another "
                "checkpoint, for example the previous one in its directory."
            )
        return target
    directory = target.parent if target.name == LAST_POINTER else target
    found, skipped = _latest_remote(directory)
    if found is None:
        listed = "; ".join(f"{p.name}: {why}" for p, why in skipped[:5])
        raise CheckpointError(
            f"no checkpoint at {target}: there is no such object, and {directory} holds no "
            f"complete checkpoint (one with its {MARKER_SUFFIX} marker)"
            + (f". Skipped as not complete: {listed}." if listed else ".")
        )
    if skipped:
        warnings.warn(_skipped_message(directory, found, skipped), UserWarning, stacklevel=4)
    return found
