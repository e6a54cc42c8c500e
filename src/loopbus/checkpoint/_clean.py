"""Removing checkpoints: one checkpoint with its completeness marker (what the
Checkpoint plugin evicts), and the temporaries that writers which no longer run left in
a directory (a process killed while it wrote).

Removal never leaves a marker without its file, and never follows a symbolic link to
what it points to. A temporary is judged by the writer its name records
(``.<name>.tmp-<pid>-<random>@<host>``): only one written on this host, by a process that
no longer runs or by this one, is removed.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
from pathlib import Path
from typing import Any

from ..storage import RemotePath, Store, is_url, remote_path
from ._format import (
    _TMP_TAG,
    MARKER_SUFFIX,
    SHARDED_MARKER,
    PathLike,
    _host_tag,
    _temp_writer,
    marker_path,
)

__all__ = [
    "remove_checkpoint",
    "remove_incomplete_checkpoints",
    "remove_remote_tree",
    "remove_stale_temporaries",
]


def remove_checkpoint(path: PathLike, *, retries: int = 0) -> None:
    """Delete a checkpoint and its completeness marker (the marker first, so that a crash
    in between never leaves a marker without its file): a file, or a sharded checkpoint's
    whole directory. Missing files are ignored.

    A symbolic link is removed as a link: what it points to (a checkpoint of another run,
    say) is never touched. The marker inside a linked directory belongs to that
    checkpoint, which may be the one its own directory's ``last.json`` names.

    A URL's objects are deleted in the same order (each deletion tried again up to
    ``retries`` times), so that a checkpoint half deleted is never taken as complete."""
    if is_url(path):
        remote = remote_path(path)
        store = Store(remote.parent, retries=retries)
        store.remove(remote.name + MARKER_SUFFIX)
        if store.size(remote.name) is not None:
            store.remove(remote.name)
        else:  # a sharded checkpoint: a prefix, its marker inside
            remove_remote_tree(store, remote.name)
        return
    target = Path(os.fspath(path))
    if target.is_symlink() and target.is_dir():
        target.unlink(missing_ok=True)
        return
    marker_path(target).unlink(missing_ok=True)
    if target.is_dir() and not target.is_symlink():
        shutil.rmtree(target, ignore_errors=True)
    else:
        target.unlink(missing_ok=True)


def remove_remote_tree(store: Store, name: str) -> None:
    """Delete the sharded checkpoint ``name`` of the remote directory ``store``: its
    completeness marker first, then every object under its prefix."""
    store.below(name).remove(SHARDED_MARKER)
    store.remove_tree(name)


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
    if is_url(directory):
        return removed  # a remote checkpoint is uploaded under its own name
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


def remove_incomplete_checkpoints(directory: PathLike, *, retries: int = 0) -> list[Any]:
    """Delete what writers that died left in ``directory``, and return it. Call it only
    when no writer is at work there (the ``Checkpoint`` plugin does when a run resumes
    from its folder, which then only it writes to).

    In a local directory that is :func:`remove_stale_temporaries`'s temporaries (a local
    checkpoint is renamed into place complete). In an object store, which has no rename,
    it is every checkpoint that is not complete: an object without its completeness
    marker or of another size than the marker records, a marker without its object, a
    sharded checkpoint's prefix whose marker is missing or does not match its objects.
    Complete checkpoints, ``last.json`` and objects that are no checkpoints (names
    without a checkpoint suffix) are left alone; deletions are tried again ``retries``
    times."""
    if not is_url(directory):
        return remove_stale_temporaries(directory)
    from ._locate import _CHECKPOINT_SUFFIXES, _remote_incomplete

    where = remote_path(directory)
    store = Store(where, retries=retries)
    objects, found = store.contents()
    prefixes = frozenset(p for p in found if posixpath.splitext(p)[1] in _CHECKPOINT_SUFFIXES)
    removed: list[RemotePath] = []
    for name in sorted(set(objects) | prefixes):
        if name.endswith(MARKER_SUFFIX) and name not in prefixes:
            if name[: -len(MARKER_SUFFIX)] not in objects:  # a marker left alone
                store.remove(name)
                removed.append(where / name)
            continue
        if name not in prefixes and posixpath.splitext(name)[1] not in _CHECKPOINT_SUFFIXES:
            continue
        if _remote_incomplete(store, objects, name, prefixes) is None:
            continue
        if name in prefixes:
            remove_remote_tree(store, name)
        else:
            store.remove(name + MARKER_SUFFIX)
            store.remove(name)
        removed.append(where / name)
    return removed


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
