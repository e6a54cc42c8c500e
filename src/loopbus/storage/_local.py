"""The one interface of a store (:class:`Storage`: the entries of one directory, by
name) and its local backend (:class:`LocalStore`, a directory of the file system); the
fsspec backend is :class:`~loopbus.storage.Store`. :func:`store_for` is the one place
that tells a URL from a local path: the checkpoint verbs take what it returns and never
ask which backend they talk to.

What a backend guarantees differs, and each says so: a local directory publishes an
entry complete, by a rename (:attr:`Storage.renames` is true); an object store has no
rename, so an object appears under its final name as it is uploaded and only a
completeness marker, written last, says that it is whole.

Imports the base layer and the standard library; a local path never imports fsspec.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from .._durable import replace_atomically
from .._untrusted import read_small
from ._store import RemotePath, Store, is_url, remote_path

__all__ = ["LocalStore", "Storage", "crc32_of", "located", "location", "store_for"]


@runtime_checkable
class Storage(Protocol):
    """What every store is: the entries directly under one directory, by name, with the
    few operations checkpoints use. A missing entry reads as ``FileNotFoundError``; its
    removal is no error.

    ``noun`` says what an entry is called in messages (``"file"``, ``"object"``);
    ``renames`` whether an entry is published complete under its name by a rename (a
    local file system) rather than written in place (an object store, where only a
    completeness marker says an object is whole)."""

    noun: str
    renames: bool

    @property
    def directory(self) -> Path | RemotePath:
        """The directory itself."""
        ...

    def path(self, name: str) -> Path | RemotePath:
        """The entry ``name``, as a path (a :class:`RemotePath` for a URL)."""
        ...

    def below(self, name: str) -> Storage:
        """The directory ``name`` in this one (a prefix, for an object store)."""
        ...

    def contents(self) -> tuple[dict[str, int], set[str]]:
        """What is directly in the directory, fresh: its entries (name -> size) and the
        names of its subdirectories (prefixes)."""
        ...

    def listing(self) -> dict[str, int]:
        """The entries directly in the directory, name -> size."""
        ...

    def size(self, name: str) -> int | None:
        """The size of the entry ``name``; None if there is none (or it is a directory)."""
        ...

    def read_small(self, name: str) -> bytes:
        """The entry ``name`` whole, if it is at most 1 MiB (a marker, a pointer); raises
        ``FileNotFoundError`` or ``ValueError`` (a message that is a clause)."""
        ...

    def crc32(self, name: str) -> int | None:
        """The CRC-32 of the entry ``name`` where it is read in place (a local file);
        None where that would mean downloading it."""
        ...

    def modified(self, name: str) -> float | None:
        """When the entry ``name`` was last modified, where the store says so cheaply
        (a local file's time); None where only its marker's time is trusted."""
        ...

    def write(self, name: str, data: bytes) -> None:
        """Write the entry ``name`` whole (locally: a temporary file renamed into place)."""
        ...

    def local_copy(
        self, name: str, *, beside: Iterable[str] = ()
    ) -> contextlib.AbstractContextManager[Path]:
        """The entry ``name`` as a local file while the block runs: a local store's own
        file; an object store's downloaded into a temporary directory, with the entries
        ``beside`` it (those missing left out), removed afterwards."""
        ...

    def remove(self, name: str) -> None:
        """Delete the entry ``name``; a missing one is ignored."""
        ...

    def remove_tree(self, name: str, *, first: str | None = None) -> None:
        """Delete the directory ``name`` and everything in it, its entry ``first`` (a
        completeness marker) before the rest, so that a directory half deleted is never
        taken as complete; a missing one is ignored, a link is removed as a link."""
        ...


def crc32_of(file: str | os.PathLike[str]) -> int:
    """The CRC-32 of the local file ``file`` (as a completeness marker records it), read
    in 4 MiB pieces."""
    crc = 0
    with open(file, "rb") as handle:
        while chunk := handle.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


class LocalStore:
    """The entries directly under the local directory ``directory``, by name
    (:class:`Storage`). Reads and writes are the file system's own: nothing is retried,
    and an ``OSError`` propagates as it is."""

    noun = "file"
    renames = True

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self._directory = Path(os.fspath(directory))

    def __repr__(self) -> str:
        return f"LocalStore({str(self._directory)!r})"

    @property
    def directory(self) -> Path:
        return self._directory

    def path(self, name: str) -> Path:
        return self._directory / name

    def below(self, name: str) -> LocalStore:
        return LocalStore(self._directory / name)

    def contents(self) -> tuple[dict[str, int], set[str]]:
        found: dict[str, int] = {}
        directories: set[str] = set()
        try:
            entries = sorted(self._directory.iterdir())
        except OSError:  # missing, or not a directory
            return found, directories
        for entry in entries:
            try:
                if entry.is_dir():
                    directories.add(entry.name)
                else:
                    found[entry.name] = entry.stat().st_size
            except OSError:  # a link to nothing, gone meanwhile: not an entry
                continue
        return found, directories

    def listing(self) -> dict[str, int]:
        return self.contents()[0]

    def size(self, name: str) -> int | None:
        try:
            info = self.path(name).stat()
        except OSError:
            return None
        return None if self.path(name).is_dir() else info.st_size

    def read_small(self, name: str) -> bytes:
        return read_small(self.path(name))

    def crc32(self, name: str) -> int | None:
        return crc32_of(self.path(name))

    def modified(self, name: str) -> float | None:
        return self.path(name).stat().st_mtime

    def write(self, name: str, data: bytes) -> None:
        replace_atomically(self.path(name), lambda file: file.write(data))

    @contextlib.contextmanager
    def local_copy(self, name: str, *, beside: Iterable[str] = ()) -> Iterator[Path]:
        yield self.path(name)  # read in place: no copy

    def remove(self, name: str) -> None:
        self.path(name).unlink(missing_ok=True)

    def remove_tree(self, name: str, *, first: str | None = None) -> None:
        target = self.path(name)
        if target.is_symlink():  # the link, never what it points to (nor its marker)
            target.unlink(missing_ok=True)
            return
        if first is not None and target.is_dir():
            (target / first).unlink(missing_ok=True)
        shutil.rmtree(target, ignore_errors=True)


def store_for(
    directory: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    retries: int | None = None,
) -> Storage:
    """The store of ``directory``: a :class:`~loopbus.storage.Store` for a URL (reached
    with its fsspec ``storage_options``; a :class:`RemotePath` carries its own; its calls
    tried ``retries`` more times), a :class:`LocalStore` for a local path."""
    if is_url(directory):
        remote = remote_path(directory, storage_options)
        return Store(remote) if retries is None else Store(remote, retries=retries)
    return LocalStore(directory)


def location(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> Path | RemotePath:
    """``path`` as a local :class:`~pathlib.Path`, or a URL as a :class:`RemotePath`
    with the fsspec ``storage_options`` (one already a ``RemotePath`` keeps its own unless
    they are given)."""
    return remote_path(path, storage_options) if is_url(path) else Path(os.fspath(path))


def located(
    path: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    retries: int | None = None,
) -> tuple[Storage, str]:
    """The store of the directory that holds ``path``, and ``path``'s name in it."""
    if is_url(path):
        remote = remote_path(path, storage_options)
        return store_for(remote.parent, retries=retries), remote.name
    local = Path(os.fspath(path))
    return LocalStore(local.parent), local.name
