"""A file system that fills up, for the tests of what loopbus does when a disk is full.

:class:`FullDisk` replaces ``io.open`` (which ``Path.open``, ``os.fdopen`` and so
``torch.distributed.checkpoint``'s writer use) and the ``open`` of the checkpoint
writer's module. A file opened for writing under ``root`` is written through a raw file
whose writes fail with ``OSError(ENOSPC)`` whenever :attr:`FullDisk.full` says so for its
path (once :attr:`FullDisk.room` more bytes are written), as a write(2) on a full disk
does; everything else is the real file, written
through Python's own buffered and text layers, so a failure surfaces where it would
(at a write, a flush or a close). Temporary files made with ``tempfile.mkstemp`` are
known by their path too. Everything is put back by the ``monkeypatch`` fixture.
"""

from __future__ import annotations

import errno
import io
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loopbus.checkpoint import _write as _checkpoint_io

NO_SPACE = os.strerror(errno.ENOSPC)


class _Raw(io.RawIOBase):
    """A file on a disk that may be full: a write fails with ENOSPC when it is."""

    def __init__(self, raw: Any, path: Path, disk: FullDisk) -> None:
        self._raw = raw
        self.path = path
        self.disk = disk
        self.room = disk.room

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return bool(self._raw.seekable())

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return int(self._raw.seek(offset, whence))

    def tell(self) -> int:
        return int(self._raw.tell())

    def fileno(self) -> int:
        return int(self._raw.fileno())

    def write(self, data: Any) -> int:
        if self.disk.full(self.path):
            if self.room > 0:  # what still fits: a short write, as write(2) makes
                written = int(self._raw.write(memoryview(data)[: self.room]))
                self.room -= written
                return written
            self.disk.failed.append(self.path)
            raise OSError(errno.ENOSPC, NO_SPACE)
        return int(self._raw.write(data))

    def close(self) -> None:
        if not self.closed:
            self._raw.close()
        super().close()


class FullDisk:
    """Files under ``root`` that :attr:`full` picks (it is asked at every write, with the
    file's path) cannot be written: the disk is full for them, once :attr:`room` more
    bytes (counted from when the file was opened) are written. :attr:`failed` lists the
    paths of the writes that failed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, root: Path) -> None:
        self.root = root
        self.full: Callable[[Path], bool] = lambda path: False
        self.room = 0
        self.failed: list[Path] = []
        self._names: dict[int, Path] = {}
        real_open = io.open
        real_mkstemp = tempfile.mkstemp

        def mkstemp(*args: Any, **kwargs: Any) -> tuple[int, str]:
            fd, name = real_mkstemp(*args, **kwargs)
            self._names[fd] = Path(name)
            return fd, name

        def fake_open(
            file: Any,
            mode: str = "r",
            buffering: int = -1,
            encoding: str | None = None,
            errors: str | None = None,
            newline: str | None = None,
            closefd: bool = True,
            opener: Any = None,
        ) -> Any:
            path = self._names.get(file) if isinstance(file, int) else Path(os.fsdecode(file))
            writing = ("w" in mode or "a" in mode) and "+" not in mode
            if path is None or not writing or root not in path.parents:
                return real_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
            binary = mode.replace("t", "").replace("b", "") + "b"
            raw = real_open(file, binary, 0, closefd=closefd, opener=opener)
            stream = io.BufferedWriter(_Raw(raw, path, self))
            if "b" in mode:
                return stream
            return io.TextIOWrapper(stream, encoding=encoding, errors=errors, newline=newline)

        monkeypatch.setattr(io, "open", fake_open)
        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
        monkeypatch.setattr(_checkpoint_io, "open", fake_open, raising=False)
