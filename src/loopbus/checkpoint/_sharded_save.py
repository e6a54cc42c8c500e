"""Saving sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

A sharded checkpoint is a directory. Every rank writes its own shards of the module's
weights, the optimizers' state and gradients held mid-accumulation (``dcp.save``, or
``dcp.async_save``: the step waits only while the state is staged to host memory, the
files are written by a background thread); rank 0 adds everything else the registry
holds (loop progress, every rank's generators, the loader's position, schedulers,
plugins, hyperparameters, records) as one plain file, ``loopbus_state.pt``, read with
``torch.load(..., weights_only=True)``::

    epoch=0-step=10.ckpt/          the checkpoint's name, as for a file checkpoint
      .metadata                    DCP: which shard holds what
      __0_0.distcp, __1_0.distcp   DCP: each rank's shards
      loopbus_state.pt             the header and the parts that are not sharded
      loopbus.complete             the completeness marker (JSON: every file's size)

It is written under a temporary name (``.<name>.tmp-<pid>-<random>@<host>``, rank 0's
process); once DCP reports the save finished on every rank (its closing collective has
every rank's write results), rank 0 writes the marker into it and only then renames it
to its name. A checkpoint is therefore complete or absent: ``ckpt_path="last"`` and the
scan for the newest see only complete ones, and a temporary whose writer died is removed
by the next run's ``Checkpoint`` plugin. Loading and consolidation: ``_sharded_load.py``.

To a URL (``s3://bucket/run/epoch=0-step=10.ckpt``) every rank writes its shards straight
to the store through DCP's fsspec writer, under the checkpoint's own prefix (an object
store has no rename); rank 0 then uploads ``loopbus_state.pt``, lists the prefix and
writes the marker last, then ``last.json``. A reader takes the checkpoint only with its
marker, every object of the size it records: one whose writers died is never complete.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio.to_thread
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from .._exceptions import CheckpointError
from ..storage import CompletionFailed, RemotePath, Storage, located, location
from ._clean import remove_remote_tree
from ._format import (
    LAST_POINTER,
    SHARDED_MARKER,
    SHARDED_STATE,
    describe_os_error,
    marker_config,
    pointer_to,
)
from ._parts import collect_state, qualname
from ._registry import CheckpointRegistry, RegistrySource
from ._write import (
    _cause,
    _json_bytes,
    _pointer_state,
    find_os_error,
    save_plain,
    to_plain,
)

__all__ = [
    "LAYOUT",
    "ShardedCheckpointWriter",
    "ShardedSave",
    "is_tensor_part",
    "no_full_state",
    "save_sharded",
    "save_sharded_async",
]

#: What a sharded checkpoint's marker says it is.
LAYOUT = "sharded"


def is_tensor_part(key: str) -> bool:
    """Whether a registry part is written through DCP (sharded) rather than into the
    plain state file."""
    return key in ("module", "grads") or key.startswith("optimizers/")


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _tensor_state(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> Any:
    """What DCP writes: the module's and the optimizers' state dicts as
    ``torch.distributed.checkpoint.state_dict`` gives them (keyed by parameter name;
    local shards of DTensors under FSDP), and the gradients held mid-accumulation."""
    if optimizers:
        model, optim = get_state_dict(module, optimizers)
    else:
        model, optim = get_model_state_dict(module), {}
    grads = {n: p.grad for n, p in module.named_parameters() if p.grad is not None}
    return {"module": model, "optim": optim, "grads": grads}


def _shards_failed(target: Path | RemotePath, staged: bool, exc: BaseException) -> CheckpointError:
    """A failed write of a sharded checkpoint's shards (``dcp.save``, ``dcp.async_save``)
    as a :class:`CheckpointError` naming the checkpoint and the cause: a file system's
    error (a full disk) as what it says, not as the ``RuntimeError`` torch makes of it
    nor DCP's report of every rank's traceback. ``staged``: whether its store stages it
    under a temporary name (:attr:`~loopbus.storage.Storage.renames`) rather than
    writing it in place."""
    error = find_os_error(exc)
    if error is not None:
        cause = describe_os_error(error)
    else:
        inner = [f[0] if isinstance(f, tuple) else f for f in getattr(exc, "failures", {}).values()]
        shown = inner[0] if inner and isinstance(inner[0], BaseException) else exc
        cause = f"{type(shown).__name__}: {shown}"
    if not staged:  # written in place: no marker, no reader
        return CheckpointError(
            f"could not write the shards of the sharded checkpoint {target}: {cause}. It "
            "was not completed (it has no marker, so no reader takes it), what was written "
            f"of it is removed, and {_pointer_state(target.parent)}."
        )
    return CheckpointError(
        f"could not write the shards of the sharded checkpoint {target}: {cause}. It was not "
        f"completed, so nothing was replaced: the checkpoints in {target.parent} (one of that "
        f"name included) are unchanged, its temporary directory is removed, and "
        f"{_pointer_state(target.parent)}."
    )


def _completion_failed(
    target: Path | RemotePath, failed: CompletionFailed, retries: int
) -> CheckpointError:
    """Why the sharded checkpoint ``target`` could not be completed, as its store's
    :class:`~loopbus.storage.CompletionFailed` says, and what is left since: an entry
    that could not be written (its staging directory removed, or what was written in
    place, after ``retries`` retries), or the rename into place that failed."""
    pointer = _pointer_state(target.parent)
    cause = _cause(failed.cause)
    if failed.entry is None:  # complete, but not renamed into place
        kept = (
            f"the previous checkpoint of that name is still at {failed.aside}: rename it back"
            if failed.aside is not None
            else f"the checkpoints in {target.parent} are unchanged"
        )
        return CheckpointError(
            f"could not rename the complete sharded checkpoint {failed.removed} to {target}: "
            f"{cause}. It is removed; {kept}; {pointer}."
        )
    if failed.staged:
        return CheckpointError(
            f"could not complete the sharded checkpoint {target}: writing {failed.entry} "
            f"failed: {cause}. It was never published: its temporary directory is removed, "
            f"and the checkpoints in {target.parent} (one of that name included) are "
            f"unchanged; {pointer}."
        )
    return CheckpointError(
        f"could not complete the sharded checkpoint {target}: writing {failed.entry} failed "
        f"after {retries} retries: {cause}. It has no marker, so no reader takes it; what "
        f"was written of it is removed, and {pointer}."
    )


def _point_last(store: Storage, target: Path | RemotePath, info: Mapping[str, Any]) -> None:
    """Move the ``last.json`` of ``store`` to the complete sharded checkpoint ``target``,
    whose marker records ``info``."""
    try:
        store.write(LAST_POINTER, _json_bytes(pointer_to(target, info)))
    except (OSError, CheckpointError) as exc:
        pointer = target.parent / LAST_POINTER
        if store.renames:  # renamed into place (a local directory): loads by its path
            raise CheckpointError(
                f"the sharded checkpoint {target} is complete, but the pointer {pointer} "
                f"could not be moved to it: {_cause(exc)}. The checkpoint loads by its path; "
                f"{_pointer_state(target.parent)}."
            ) from exc
        raise CheckpointError(
            f"the sharded checkpoint {target} is complete, but {pointer} could not be moved "
            f"to it: {_cause(exc)}. The checkpoint loads by its URL."
        ) from exc


def _discard(temp: Path | RemotePath) -> None:
    """Remove what was written of a checkpoint that will not be completed: its temporary
    directory, or under a URL its prefix (marker first; the store may be what failed)."""
    with contextlib.suppress(Exception):  # one try: what is left is never complete
        store, name = located(temp, retries=0)
        remove_remote_tree(store, name)


class ShardedSave:
    """One sharded save: written (``dcp.save``) or being written (``dcp.async_save``).

    :meth:`wait` waits until this rank's shards are written; on rank 0 it then makes the
    checkpoint complete (marker, rename, ``last.json``). Call it on every rank before the
    next save (the plugin does)."""

    def __init__(
        self,
        target: Path | RemotePath,
        temp: Path | RemotePath,
        future: Future[Any] | None,
        *,
        writer_rank: bool,
        info: dict[str, Any],
        update_last: bool,
        plain: dict[str, Any] | None = None,
        retries: int = 0,
    ) -> None:
        self.path = target
        self.retries = retries
        self.plain = plain
        self.temp = temp
        self.future = future
        self.writer_rank = writer_rank
        self.info = info
        self.update_last = update_last
        self._finished = False

    def done(self) -> bool:
        """Whether this rank's shards are written (it does not wait)."""
        return self.future is None or self.future.done()

    def wait(self) -> Path | RemotePath:
        """Wait for this rank's shards; on rank 0 then complete the checkpoint. Returns
        its path (a :class:`~loopbus.RemotePath` for a URL). Raises
        :class:`CheckpointError` if the write failed."""
        if self._finished:
            return self.path
        store, name = located(self.path, retries=self.retries)
        if self.future is not None:
            try:
                self.future.result()
            except (Exception, CheckpointException) as exc:
                if self.writer_rank:
                    _discard(self.temp)
                raise _shards_failed(self.path, store.renames, exc) from exc
        if self.writer_rank:
            plain, self.plain = self.plain, None  # host copies, taken at the save
            try:
                info = store.complete_sharded(
                    self.temp.name,
                    name,
                    plain=SHARDED_STATE,
                    write_plain=None if plain is None else functools.partial(save_plain, plain),
                    marker=SHARDED_MARKER,
                    info=self.info,
                )
            except CompletionFailed as failed:
                raise _completion_failed(self.path, failed, self.retries) from failed.cause
            if self.update_last:
                _point_last(store, self.path, info)
        self._finished = True
        return self.path


