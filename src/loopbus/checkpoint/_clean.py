"""Removing checkpoints: one checkpoint with its completeness marker (what the
Checkpoint plugin evicts), and the temporaries that writers which no longer run left in
a directory (a process killed while it wrote).

Removal never leaves a marker without its file, and never follows a symbolic link to
what it points to. A temporary is judged by the writer its name records
(``.<name>.tmp-<pid>-<random>@<host>``): only one written on this host, by a process that
no longer runs or by this one, is removed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..storage import Storage, located, store_for
from ._format import MARKER_SUFFIX, SHARDED_MARKER, PathLike

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
    store, name = located(path, retries=retries)
    store.remove(name + MARKER_SUFFIX)
    if store.size(name) is not None:
        store.remove(name)
    else:  # a sharded checkpoint: a directory (a prefix), its marker inside
        remove_remote_tree(store, name)


def remove_remote_tree(store: Storage, name: str) -> None:
    """Delete the sharded checkpoint ``name`` of ``store``: its completeness marker
    first, then everything in it (a link to one is removed as a link)."""
    store.remove_tree(name, first=SHARDED_MARKER)


def remove_stale_temporaries(directory: PathLike) -> list[Path]:
    """Delete temporary files that writers which no longer run left in ``directory``.

    A temporary's name holds its writer's process id and host name
    (``.<name>.tmp-<pid>-<random>@<host>``). It is removed when it was written on this
    host by a process that no longer runs (or by this process). A temporary written on
    another host (a directory shared between machines) is never removed: a process id
    says nothing about another machine's processes; delete such files by hand once no
    run writes there. A name without a host (written by an earlier loopbus) is taken to
    come from this host. An object store holds none (a remote checkpoint is uploaded
    under its own name)."""
    return store_for(directory).remove_stale_temporaries()


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
    store = store_for(directory, retries=retries)
    if store.whole_without_marker():  # only a dead writer's temporaries are incomplete
        return list(store.remove_stale_temporaries())
    from ._locate import candidates, incomplete

    objects, prefixes = store.contents()
    checkpoints = set(candidates(store, objects, prefixes))
    removed: list[Any] = []
    for name in sorted(set(objects) | checkpoints):
        base = name[: -len(MARKER_SUFFIX)]
        if name.endswith(MARKER_SUFFIX) and name not in checkpoints:
            if base not in objects and base not in prefixes:  # a marker left alone
                store.remove(name)
                removed.append(store.path(name))
            continue
        if name not in checkpoints or incomplete(store, objects, prefixes, name) is None:
            continue
        if name in prefixes and name not in objects:
            remove_remote_tree(store, name)
        else:
            store.remove(name + MARKER_SUFFIX)
            store.remove(name)
        removed.append(store.path(name))
    return removed
