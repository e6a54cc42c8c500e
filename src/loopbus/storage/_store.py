"""Object storage through fsspec: which paths are URLs, the package a URL's scheme
needs, a URL that carries its storage options and deadlines, and a directory of objects
with the few operations checkpoints use (list with sizes, read, write, upload, download,
delete a object or a whole prefix), each under a deadline and retried with exponential
backoff.

fsspec is imported only when a URL is used: a local path never reaches this module's
imports. Storage options (credentials, endpoints) live in memory only: a
:class:`RemotePath` shows its URL in ``str``, ``repr`` and messages, never its options.

Every call to a store ends: a connection is opened within ``connect_s``, an answer is
read with no pause longer than ``read_s`` (for S3, botocore's timeouts; its and s3fs's
own retries are turned off, so that :class:`Store`'s are the only ones and the total
wait is predictable), and a whole call (an upload of a checkpoint included) is abandoned
after ``call_s`` (:class:`StoreDeadlines`): an async filesystem's coroutine (s3fs, gcsfs)
is cancelled on fsspec's event loop, a blocking filesystem's thread is no longer waited
for. A read timeout alone does not bound an upload to a server that stops reading (the
send blocks); ``call_s`` does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import importlib.util
import os
import posixpath
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, TypeVar

from .._exceptions import CheckpointError, MisconfigurationError
from .._untrusted import MAX_SMALL_FILE
from .._validate import _URL, check_number
from ._advice import Overdue, describe_failure, fix_for, not_retried
from ._complete import CompletionFailed, write_marked
from ._health import StoreHealth

__all__ = [
    "RemotePath",
    "Store",
    "StoreDeadlines",
    "is_url",
    "remote_path",
    "require_backend",
]

_T = TypeVar("_T")

#: A URL's scheme -> the package its fsspec filesystem needs, and loopbus's extra for it.
_BACKENDS = {
    "s3": ("s3fs", "s3"),
    "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"),
    "gcs": ("gcsfs", "gcs"),
}

#: The first wait between two tries of a remote operation, in seconds; doubled each try.
BACKOFF = 0.5

#: How many more times a :class:`Store` tries a call that failed, unless told otherwise.
RETRIES = 2

#: The longest any deadline may be, in seconds (a day).
_LONGEST = 86400.0

#: ``scheme://user:password@host``: what :attr:`RemotePath.public_url` leaves out.
_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/@]*@")


@dataclasses.dataclass(frozen=True)
class StoreDeadlines:
    """How long an object store may take, in seconds.

    ``connect_s``: to open a connection; ``read_s``: the longest pause while an answer
    is read (for S3 these are botocore's ``connect_timeout`` and ``read_timeout``,
    replacing any the storage options' ``config_kwargs`` give); ``call_s``: one whole
    call (a listing, a read, the upload of a whole checkpoint), after which it is
    abandoned and, if it has tries left, tried again; ``save_wait_s``: the longest a
    training step waits for the previous background save to the store when the next
    save is due (the ``Checkpoint`` plugin then skips the due save, with a warning).
    Each is a number of seconds > 0, at most a day."""

    connect_s: float = 10.0
    read_s: float = 60.0
    call_s: float = 600.0
    save_wait_s: float = 10.0

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = check_number(
                field.name,
                getattr(self, field.name),
                exclusive_minimum=0,
                maximum=_LONGEST,
                owner="StoreDeadlines",
                what="a number of seconds",
                hint="every deadline is a positive number of seconds, at most a day",
            )
            object.__setattr__(self, field.name, value)

    @classmethod
    def of(cls, value: object, *, owner: str) -> StoreDeadlines | None:
        """``value`` as deadlines: a :class:`StoreDeadlines` as it is, a mapping of its
        fields (from a config file, say), or None; ``owner`` names the option in the
        error that anything else raises."""
        if value is None or isinstance(value, StoreDeadlines):
            return value
        names = [field.name for field in dataclasses.fields(cls)]
        if not isinstance(value, Mapping):
            raise MisconfigurationError(
                f"{owner} must be a loopbus.StoreDeadlines or a dict of its fields "
                f"({', '.join(names)}; seconds), got {value!r}."
            )
        unknown = sorted(str(key) for key in value if key not in names)
        if unknown:
            raise MisconfigurationError(
                f"{owner} has no deadline {unknown[0]!r}; its deadlines are "
                f"{', '.join(names)} (seconds)."
            )
        return cls(**value)


def _scheme(path: object) -> str | None:
    text = path.__fspath__() if isinstance(path, os.PathLike) else path
    match = _URL.match(text) if isinstance(text, str) else None
    return None if match is None else match.group(1).lower()


def is_url(path: object) -> bool:
    """Whether ``path`` is a URL (``s3://bucket/run``, ``gs://``, ``memory://``, ...)
    rather than a local path; a Windows drive (``C:/``) or ``runs/s3:`` is a path."""
    return isinstance(path, RemotePath) or _scheme(path) is not None


def _available(module: str) -> bool:
    """Whether ``module`` can be imported (the check a missing extra fails)."""
    return importlib.util.find_spec(module) is not None


def require_backend(url: object, *, owner: str = "") -> None:
    """Raise :class:`MisconfigurationError` naming the extra to install when the URL's
    scheme needs a package that is missing (``s3://``: ``loopbus[s3]``, that is s3fs;
    ``gs://``: ``loopbus[gcs]``, gcsfs; any URL: fsspec)."""
    scheme = _scheme(url) or "file"
    module, extra = _BACKENDS.get(scheme, (None, None))
    where = f"{owner}: " if owner else ""
    if not _available("fsspec"):
        hint = f"pip install 'loopbus[{extra}]'" if extra else "pip install fsspec"
        raise MisconfigurationError(
            f"{where}{scheme}:// URLs need fsspec, which is not installed: {hint}."
        )
    if module is not None and not _available(module):
        raise MisconfigurationError(
            f"{where}{scheme}:// URLs need {module}, which is not installed: "
            f"pip install 'loopbus[{extra}]' (or pip install {module})."
        )


class RemotePath(os.PathLike[str]):
    """A URL (``s3://bucket/run/epoch=0-step=10.ckpt``) with the fsspec storage options
    to reach it (an endpoint, credentials; None: fsspec's and the backend's standard
    places, such as ``AWS_*`` variables and ``~/.aws``) and the :class:`StoreDeadlines`
    its calls are held to (None: the defaults). Its ``str`` and ``repr`` are the URL
    alone: the options are never shown, logged or written anywhere. ``health`` (a
    :class:`~loopbus.storage.StoreHealth`), if given, is told the outcome of every call
    made through this path or one derived from it (``/``, ``parent``)."""

    __slots__ = ("_deadlines", "_health", "_options", "url")

    def __init__(
        self,
        url: str | os.PathLike[str],
        storage_options: Mapping[str, Any] | None = None,
        deadlines: StoreDeadlines | Mapping[str, float] | None = None,
        *,
        health: StoreHealth | None = None,
    ) -> None:
        text = os.fspath(url)
        if _scheme(text) is None:
            raise MisconfigurationError(
                f"RemotePath needs a URL such as 's3://bucket/run', got {text!r}."
            )
        self.url = text.rstrip("/") if text.count("/") > 2 else text
        self._options = dict(storage_options or {})
        self._deadlines = StoreDeadlines.of(deadlines, owner="RemotePath(deadlines=...)")
        self._health = health

    @property
    def storage_options(self) -> dict[str, Any]:
        """The storage options (a copy)."""
        return dict(self._options)

    @property
    def deadlines(self) -> StoreDeadlines:
        """The deadlines of calls to the store (:class:`StoreDeadlines`)."""
        return self._deadlines or StoreDeadlines()

    @property
    def health(self) -> StoreHealth | None:
        """What the calls made through this path have met (None: not watched)."""
        return self._health

    @property
    def public_url(self) -> str:
        """The URL as messages show it: without a user name or password
        (``ftp://user:pw@host/x`` is ``ftp://host/x``)."""
        return _USERINFO.sub(r"\1", self.url)

    @property
    def name(self) -> str:
        return posixpath.basename(self.url)

    @property
    def parent(self) -> RemotePath:
        return RemotePath(
            posixpath.dirname(self.url), self._options, self._deadlines, health=self._health
        )

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}", self._options, self._deadlines, health=self._health)

    def __fspath__(self) -> str:
        return self.url

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"RemotePath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RemotePath):
            return self.url == other.url
        return isinstance(other, str) and other == self.url

    def __hash__(self) -> int:
        return hash(self.url)


def remote_path(
    path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None
) -> RemotePath:
    """``path`` (a URL) as a :class:`RemotePath`; one already is keeps its options unless
    ``storage_options`` are given (and its deadlines either way)."""
    if isinstance(path, RemotePath) and storage_options is None:
        return path
    options = (
        storage_options if storage_options is not None else getattr(path, "storage_options", None)
    )
    if isinstance(path, RemotePath):
        return RemotePath(path.url, options, path.deadlines, health=path.health)
    return RemotePath(os.fspath(path), options)


def _backend_options(directory: RemotePath, scheme: str) -> dict[str, Any]:
    """The storage options that reach ``directory``, with its deadlines applied: for S3,
    botocore's connect and read timeouts, and its retries off (the Store's are the only
    ones)."""
    options = directory.storage_options
    if scheme in ("s3", "s3a"):
        deadlines = directory.deadlines
        config = dict(options.get("config_kwargs") or {})
        config.update(
            connect_timeout=deadlines.connect_s,
            read_timeout=deadlines.read_s,
            retries={"total_max_attempts": 1},
        )
        options["config_kwargs"] = config
    return options


def derived(base: type, mixin: type | None) -> type:
    """``base``, or a class that derives from ``mixin`` and then ``base`` (a DCP reader
    with loopbus's safe index reading)."""
    return base if mixin is None else type(base.__name__, (mixin, base), {})


class Store:
    """The objects directly under the directory ``directory`` (a :class:`RemotePath`),
    by name.

    Every call is held to the directory's :class:`StoreDeadlines` and, when it fails, tried
    ``retries`` more times, waiting :data:`BACKOFF` seconds, then twice as long each time;
    a missing object or a refused permission is not tried again. A call that still fails
    raises :class:`CheckpointError` naming the URL and the cause on one line (a missing
    object raises ``FileNotFoundError``), the backend's error chained to it.

    A :class:`~loopbus.storage.Storage`: an object is written in place (no rename), so
    only a completeness marker says that it is whole."""

    noun = "object"
    renames = False

    def __init__(self, directory: RemotePath, *, retries: int = RETRIES) -> None:
        require_backend(directory.url)
        import fsspec.core

        self.directory = directory
        self.retries = retries
        self.deadlines = directory.deadlines
        scheme = _scheme(directory.url) or ""
        try:
            fs, root = fsspec.core.url_to_fs(directory.url, **_backend_options(directory, scheme))
        except ImportError as exc:
            raise MisconfigurationError(f"cannot use {directory.url}: {exc}") from exc
        except ValueError as exc:  # "Protocol not known"
            raise MisconfigurationError(
                f"cannot use {directory.url}: {exc}; pass a local path or a URL of a "
                "filesystem fsspec knows (s3://, gs://, az://, memory://, ...)."
            ) from exc
        if scheme in ("s3", "s3a"):
            fs.retries = 1  # s3fs's own retry loop: one try, the Store retries
        self.fs: Any = fs
        self.root: str = root.rstrip("/")

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def url(self, name: str) -> RemotePath:
        return self.directory / name

    path = url

    def crc32(self, name: str) -> None:
        """None: an object's CRC-32 would need a download."""
        return None

    @contextlib.contextmanager
    def local_copy(self, name: str, *, beside: Iterable[str] = ()) -> Iterator[Path]:
        """The object ``name`` downloaded into a temporary directory while the block
        runs, with the objects ``beside`` it (those missing left out)."""
        with tempfile.TemporaryDirectory(prefix="loopbus-download-") as staging:
            self.download(name, Path(staging) / name)
            for other in beside:
                with contextlib.suppress(FileNotFoundError):
                    self.download(other, Path(staging) / other)
            yield Path(staging) / name

    def modified(self, name: str) -> None:
        """None: only a marker's time of creation is trusted."""
        return None

    # ------------------------------------------------------------ deadlines, retries
    def _call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``fs.<method>(*args, **kwargs)``, abandoned after ``call_s``: an async
        filesystem's coroutine is cancelled on fsspec's event loop (which closes its
        connection); a blocking filesystem's call runs in a thread of its own, no longer
        waited for. Raises what the call raised, or ``TimeoutError`` at the deadline."""
        fs = self.fs
        seconds = self.deadlines.call_s
        coroutine = getattr(fs, f"_{method}", None) if getattr(fs, "async_impl", False) else None
        if coroutine is not None:
            future: concurrent.futures.Future[Any] = asyncio.run_coroutine_threadsafe(
                coroutine(*args, **kwargs), fs.loop
            )
        else:
            future = _in_thread(lambda: getattr(fs, method)(*args, **kwargs))
        health = self.directory.health
        deadline = time.monotonic() + seconds
        while True:  # a call given up on (the run ends in an outage) ends at once
            left = deadline - time.monotonic()
            done, _ = concurrent.futures.wait([future], timeout=max(0.0, min(left, 0.1)))
            if done:
                return future.result()
            if left <= 0 or (health is not None and health.given_up):
                future.cancel()
                raise Overdue(seconds)

    def _attempts(self, action: Callable[[], _T], tries: list[int]) -> _T:
        """``action()``, tried again up to ``retries`` times after a failure (waiting
        :data:`BACKOFF` seconds, then twice as long each time); the last failure is
        raised, and ``tries`` holds how many were made. A missing object, a refused
        permission and missing credentials are not retried. Each try's outcome is told
        to the directory's :class:`StoreHealth`, if it has one."""
        attempt = 0
        health = self.directory.health
        while True:
            tries[:] = [attempt + 1]
            try:
                result = action()
            except FileNotFoundError:
                if health is not None:
                    health.answered()
                raise
            except Exception as exc:
                if health is not None:
                    health.failed(describe_failure(exc))
                if attempt >= self.retries or not_retried(exc):
                    raise
                if health is None:
                    time.sleep(BACKOFF * 2**attempt)
                elif health.given_up or health.pause(BACKOFF * 2**attempt):
                    raise  # the run ends in an outage: no more tries
                attempt += 1
            else:
                if health is not None:
                    health.answered()
                return result

    def _tried(self, doing: str, name: str | None, action: Callable[[], _T]) -> _T:
        """``action()`` retried (see :meth:`_attempts`); a failure but a missing object
        raised as a :class:`CheckpointError` saying what was being done to which URL."""
        tries: list[int] = [1]
        try:
            return self._attempts(action, tries)
        except FileNotFoundError:
            raise
        except Exception as exc:
            where = (self.url(name) if name else self.directory).public_url
            times = f" ({tries[0]} tries)" if tries[0] > 1 else ""
            hint = fix_for(exc, where)
            raise CheckpointError(
                f"cannot {doing} {where}{times}: {describe_failure(exc)}; {hint}."
            ) from exc

    # ------------------------------------------------------------ reads
    def listing(self) -> dict[str, int]:
        """Every object directly in the directory, name -> size (fresh: fsspec's cache
        of listings is dropped first)."""
        return self.contents()[0]

    def contents(self) -> tuple[dict[str, int], set[str]]:
        """What is directly in the directory: its objects (name -> size) and the names of
        its prefixes ("subdirectories": a sharded checkpoint is one), fresh."""

        def ls() -> Any:
            self.fs.invalidate_cache(self.root)
            return self._call("ls", self.root, detail=True)

        try:
            entries = self._tried("list", None, ls)
        except FileNotFoundError:
            return {}, set()
        found: dict[str, int] = {}
        prefixes: set[str] = set()
        for entry in entries:
            name = posixpath.basename(str(entry["name"]).rstrip("/"))
            if entry.get("type") == "directory":
                prefixes.add(name)
            else:
                found[name] = int(entry.get("size") or 0)
        return found, prefixes

    def below(self, name: str) -> Store:
        """The directory ``name`` in this one (a prefix), with the same retries."""
        return Store(self.directory / name, retries=self.retries)

    def size(self, name: str) -> int | None:
        """The size of the object ``name``, None if there is none (or it is a prefix)."""
        key = self._key(name)

        def info() -> Any:
            self.fs.invalidate_cache(key)
            return self._call("info", key)

        try:
            found = self._tried("look up", name, info)
        except FileNotFoundError:
            return None
        return None if found.get("type") == "directory" else int(found["size"])

    def read_small(self, name: str) -> bytes:
        """The object ``name`` whole, if it is at most 1 MiB (a marker, a pointer); raises
        ``FileNotFoundError`` or ``ValueError``."""
        size = self.size(name)
        if size is None:
            raise FileNotFoundError(self.url(name).url)
        if size > MAX_SMALL_FILE:
            raise ValueError(
                f"it has {size} bytes, more than a marker or pointer may ({MAX_SMALL_FILE})"
            )
        data: bytes = self._tried("read", name, lambda: self._call("cat_file", self._key(name)))
        return data

    def download(self, name: str, local: str | os.PathLike[str]) -> None:
        """Download the object ``name`` to the local file ``local``."""
        self._tried(
            "download", name, lambda: self._call("get_file", self._key(name), os.fspath(local))
        )

    # ------------------------------------------------------------ writes
    def upload(self, local: str | os.PathLike[str], name: str) -> None:
        """Upload the local file ``local`` as the object ``name``."""
        self._tried(
            "upload", name, lambda: self._call("put_file", os.fspath(local), self._key(name))
        )

    def write(self, name: str, data: bytes) -> None:
        """Write the object ``name``."""
        self._tried("write", name, lambda: self._call("pipe_file", self._key(name), data))

    def publish(
        self,
        name: str,
        write: Callable[[IO[bytes]], _T],
        *,
        before: Callable[[], object] | None = None,
    ) -> _T:
        """Stage the object ``name`` in a local temporary file with ``write(file)``, run
        ``before()``, then upload it under its name (it appears whole or not at all), and
        return what ``write`` returned."""
        with tempfile.TemporaryDirectory(prefix="loopbus-upload-") as staging:
            staged = Path(staging) / "staged"
            with open(staged, "wb") as file:
                result = write(file)
            if before is not None:
                before()
            self.upload(staged, name)
        return result

    def remove_tree(self, name: str, *, first: str | None = None) -> None:
        """Delete every object under the prefix ``name`` (a missing one is ignored), the
        object ``first`` in it (a completeness marker) before the rest."""
        if first is not None:
            self.below(name).remove(first)

        def delete() -> None:
            key = self._key(name)
            self.fs.invalidate_cache(key)
            try:
                self._call("rm", key, recursive=True)
            except FileNotFoundError:
                pass

        self._tried("delete", name, delete)

    def remove_stale_temporaries(self) -> list[Path]:
        """None: an object is staged in a local temporary file and uploaded under its
        own name, never staged in the store."""
        return []

    @property
    def shown(self) -> str:
        return self.directory.public_url

    @property
    def health(self) -> StoreHealth | None:
        return self.directory.health

    def make_directory(self) -> None:
        """Nothing: an object store's directory is only a prefix of names."""

    def exists(self, name: str) -> bool:
        objects, prefixes = self.contents()
        return name in objects or name in prefixes

    def is_directory(self, name: str) -> bool:
        """Whether objects lie under the prefix ``name`` (and no object is so named)."""
        return self.size(name) is None and any(self.below(name).contents())

    def whole_without_marker(self) -> bool:
        """False: an object fills up under its final name; its marker says it is whole."""
        return False

    def holds(self, path: str | os.PathLike[str]) -> bool:
        return is_url(path) and remote_path(path).parent == self.directory

    def staging_name(self, name: str) -> str:
        """``name``: an object is uploaded under its own name."""
        return name

    def dcp_writer(self, name: str) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        where = self.url(name)
        return FsspecWriter(where.url, sync_files=False, **where.storage_options)

    def dcp_reader(self, name: str, *, mixin: type | None = None) -> Any:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        where = self.url(name)
        return derived(FsspecReader, mixin)(where.url, **where.storage_options)

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
        """Written in place (``staged`` is ``name``): the marker, written last, is what
        publishes it. A failure removes what was written of it, marker first, in one try."""
        if staged != name:
            raise ValueError(f"an object store writes {name!r} in place, not as {staged!r}")
        record = dict(info, checkpoint=name)
        try:
            return write_marked(self.below(name), plain, write_plain, marker, record)
        except CompletionFailed as failed:
            with contextlib.suppress(Exception):  # what is left has no marker: never complete
                Store(self.directory, retries=0).remove_tree(name, first=marker)
            raise failed.left(self.url(name), staged=False) from failed.cause

    def remove(self, name: str) -> None:
        """Delete the object ``name``; a missing one is ignored."""

        def delete() -> None:
            try:
                self._call("rm_file", self._key(name))
            except FileNotFoundError:
                pass

        self._tried("delete", name, delete)

    def read_tagged(self, name: str) -> tuple[bytes, str]:
        """The small object ``name`` (see :meth:`read_small`) and its version tag, which
        :meth:`write_if` takes: the store's ETag where it keeps one (S3), else a hash of
        the content. Raises ``FileNotFoundError``, ``ValueError`` or :class:`CheckpointError`
        (see :meth:`read_small`)."""
        import hashlib

        etag = None
        if self._conditional:  # the tag first: a write in between fails write_if
            key = self._key(name)
            self.fs.invalidate_cache(key)
            etag = self._call("info", key).get("ETag")
        data = self.read_small(name)
        return data, str(etag) if etag else hashlib.md5(data, usedforsecurity=False).hexdigest()

    def write_if(self, name: str, data: bytes, *, tag: str | None) -> str:
        """Write the object ``name`` only if there is none (``tag=None``) or it is still
        the version ``tag`` (from :meth:`read_tagged` or an earlier ``write_if``), and
        return the new version's tag. Raises ``FileExistsError`` when the object is
        there (``tag=None``) or another version, ``FileNotFoundError`` when it is gone.
        Atomic on S3 (conditional writes: ``If-None-Match: *``, ``If-Match: <ETag>``);
        elsewhere a check, then the write. Held to ``call_s`` (``TimeoutError``), not
        retried: a caller decides again."""
        import hashlib

        key = self._key(name)
        if tag is None:
            result = self._call("pipe_file", key, data, mode="create")
        elif self._conditional:
            try:
                result = self._call("pipe_file", key, data, IfMatch=tag)
            except OSError as exc:
                if not isinstance(exc, FileNotFoundError) and self._precondition_failed(exc):
                    raise FileExistsError(f"{self.url(name)} is not version {tag}") from exc
                raise
        else:
            if self.read_tagged(name)[1] != tag:
                raise FileExistsError(f"{self.url(name)} is not version {tag}")
            result = self._call("pipe_file", key, data)
        self.fs.invalidate_cache(key)
        etag = result.get("ETag") if isinstance(result, dict) else None
        return str(etag) if etag else hashlib.md5(data, usedforsecurity=False).hexdigest()

    @property
    def _conditional(self) -> bool:
        """Whether the store writes conditionally on an ETag (S3 and its look-alikes)."""
        protocol = getattr(self.fs, "protocol", ())
        return "s3" in ((protocol,) if isinstance(protocol, str) else tuple(protocol))

    @staticmethod
    def _precondition_failed(exc: BaseException) -> bool:
        """Whether ``exc`` (or what it was raised from) is a store's 412 "precondition
        failed"."""
        seen: BaseException | None = exc
        while seen is not None:
            error = getattr(seen, "response", None)
            code = error.get("Error", {}).get("Code") if isinstance(error, dict) else None
            if code in ("PreconditionFailed", "412"):
                return True
            seen = seen.__cause__ or seen.__context__
        return False


def _in_thread(call: Callable[[], _T]) -> concurrent.futures.Future[_T]:
    """``call()`` started in a daemon thread of its own (one that outlives its deadline
    never holds up the process's exit); its future."""
    future: concurrent.futures.Future[_T] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(call())
        except BaseException as exc:  # handed to the waiting caller
            future.set_exception(exc)

    threading.Thread(target=run, name="loopbus-store-call", daemon=True).start()
    return future