def _storage_writer(where: Path | RemotePath) -> Any:
    """DCP's writer for ``where``: its file-system writer, or for a URL its fsspec writer
    with the URL's storage options (no fsync: an object is whole once written)."""
    store, name = located(where)
    return store.dcp_writer(name)


def _write_shards(
    tensors: Any, temp: Path | RemotePath, group: Any, asynchronous: bool
) -> Future[Any] | None:
    """Every rank writes its shards into ``temp``: ``dcp.async_save`` (returns once the
    state is staged) or ``dcp.save``. In one process (no process group) DCP's entry
    points only warn that there is none; its writer is called directly, in a thread of
    its own after a host copy when asynchronous."""
    if group is not None:
        writer = _storage_writer(temp)
        if asynchronous:
            return dcp_async_save(tensors, storage_writer=writer, process_group=group)  # type: ignore[return-value]
        dcp_save(tensors, storage_writer=writer, process_group=group)
        return None

    def write(state: Any) -> None:
        _save_state_dict(state, storage_writer=_storage_writer(temp), no_dist=True)

    if not asynchronous:
        write(tensors)
        return None
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loopbus-dcp")
    future = pool.submit(write, to_plain(tensors, copy=True, where="the sharded state"))
    pool.shutdown(wait=False)
    return future


