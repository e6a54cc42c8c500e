"""Loading checkpoints: any checkpoint a path names, as one dict, read safely; the
checkpoint a fit resumes from, into the registry's parts; a checkpoint's weights alone,
into a module.

A checkpoint file is read with ``torch.load(..., weights_only=True)`` only, so a file
holding pickled Python objects is refused and nothing from it runs. It is first checked
against its completeness marker (size and CRC-32) when it has one and vetted as
untrusted input (``_diagnose.py``); then the nesting of what it holds and its header
(format, version) are checked. A sharded checkpoint's directory is read through
``_sharded_load.py``: consolidated into the same dict, or loaded shard by shard for a
resume.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import anyio.to_thread
import torch

from loopbus.state._runstate import ResumePlan
from loopbus.step._params import has_sharded_parameters

from .._exceptions import CheckpointError
from ..storage import LocalStore, located, location
from ._diagnose import _load_failed, _sniff, check_loaded
from ._format import (
    MARKER_SUFFIX,
    Marker,
    PathLike,
    check_header,
    file_crc32,
    is_sharded_checkpoint,
    marker_path,
    read_marker,
)
from ._locate import resolve_checkpoint
from ._parts import CheckpointMismatch, ModulePart, load_state

__all__ = ["load_checkpoint", "load_weights", "read_for_resume"]


def load_checkpoint(
    path: PathLike,
    *,
    map_location: Any = "cpu",
    verify: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Read a checkpoint written by loopbus, safely.

    ``path`` is a checkpoint file, a sharded checkpoint's directory (consolidated here,
    in this process, into the same full dict a file holds), a directory (its last
    checkpoint) or a ``last.json`` pointer. The file is read with ``torch.load(..., weights_only=True)``: a file holding
    pickled Python objects is refused and nothing from it runs. With ``verify`` the file
    is first checked against its completeness marker (size and CRC-32) when it has one.
    Raises :class:`CheckpointError` naming the file and what is wrong with it for a
    missing, empty, foreign (not a torch.save file), truncated or corrupt, refused
    (pickled objects) or newer checkpoint; a file that is not a torch.save container is
    never handed to an unpickler.

    ``path`` may be a URL (``s3://bucket/run/x.ckpt``, or the directory ``s3://bucket/run``
    for its last complete checkpoint), reached with the fsspec ``storage_options`` (None:
    the backend's standard credentials; a :class:`~loopbus.RemotePath` carries its own).
    The object is downloaded to a temporary file and read as above.
    """
    found = resolve_checkpoint(location(path, storage_options))
    store, name = located(found)
    if store.size(name) is None:  # a sharded checkpoint: its shards read, consolidated here
        from ._sharded_load import consolidate  # (on first use: see the package's doc)

        return consolidate(found)
    with contextlib.ExitStack() as stack:
        beside = (name + MARKER_SUFFIX,) if verify else ()
        try:
            file = stack.enter_context(store.local_copy(name, beside=beside))
        except Exception as exc:
            raise CheckpointError(
                f"cannot download the checkpoint {found}: {type(exc).__name__}: {exc}"
            ) from exc
        try:
            return _load_file(file, map_location, verify)
        except CheckpointError as exc:  # name the checkpoint, not the copy that was read
            message = str(exc).replace(str(file), str(found))
            message = message.replace(str(file.parent), str(found.parent))
            if message == str(exc):
                raise
            raise CheckpointError(message) from exc


def _load_file(file: Path, map_location: Any, verify: bool) -> dict[str, Any]:
    """:func:`load_checkpoint` of the local checkpoint file ``file``."""
    if verify:
        _verify(file)
    container = _sniff(file)
    try:
        state = torch.load(file, map_location=map_location, weights_only=True)
    except Exception as exc:
        _load_failed(file, container, exc)
    check_loaded(state, file)
    check_header(state, str(file))
    return state  # type: ignore[no-any-return]


def _verify(file: Path) -> None:
    info = read_marker(LocalStore(file.parent), marker_path(file).name)
    if info is None:
        return
    try:
        _check_against_marker(file, info)
    except OSError as exc:
        raise CheckpointError(f"cannot read the checkpoint {file}: {exc}") from exc


def _check_against_marker(file: Path, info: Marker) -> None:
    size = file.stat().st_size
    expected = info.size
    if size != expected:
        raise CheckpointError(
            f"the checkpoint {file} is torn or truncated: its completeness marker records "
            f"{expected} bytes but the file has {size}. It was not written completely (or was "
            "modified after it was written); load another checkpoint, for example the "
            "previous one in the same directory."
        )
    if file_crc32(file) != info.crc32:
        raise CheckpointError(
            f"the checkpoint {file} is corrupted: its CRC-32 does not match the one its "
            "completeness marker recorded when it was written. Load another checkpoint, for "
            "example the previous one in the same directory."
        )


async def read_for_resume(
    parts: Mapping[str, Any], path: str | os.PathLike[str], world_size: int, strict: bool
) -> tuple[CheckpointMismatch, ResumePlan]:
    """Load the checkpoint ``fit(ckpt_path=...)`` resumes from into a registry's parts: a
    sharded one on every rank (:func:`load_sharded`), a file read in a worker thread."""
    if is_sharded_checkpoint(path):
        from ._sharded_load import load_sharded  # (on first use: see the package's doc)

        return load_sharded(parts, path, world_size=world_size, strict=strict)
    module = parts["module"].module if "module" in parts else None
    if module is not None and has_sharded_parameters(module.parameters()):
        raise CheckpointError(
            f"{path} is a checkpoint file (full tensors) and this run shards the module "
            "(FSDP): its optimizer state is keyed by position over full parameters, which "
            "cannot be resumed onto shards. Resume it under strategy='ddp' or in one "
            "process, or load only its weights (validate/test/predict with ckpt_path=..., "
            "or Module.load_from_checkpoint before fit); checkpoints taken under FSDP are "
            "sharded directories and resume at any world size."
        )
    state = await anyio.to_thread.run_sync(load_checkpoint, path)
    return load_state(parts, state, strict=strict, source=str(path))


def load_weights(path: str | os.PathLike[str], module: torch.nn.Module) -> None:
    """Load the weights (only those) of the checkpoint at ``path`` into ``module``."""
    state = load_checkpoint(path)
    weights: dict[str, Any] = {k: state[k] for k in ("loopbus", "module") if k in state}
    load_state({"module": ModulePart(module)}, weights, strict=True, source=str(path))
