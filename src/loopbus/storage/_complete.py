"""Completing a sharded checkpoint, the part both backends share: its plain state
written into its directory, then its completeness marker, which records every entry's
size; and :class:`CompletionFailed`, what a store raises when that (or, where a rename
publishes the directory, the rename) fails, saying what failed and what was removed.

The verb itself is each backend's ``complete_sharded``
(:meth:`~loopbus.storage.Storage.complete_sharded`): a local directory is staged under
a temporary name and renamed into place once marked; an object store's is written in
place, and its marker is what publishes it.

Imports the standard library only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, Protocol

__all__ = ["CompletionFailed", "write_marked"]


class CompletionFailed(Exception):
    """A sharded checkpoint that could not be completed, and what is left of it.

    ``entry`` is the entry being written when it failed: the plain state's (its listing
    included), then the marker's; None when the directory was complete but could not be
    renamed into place. ``cause`` is the error. ``removed`` is what was removed of the
    checkpoint: its staging directory where it was ``staged`` under a temporary name (the
    directory of its name, if any, is then as it was), else the checkpoint itself,
    written in place (a removal that fails is not retried: what is left has no marker).
    ``aside`` is where a directory of that name that was moved aside for the rename
    still is, when it could not be moved back (None otherwise)."""

    def __init__(
        self,
        entry: str | None,
        cause: BaseException,
        *,
        removed: os.PathLike[str] | None = None,
        staged: bool = False,
        aside: Path | None = None,
    ) -> None:
        super().__init__(f"writing {entry} failed: {cause}" if entry else f"renaming: {cause}")
        self.entry = entry
        self.cause = cause
        self.removed = removed
        self.staged = staged
        self.aside = aside

    def left(self, removed: os.PathLike[str], *, staged: bool) -> CompletionFailed:
        """This error, once its store removed ``removed`` (``staged``: a staging
        directory, rather than the checkpoint written in place)."""
        self.removed = removed
        self.staged = staged
        return self


class _Directory(Protocol):
    """What :func:`write_marked` needs of a store's directory."""

    def publish(self, name: str, write: Callable[[IO[bytes]], Any]) -> Any: ...

    def listing(self) -> dict[str, int]: ...

    def write(self, name: str, data: bytes) -> None: ...


def write_marked(
    inside: _Directory,
    plain: str,
    write_plain: Callable[[IO[bytes]], object] | None,
    marker: str,
    record: dict[str, Any],
) -> dict[str, Any]:
    """Write the entry ``plain`` of the directory ``inside`` with ``write_plain(file)``
    (none without it), then its marker ``marker``: ``record`` with ``files``, the size
    of every entry in it but the marker, as JSON. Returns what the marker records.
    Raises :class:`CompletionFailed` naming the entry being written (nothing is removed
    here: the store says what it removes)."""
    entry = plain
    try:
        if write_plain is not None:
            inside.publish(plain, write_plain)
        listed = inside.listing()
        files = {name: size for name, size in sorted(listed.items()) if name != marker}
        sealed = dict(record, files=files)
        entry = marker
        inside.write(marker, json.dumps(sealed, indent=1, sort_keys=True).encode())
    except Exception as exc:
        raise CompletionFailed(entry, exc) from exc
    return sealed
