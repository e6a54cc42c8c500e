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

__all__ = ["fsync_dir", "naming_errors", "replace_atomically"]


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


def replace_atomically(path: str | os.PathLike[str], fill: Callable[[io.BufferedWriter], object]) -> None:
    """Write ``path`` anew through a temporary file in its directory: ``fill`` writes it,
    then fsync and an atomic rename. A crash at any point leaves the old file (or none)
    and at most a stray temporary, never a half-written ``path``; an ``OSError`` names
    ``path``."""
    target = Path(path)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with naming_errors(target), os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)
