"""Durable file writes, for the engine and plugins alike: a file replaced whole or not at
all, and a directory's entries flushed to disk. The base layer: imports nothing of
loopbus and no torch.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

__all__ = ["fsync_dir", "naming_errors", "replace_atomically"]

_T = TypeVar("_T")


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Flush ``directory``'s entries (a rename, a new file) to disk. A no-op where the
    platform cannot open a directory (Windows) or the file system cannot sync one."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def naming_errors(path: str | os.PathLike[str]) -> Iterator[None]:
    """Give an ``OSError`` raised without a file name (a failed write or flush: a full
    disk) the name of the file ``path`` being written, so that its message says which."""
    try:
        yield
    except OSError as exc:
        if exc.filename is None:
            exc.filename = os.fspath(path)
        raise


def replace_atomically(
    path: str | os.PathLike[str],
    fill: Callable[[io.BufferedWriter], _T],
    *,
    before_replace: Callable[[], object] | None = None,
    temporary: Callable[[Path], Path] | None = None,
    name_errors: bool = True,
) -> _T:
    """Write ``path`` anew through a temporary file in its directory: ``fill`` writes it,
    then fsync and an atomic rename. A crash at any point leaves the old file (or none)
    and at most a stray temporary, never a half-written ``path``. Returns what ``fill``
    returned.

    ``before_replace`` is called once the temporary is complete and on disk, right
    before it replaces ``path`` (to remove what must not outlive the old file).
    ``temporary`` names the temporary file for ``path`` (default: a fresh
    ``.<name>.<random>.tmp`` made with ``tempfile.mkstemp``, readable by its owner
    only); such a name is opened with ``"wb"``. With ``name_errors`` (the default), an
    ``OSError`` raised without a file name (a failed write: a full disk) names ``path``.
    If anything fails, the temporary file is removed."""
    target = Path(path)
    fd: int | None = None
    if temporary is None:
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        tmp = Path(name)
    else:
        tmp = temporary(target)
    try:
        with (
            naming_errors(target) if name_errors else contextlib.nullcontext(),
            tmp.open("wb") if fd is None else os.fdopen(fd, "wb") as file,
        ):
            result = fill(file)
            file.flush()
            os.fsync(file.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(target.parent)
    return result