class ShardedCheckpointWriter:
    """Writes sharded checkpoints of a trainer's run (see the module docstring).

    Under a process group its collectives run on a gloo group of their own, made at the
    first save (every rank saves together), so that an asynchronous save's background
    thread never interleaves with the step's collectives."""

    def __init__(self) -> None:
        self._group: Any = None

    def _process_group(self) -> Any:
        if not _distributed():
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def save(
        self,
        run: CheckpointRegistry | RegistrySource,
        path: str | os.PathLike[str],
        *,
        asynchronous: bool = False,
        update_last: bool = False,
        fresh: bool = False,
        retries: int = 0,
    ) -> ShardedSave:
        """Start a sharded save of a run to the directory ``path``: of a trainer's (its
        ``checkpoint_registry()``) or of a :class:`CheckpointRegistry`. Every rank calls
        it at the same boundary. With ``asynchronous`` it returns once the state is
        staged to host memory (``dcp.async_save``); otherwise once this rank's shards are
        written. Either way the checkpoint is complete only after :meth:`ShardedSave.wait`
        (on rank 0).

        ``path`` may be a URL (a :class:`~loopbus.RemotePath` carries storage options):
        the shards go straight to the store, under the checkpoint's prefix; a checkpoint
        of that name there is deleted first (marker first), unless the caller knows the
        name is ``fresh``. Rank 0's uploads keep the URL's deadlines, ``retries`` retries."""
        registry = run if isinstance(run, CheckpointRegistry) else run.checkpoint_registry()
        strategy = registry.strategy
        zero = strategy.is_global_zero
        target: Path | RemotePath
        temp: Path | RemotePath
        where = location(path, owner=f"a sharded checkpoint to {os.fspath(path)}")
        store, name = located(where, retries=retries)
        target = store.path(name)
        staged = strategy.broadcast_object(store.staging_name(name) if zero else None)
        temp = store.path(staged)
        if staged == name and not fresh:  # written in place: the old one goes first
            if zero:
                remove_remote_tree(store, name)
            strategy.barrier()  # and no rank writes before it is gone
        module = registry.module
        if module is None:
            raise CheckpointError("there is no module to save yet: fit has not started.")
        optimizers = list(registry.optimizers)
        state = _plain_state(registry, module, optimizers)
        tensors = _tensor_state(module, optimizers)
        if registry.weights is not None:  # saved as the module's (checkpoint_weights_from)
            tensors["module"] = get_model_state_dict(registry.weights)
        try:
            future = _write_shards(tensors, temp, self._process_group(), asynchronous)
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            if zero:
                _discard(temp)
            raise _shards_failed(target, store.renames, exc) from exc
        return ShardedSave(
            target,
            temp,
            future,
            writer_rank=zero,
            info=_sharded_marker(state["loopbus"]),
            update_last=update_last,
            plain=state if zero else None,
            retries=retries,
        )


