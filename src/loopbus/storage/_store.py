"""Object storage through fsspec: which paths are URLs, the package a URL's scheme
needs, a URL that carries its storage options, and a directory of objects with the few
operations checkpoints use (list with sizes, read, write, upload, download, delete a
object or a whole prefix),
each retried with exponential backoff where asked.

fsspec is imported only when a URL is used: a local path never reaches this module's
imports. Storage options (credentials, endpoints) live in memory only: a
:class:`RemotePath` shows its URL in ``str``, ``repr`` and messages, never its options.
"""

from __future__ import annotations

import importlib.util
import os
import posixpath
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from .._exceptions import MisconfigurationError
from .._untrusted import MAX_SMALL_FILE
from .._validate import _URL

__all__ = ["RemotePath", "Store", "is_url", "remote_path", "require_backend"]

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
    places, such as ``AWS_*`` variables and ``~/.aws``). Its ``str`` and ``repr`` are
    the URL alone: the options are never shown, logged or written anywhere."""

    __slots__ = ("_options", "url")

    def __init__(self, url: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> None:
        text = os.fspath(url)
        if _scheme(text) is None:
            raise MisconfigurationError(f"RemotePath needs a URL such as 's3://bucket/run', got {text!r}.")
        self.url = text.rstrip("/") if text.count("/") > 2 else text
        self._options = dict(storage_options or {})

    @property
    def storage_options(self) -> dict[str, Any]:
        """The storage options (a copy)."""
        return dict(self._options)

    @property
    def name(self) -> str:
        return posixpath.basename(self.url)

    @property
    def parent(self) -> RemotePath:
        return RemotePath(posixpath.dirname(self.url), self._options)

    @property
    def suffix(self) -> str:
        return posixpath.splitext(self.name)[1]

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(f"{self.url}/{name}", self._options)

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


def remote_path(path: str | os.PathLike[str], storage_options: Mapping[str, Any] | None = None) -> RemotePath:
    """``path`` (a URL) as a :class:`RemotePath`; one already is keeps its options unless
    ``storage_options`` are given."""
    if isinstance(path, RemotePath) and storage_options is None:
        return path
    options = storage_options if storage_options is not None else getattr(path, "storage_options", None)
    return RemotePath(os.fspath(path), options)


class Store:
    """The objects directly under the directory ``directory`` (a :class:`RemotePath`),
    by name. Writes are retried ``retries`` times with exponential backoff
    (:data:`BACKOFF`, doubled each time); reads are not (a reader is asked again)."""

    def __init__(self, directory: RemotePath, *, retries: int = 0) -> None:
        require_backend(directory.url)
        import fsspec.core

        self.directory = directory
        self.retries = retries
        try:
            fs, root = fsspec.core.url_to_fs(directory.url, **directory.storage_options)
        except ImportError as exc:
            raise MisconfigurationError(f"cannot use {directory.url}: {exc}") from exc
        except ValueError as exc:  # "Protocol not known"
            raise MisconfigurationError(
                f"cannot use {directory.url}: {exc}; pass a local path or a URL of a "
                "filesystem fsspec knows (s3://, gs://, az://, memory://, ...)."
            ) from exc
        self.fs: Any = fs
        self.root: str = root.rstrip("/")

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}"

    def url(self, name: str) -> RemotePath:
        return self.directory / name

    def retried(self, action: Callable[[], _T]) -> _T:
        """``action()``, tried again up to ``retries`` times after a failure (waiting
        :data:`BACKOFF` seconds, then twice as long each time); the last failure is
        raised. A missing object or a refused permission is not retried."""
        attempt = 0
        while True:
            try:
                return action()
            except (FileNotFoundError, PermissionError):
                raise
            except Exception:
                if attempt >= self.retries:
                    raise
                time.sleep(BACKOFF * 2**attempt)
                attempt += 1

    def listing(self) -> dict[str, int]:
        """Every object directly in the directory, name -> size (fresh: fsspec's cache
        of listings is dropped first)."""
        return self.contents()[0]

    def contents(self) -> tuple[dict[str, int], set[str]]:
        """What is directly in the directory: its objects (name -> size) and the names of
        its prefixes ("subdirectories": a sharded checkpoint is one), fresh."""
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=True)
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
        self.fs.invalidate_cache(key)
        try:
            info = self.fs.info(key)
        except FileNotFoundError:
            return None
        return None if info.get("type") == "directory" else int(info["size"])

    def read_small(self, name: str) -> bytes:
        """The object ``name`` whole, if it is at most 1 MiB (a marker, a pointer); raises
        ``FileNotFoundError`` or ``ValueError``."""
        size = self.size(name)
        if size is None:
            raise FileNotFoundError(self.url(name).url)
        if size > MAX_SMALL_FILE:
            raise ValueError(f"it has {size} bytes, more than a marker or pointer may ({MAX_SMALL_FILE})")
        data: bytes = self.fs.cat_file(self._key(name))
        return data

    def download(self, name: str, local: str | os.PathLike[str]) -> None:
        self.fs.get_file(self._key(name), os.fspath(local))

    def upload(self, local: str | os.PathLike[str], name: str) -> None:
        """Upload the local file ``local`` as the object ``name`` (retried)."""
        self.retried(lambda: self.fs.put_file(os.fspath(local), self._key(name)))

    def write(self, name: str, data: bytes) -> None:
        """Write the object ``name`` (retried)."""
        self.retried(lambda: self.fs.pipe_file(self._key(name), data))

    def remove_tree(self, name: str) -> None:
        """Delete every object under the prefix ``name`` (a missing one is ignored;
        retried)."""

        def delete() -> None:
            key = self._key(name)
            self.fs.invalidate_cache(key)
            try:
                self.fs.rm(key, recursive=True)
            except FileNotFoundError:
                pass

        self.retried(delete)

    def remove(self, name: str) -> None:
        """Delete the object ``name``; a missing one is ignored (retried)."""

        def delete() -> None:
            try:
                self.fs.rm_file(self._key(name))
            except FileNotFoundError:
                pass

        self.retried(delete)
