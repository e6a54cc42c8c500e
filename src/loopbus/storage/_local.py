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
import errno
import hashlib
import os
import re
import secrets
import shutil
import socket
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar, runtime_checkable

from .._durable import fsync_dir, replace_atomically
from .._exceptions import MisconfigurationError
from .._untrusted import read_small
from ._complete import CompletionFailed, write_marked
from ._health import StoreHealth
from ._store import (
    RemotePath,
    Store,
    StoreDeadlines,
    derived,
    is_url,
    remote_path,
    require_backend,
)

_T = TypeVar("_T")

#: Marks a temporary's name (``.<name>.tmp-<pid>-<random>@<host>``).
TEMP_TAG = ".tmp-"
#: Separates a temporary file's writer (``<pid>-<random>``) from its host's name.
_HOST_SEP = "@"
#: The longest host tag in a temporary file's name.
_HOST_TAG_MAX = 32

__all__ = [
    "LocalStore",
    "Storage",
    "crc32_of",
    "located",
    "location",
    "open_location",
    "store_for",
]


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

    def publish(
        self,
        name: str,
        write: Callable[[IO[bytes]], _T],
        *,
        before: Callable[[], object] | None = None,
    ) -> _T:
        """Stage the entry ``name`` with ``write(file)``, then publish it whole under its
        name, and return what ``write`` returned. ``before()`` runs once it is staged,
        right before it appears (to remove what must not outlive the old entry). Locally:
        a temporary file in the directory (see :func:`temporary_for`), flushed, fsynced and
        renamed onto the name, the directory fsynced (``IsADirectoryError`` if the name is
        a directory); in an object store: a local temporary file, uploaded under the name
        (an object appears whole or not at all)."""
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

    def remove_stale_temporaries(self) -> list[Path]:
        """Delete the temporaries that writers which no longer run left in the directory
        (entries staged for :meth:`publish`), and return them; none where entries are
        not staged in the directory (an object store uploads under the final name)."""
        ...

    @property
    def shown(self) -> str:
        """The directory as messages show it (a URL without its user name or password)."""
        ...

    @property
    def health(self) -> StoreHealth | None:
        """What the calls to the store have met lately (None: not watched, or a local
        directory, whose calls are the file system's own)."""
        ...

    def make_directory(self) -> None:
        """Create the directory (and its parents) if it is missing; nothing for an object
        store, where a directory is only a prefix of names. Raises ``OSError``."""
        ...

    def exists(self, name: str) -> bool:
        """Whether the directory holds an entry or a subdirectory called ``name`` (a local
        link counts, even to nothing)."""
        ...

    def is_directory(self, name: str) -> bool:
        """Whether ``name`` is a directory in this one: a local directory (a link to one
        counts, even empty); in an object store, a prefix with objects under it (and no
        object of that name)."""
        ...

    def whole_without_marker(self) -> bool:
        """Whether an entry found under its name is whole even without its completeness
        marker: true where a rename publishes it (a writer that dies leaves a temporary,
        under another name, and a write that fails leaves the entry it replaces as it
        was); false in an object store, where an entry fills up under its final name and
        only its marker, written last, says that it is whole."""
        ...

    def holds(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` names an entry directly in this directory."""
        ...

    def staging_name(self, name: str) -> str:
        """The name the entry (or directory) ``name`` is staged under before it is
        published: a temporary name (see :func:`temporary_for`) where a rename publishes
        it; ``name`` itself in an object store, where it is written in place and only a
        completeness marker says it is whole."""
        ...

    def dcp_writer(self, name: str) -> Any:
        """``torch.distributed.checkpoint``'s writer of the directory ``name``: its file
        system writer, or an object store's fsspec writer with the store's options (no
        fsync: an object is whole once written)."""
        ...

    def dcp_reader(self, name: str, *, mixin: type | None = None) -> Any:
        """``torch.distributed.checkpoint``'s reader of the directory ``name`` (its file
        system reader, or an object store's fsspec reader), of a class that derives from
        ``mixin`` first, when given."""
        ...

    def complete_sharded(
        self,
        staged: str,
        name: str,
        *,
        plain: str,
        write_plain: Callable[[IO[bytes]], object] | None,
        marker: str,
        info: Mapping[str, Any],
    ) -> dict[str, Any]:
        """Complete the sharded checkpoint ``name`` whose shards were written into the
        directory ``staged`` (its :meth:`staging_name`): write its entry ``plain`` with
        ``write_plain(file)`` (when given), then its completeness marker ``marker``, the
        JSON of ``info`` with ``files`` (every entry's size, the marker's not included)
        and ``checkpoint`` (``name``), then publish it. Locally that is a rename of the
        staging directory to ``name``: a directory of that name is moved aside first and
        removed once the rename is done, or moved back if it fails. In an object store,
        where ``staged`` is ``name``, the marker is what publishes it. Returns what the
        marker records.

        Raises :class:`~loopbus.storage.CompletionFailed` saying which step failed and
        what was removed: the staging directory (the directory of that name, if any, is
        as it was), or what was written in place."""
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
    health = None  # the file system's own calls: not watched

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
        self.publish(name, lambda file: file.write(data))

    def publish(
        self,
        name: str,
        write: Callable[[IO[bytes]], _T],
        *,
        before: Callable[[], object] | None = None,
    ) -> _T:
        target = self.path(name)
        if target.is_dir():
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(target))
        target.parent.mkdir(parents=True, exist_ok=True)
        return replace_atomically(
            target, write, before_replace=before, temporary=temporary_for, name_errors=False
        )

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

    @property
    def shown(self) -> str:
        return str(self._directory)

    def make_directory(self) -> None:
        self._directory.mkdir(parents=True, exist_ok=True)

    def exists(self, name: str) -> bool:
        return os.path.lexists(self.path(name))

    def is_directory(self, name: str) -> bool:
        return self.path(name).is_dir()

    def whole_without_marker(self) -> bool:
        return True  # published by a rename

    def holds(self, path: str | os.PathLike[str]) -> bool:
        try:
            return Path(os.fspath(path)).resolve().parent == self._directory.resolve()
        except (OSError, ValueError):
            return False

    def staging_name(self, name: str) -> str:
        return temporary_for(self.path(name)).name

    def dcp_writer(self, name: str) -> Any:
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        return FileSystemWriter(self.path(name))

    def dcp_reader(self, name: str, *, mixin: type | None = None) -> Any:
        from torch.distributed.checkpoint.filesystem import FileSystemReader

        return derived(FileSystemReader, mixin)(self.path(name))

    def complete_sharded(
        self,
        staged: str,
        name: str,
        *,
        plain: str,
        write_plain: Callable[[IO[bytes]], object] | None,
        marker: str,
        info: Mapping[str, Any],
    ) -> dict[str, Any]:
        temp = self.path(staged)
        record = dict(info, checkpoint=name)
        try:
            sealed = write_marked(self.below(staged), plain, write_plain, marker, record)
        except CompletionFailed as failed:
            shutil.rmtree(temp, ignore_errors=True)
            raise failed.left(temp, staged=True) from failed.cause
        if staged != name:
            self._rename_into_place(temp, self.path(name))
        return sealed

    def _rename_into_place(self, temp: Path, target: Path) -> None:
        """Rename the complete directory ``temp`` to ``target``. A directory cannot
        replace another atomically: one of that name is moved aside under a temporary
        name first (removed as stale if this process dies meanwhile), and back if the
        rename fails; ``temp`` is removed then."""
        aside = None
        try:
            if target.exists():
                aside = temporary_for(target)
                os.replace(target, aside)
            os.replace(temp, target)
        except OSError as exc:
            if aside is not None:
                with contextlib.suppress(OSError):
                    os.replace(aside, target)
            shutil.rmtree(temp, ignore_errors=True)
            kept = aside if aside is not None and aside.exists() else None
            raise CompletionFailed(None, exc, removed=temp, staged=True, aside=kept) from exc
        fsync_dir(self._directory)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)

    def remove_stale_temporaries(self) -> list[Path]:
        """A temporary's name holds its writer's process id and host name (see
        :func:`temporary_for`). It is removed when it was written on this host by a
        process that no longer runs (or by this process). One written on another host (a
        directory shared between machines) is never removed: a process id says nothing
        about another machine's processes. A name without a host (written by an earlier
        loopbus) is taken to come from this host."""
        removed: list[Path] = []
        if not self._directory.is_dir():
            return removed
        here = host_tag()
        for entry in self._directory.iterdir():
            writer = temporary_writer(entry.name) if entry.name.startswith(".") else None
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


def temporary_for(target: Path) -> Path:
    """The temporary a local store stages ``target`` in:
    ``.<name>.tmp-<pid>-<random>@<host>``, the writer's process id and host name, so that
    a cleanup of stale temporaries judges whether the writer still runs only on the host
    where that process id means something (see :func:`temporary_writer`)."""
    return target.with_name(
        f".{target.name}{TEMP_TAG}{os.getpid()}-{secrets.token_hex(4)}{_HOST_SEP}{host_tag()}"
    )


def host_tag() -> str:
    """This host's name as it goes into a temporary file's name: characters other than
    letters, digits and ``-`` become ``_``, and a long name is cut, with a hash of the
    whole name kept, so that the tag stays short and still tells hosts apart."""
    host = socket.gethostname() or "localhost"
    tag = re.sub(r"[^A-Za-z0-9-]", "_", host)
    if len(tag) > _HOST_TAG_MAX:
        digest = hashlib.sha1(host.encode("utf-8", "surrogateescape")).hexdigest()[:8]
        tag = f"{tag[: _HOST_TAG_MAX - 9]}~{digest}"
    return tag


def temporary_writer(name: str) -> tuple[int, str | None] | None:
    """The writer's process id and host tag from a temporary's name (host None for a
    name without one), or None if ``name`` is not such a temporary."""
    if TEMP_TAG not in name:
        return None
    tail = name.rsplit(TEMP_TAG, 1)[1]
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
    path: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    owner: str | None = None,
) -> Path | RemotePath:
    """``path`` as a local :class:`~pathlib.Path`, or a URL as a :class:`RemotePath`
    with the fsspec ``storage_options`` (one already a ``RemotePath`` keeps its own unless
    they are given). With ``owner`` (what is about to use it, as an error names it:
    ``"ckpt_path='s3://b/x'"``), the package a URL's scheme needs is checked now."""
    if not is_url(path):
        return Path(os.fspath(path))
    if owner is not None:
        require_backend(path, owner=owner)
    return remote_path(path, storage_options)


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


def open_location(
    path: object,
    *,
    storage_options: Mapping[str, Any] | None = None,
    store_deadlines: StoreDeadlines | Mapping[str, float] | None = None,
    owner: str,
    option: str = "dirpath",
) -> Path | RemotePath:
    """The directory ``path`` that ``owner``'s option ``option`` names (the
    ``Checkpoint`` plugin's ``dirpath``), checked now: a URL (or a path given
    ``storage_options`` or ``store_deadlines``, which only a URL takes) as a
    :class:`RemotePath` with them and a :class:`StoreHealth` of its own (each call to the
    store says how it went), its scheme's package checked; a local path as a
    :class:`~pathlib.Path`. Raises :class:`MisconfigurationError` naming
    ``owner(option=...)`` for options given with a local path, storage options that are
    no mapping, deadlines that are not :class:`StoreDeadlines`, or no path at all."""
    if is_url(path) or storage_options is not None or store_deadlines is not None:
        return _watched(path, storage_options, store_deadlines, owner=owner, option=option)
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise MisconfigurationError(
            f"{owner}({option}=...) must be a directory path, got {path!r}."
        )
    return Path(os.fspath(path))


def _watched(
    path: Any,
    storage_options: Mapping[str, Any] | None,
    store_deadlines: StoreDeadlines | Mapping[str, float] | None,
    *,
    owner: str,
    option: str,
) -> RemotePath:
    """:func:`open_location` of a URL: with its storage options, its deadlines and a
    health of its own."""
    if not is_url(path):
        given = "storage_options" if storage_options is not None else "store_deadlines"
        raise MisconfigurationError(
            f"{owner}({given}=...) applies to a URL {option} such as "
            f"'s3://bucket/run'; {os.fspath(path)!r} is a local path."
        )
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise MisconfigurationError(
            f"{owner}(storage_options=...) must be a dict of fsspec storage options, got "
            f"a {type(storage_options).__name__}."
        )
    remote = remote_path(path, storage_options)
    deadlines = StoreDeadlines.of(store_deadlines, owner=f"{owner}(store_deadlines=...)")
    remote = RemotePath(
        remote.url, remote.storage_options, deadlines or remote.deadlines, health=StoreHealth()
    )
    require_backend(remote, owner=f"{owner}({option}={remote.url!r})")
    return remote