def _plain_state(
    registry: CheckpointRegistry,
    module: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
) -> dict[str, Any]:
    """What rank 0 writes as ``loopbus_state.pt``: host copies of the parts that are not
    sharded (collective: it gathers every rank's generators), under a header that lists
    every part and says what the shards hold (world size, strategy, each optimizer's
    class and parameter groups, the parameters that hold gradients)."""
    strategy = registry.strategy
    plain = registry.only(lambda key: not is_tensor_part(key))
    state = collect_state(plain, to_host=True)  # gathers every rank's generators
    header = state["loopbus"]
    header["parts"] = list(registry.parts)
    header["layout"] = LAYOUT
    grads = [n for n, p in module.named_parameters() if p.grad is not None]
    header["sharded"] = {
        "world_size": strategy.world_size,
        "strategy": strategy.name,
        "optimizers": [
            {"class": qualname(type(o)), "groups": len(o.param_groups)} for o in optimizers
        ],
        "grads": grads,
    }
    return state


def _sharded_marker(header: Mapping[str, Any]) -> dict[str, Any]:
    """What the completeness marker of the sharded checkpoint whose plain state has this
    ``header`` records, but for its files (listed once they are written)."""
    return {
        "format": header["format"],
        "format_version": header["format_version"],
        "layout": LAYOUT,
        "global_step": header["global_step"],
        "epoch": header["epoch"],
        "created": header["created"],
        "world_size": header["sharded"]["world_size"],
        "strategy": header["sharded"]["strategy"],
        **marker_config(header),
    }


def no_full_state(strategy: str) -> CheckpointError:
    """Why ``Trainer.state_dict()`` has no answer under a strategy that shards the module."""
    return CheckpointError(
        f"trainer.state_dict() under strategy={strategy!r}: every rank holds only its "
        "shards of the module and optimizer state. Use trainer.save_checkpoint(path) (a "
        "sharded checkpoint, every rank writing its shards) and "
        "loopbus.consolidate_checkpoint(path, out) for one full file."
    )


def save_sharded(registry: CheckpointRegistry, path: str | os.PathLike[str]) -> Path | RemotePath:
    """``Trainer.save_checkpoint`` under a strategy that shards the module's state: a
    sharded checkpoint of ``registry`` in the directory ``path`` (or under a URL),
    every rank writing its shards; returns on every rank once the checkpoint is
    complete."""
    target = ShardedCheckpointWriter().save(registry, path).wait()
    registry.strategy.barrier()
    return target


async def save_sharded_async(
    registry: CheckpointRegistry, path: str | os.PathLike[str]
) -> Path | RemotePath:
    """:func:`save_sharded`, the state staged to host memory first and the shards
    written in the background (``dcp.async_save``); the event loop stays free."""
    pending = ShardedCheckpointWriter().save(registry, path, asynchronous=True)
    target = await anyio.to_thread.run_sync(pending.wait)
    registry.strategy.barrier()
    return target
