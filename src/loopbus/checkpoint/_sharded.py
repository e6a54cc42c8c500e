"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP).

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
by the next run's ``Checkpoint`` plugin.

Loading for a resume (:func:`load_sharded`) lets DCP read each rank's part of every
tensor, whatever the world size or the sharding at save time; :func:`consolidate` reads
all shards in one process (no process group) into one full checkpoint dict, the same
as a file checkpoint's.

Non-tensor values DCP saves inside its shard files (the optimizers' parameter groups)
are read with ``torch.load(..., weights_only=True)`` too, and the shard index
(``.metadata``, a pickle that DCP itself reads with ``pickle.load``) by an unpickler that
finds only the classes an index is made of: nothing else is unpickled. The completeness
marker and what the state file holds are bounded as for a file checkpoint
(``_checkpoint_io.py``).
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import msgspec
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from loopbus.state._runstate import ResumePlan

from .._durable import fsync_dir
from .._exceptions import CheckpointError
from .._untrusted import check_state_nesting
from ._files import (
    LAST_POINTER,
    SHARDED_MARKER,
    SHARDED_STATE,
    Marker,
    _pointer_state,
    _refusal,
    _temp_path,
    _write_durably,
    _write_json,
    check_header,
    check_loaded,
    describe_os_error,
    find_os_error,
    is_sharded_checkpoint,
    load_checkpoint,
    read_json,
    save_plain,
    to_plain,
    write_checkpoint,
)
from ._parts import (
    CheckpointMismatch,
    _check,
    collect_state,
    has_sharded_parameters,
    load_state,
    own_class,
    qualname,
)

if TYPE_CHECKING:
    from loopbus.stage._trainer import Trainer

__all__ = [
    "ShardedCheckpointWriter",
    "ShardedSave",
    "consolidate",
    "consolidate_checkpoint",
    "load_sharded",
    "no_full_state",
    "save_sharded",
    "save_sharded_async",
    "verify_sharded",
]

#: What a sharded checkpoint's marker says it is.
LAYOUT = "sharded"


def is_tensor_part(key: str) -> bool:
    """Whether a registry part is written through DCP (sharded) rather than into the
    plain state file."""
    return key in ("module", "grads") or key.startswith("optimizers/")


# ---------------------------------------------------------------- safe reading


class _WeightsOnlyBytes:
    """DCP's planners read the non-tensor values of a checkpoint with ``torch.load``
    and ``weights_only=False``; these read them weights-only."""

    flatten_state_dict: bool
    mappings: Any
    original_state_dict: Any
    state_dict: Any

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as exc:
            raise CheckpointError(
                f"refusing the entry {fqn!r} of a sharded checkpoint: it holds pickled "
                f"Python objects that weights-only loading refuses ({_refusal(exc)}). "
                "Nothing from it was run. loopbus checkpoints hold only tensors and Python "
                "primitives."
            ) from None
        try:
            check_state_nesting(obj)
        except ValueError as exc:
            raise CheckpointError(
                f"refusing the entry {fqn!r} of a sharded checkpoint: {exc}."
            ) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class _LoadPlanner(_WeightsOnlyBytes, DefaultLoadPlanner):
    pass


class _ReadAllPlanner(_WeightsOnlyBytes, _EmptyStateDictLoadPlanner):
    pass


#: Modules whose classes DCP's shard index (``.metadata``) is made of: dataclasses and
#: enums that hold names, sizes and offsets.
_INDEX_MODULES = (
    "torch.distributed.checkpoint.metadata",
    "torch.distributed._shard.metadata",
    "torch.distributed._shard.sharded_tensor.metadata",
)
#: The other names the index may use, each harmless to call with any arguments.
_INDEX_NAMES = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    *(
        ("pathlib", name)
        for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")
    ),
}


class _IndexUnpickler(pickle.Unpickler):
    """Reads DCP's shard index, which DCP pickles and would read with ``pickle.load``
    (running whatever the file names): only the classes the index is made of, torch's
    dtypes and the names in :data:`_INDEX_NAMES` are found; any other name is refused
    before anything runs."""

    def find_class(self, module: str, name: str) -> Any:
        found = None
        if (module, name) in _INDEX_NAMES:
            found = super().find_class(module, name)
        elif module in _INDEX_MODULES and not name.startswith("__"):
            candidate = super().find_class(module, name)
            if isinstance(candidate, type) and candidate.__module__ == module:
                found = candidate
        elif module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            found = getattr(torch, name)
        if found is None:
            raise pickle.UnpicklingError(
                f"it names {module}.{name}, which a shard index does not hold"
            )
        return found


class _SafeReader(FileSystemReader):
    """DCP's file reader, reading the shard index with :class:`_IndexUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        locate = getattr(self, "_get_metadata_path", None)
        if locate is not None:
            path = locate(kwargs.get("rank"))
        else:  # earlier torch
            path = self.fs.concat_path(self.path, ".metadata")
        with self.fs.create_stream(path, "rb") as file:
            try:
                metadata = _IndexUnpickler(file).load()
            except Exception as exc:
                raise CheckpointError(
                    f"refusing the shard index {path} of a sharded checkpoint: "
                    f"{type(exc).__name__}: {exc}. Nothing from it was run."
                ) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(
                f"refusing the shard index {path} of a sharded checkpoint: it holds a "
                f"{type(metadata).__name__}, not DCP's Metadata."
            )
        try:
            check_state_nesting(vars(metadata))
        except ValueError as exc:
            raise CheckpointError(
                f"refusing the shard index {path} of a sharded checkpoint: {exc}."
            ) from None
        make_meta = getattr(dcp_metadata, "StorageMeta", None)
        if make_meta is not None and hasattr(self, "load_id"):  # as DCP's reader does
            meta: Any = getattr(metadata, "storage_meta", None)
            if meta is None:
                meta = metadata.storage_meta = make_meta()
            meta.load_id = self.load_id
        return metadata


# ---------------------------------------------------------------- saving


def _shard_error(path: Path, exc: BaseException) -> CheckpointError:
    """A DCP failure as a :class:`CheckpointError`: one of ours that DCP wrapped (it
    gathers every rank's exception) as it is, anything else naming the checkpoint."""
    for wrapped in getattr(exc, "failures", {}).values():
        failure = wrapped[0] if isinstance(wrapped, tuple) else wrapped  # (exception, trace)
        if isinstance(failure, CheckpointError):
            return failure
    if isinstance(exc, CheckpointError):
        return exc
    return CheckpointError(f"cannot read the shards of {path}: {type(exc).__name__}: {exc}")


def _shards_failed(target: Path, exc: BaseException) -> CheckpointError:
    """A failed write of a sharded checkpoint's shards (``dcp.save``, ``dcp.async_save``)
    as a :class:`CheckpointError` naming the checkpoint and the cause: a file system's
    error (a full disk) as what it says, not as the ``RuntimeError`` torch makes of it
    nor DCP's report of every rank's traceback."""
    error = find_os_error(exc)
    if error is not None:
        cause = describe_os_error(error)
    else:
        inner = [f[0] if isinstance(f, tuple) else f for f in getattr(exc, "failures", {}).values()]
        shown = inner[0] if inner and isinstance(inner[0], BaseException) else exc
        cause = f"{type(shown).__name__}: {shown}"
    return CheckpointError(
        f"could not write the shards of the sharded checkpoint {target}: {cause}. It was not "
        f"completed, so nothing was replaced: the checkpoints in {target.parent} (one of that "
        f"name included) are unchanged, its temporary directory is removed, and "
        f"{_pointer_state(target.parent)}."
    )


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


class ShardedSave:
    """One sharded save: written (``dcp.save``) or being written (``dcp.async_save``).

    :meth:`wait` waits until this rank's shards are written; on rank 0 it then makes the
    checkpoint complete (marker, rename, ``last.json``). Call it on every rank before the
    next save (the plugin does)."""

    def __init__(
        self,
        target: Path,
        temp: Path,
        future: Future[Any] | None,
        *,
        writer_rank: bool,
        info: dict[str, Any],
        update_last: bool,
        plain: dict[str, Any] | None = None,
    ) -> None:
        self.path = target
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

    def wait(self) -> Path:
        """Wait for this rank's shards; on rank 0 then complete the checkpoint. Returns
        its path. Raises :class:`CheckpointError` if the write failed."""
        if self._finished:
            return self.path
        if self.future is not None:
            try:
                self.future.result()
            except (Exception, CheckpointException) as exc:
                if self.writer_rank:
                    shutil.rmtree(self.temp, ignore_errors=True)
                raise _shards_failed(self.path, exc) from exc
        if self.writer_rank:
            self._complete()
        self._finished = True
        return self.path

    def _complete(self) -> None:
        temp, target = self.temp, self.path
        written = temp / SHARDED_STATE
        try:
            if self.plain is not None:  # host copies, taken at the save: written off the step
                temp.mkdir(parents=True, exist_ok=True)
                plain, self.plain = self.plain, None
                _write_durably(written, lambda f: save_plain(plain, f))
            files = {
                entry.name: entry.stat().st_size
                for entry in sorted(temp.iterdir())
                if entry.is_file() and entry.name != SHARDED_MARKER
            }
            info = dict(self.info, files=files, checkpoint=target.name)
            written = temp / SHARDED_MARKER
            _write_json(written, info)
        except OSError as exc:
            shutil.rmtree(temp, ignore_errors=True)
            raise CheckpointError(
                f"could not complete the sharded checkpoint {target}: writing {written.name} "
                f"failed: {describe_os_error(exc)}. It was never published: its temporary "
                f"directory is removed, and the checkpoints in {target.parent} (one of that "
                f"name included) are unchanged; {_pointer_state(target.parent)}."
            ) from exc
        self._publish(temp, target)
        if self.update_last:
            pointer = {k: info[k] for k in ("global_step", "epoch", "created")}
            pointer["checkpoint"] = target.name
            try:
                _write_json(target.parent / LAST_POINTER, pointer)
            except OSError as exc:
                raise CheckpointError(
                    f"the sharded checkpoint {target} is complete, but the pointer "
                    f"{target.parent / LAST_POINTER} could not be moved to it: "
                    f"{describe_os_error(exc)}. The checkpoint loads by its path; "
                    f"{_pointer_state(target.parent)}."
                ) from exc

    @staticmethod
    def _publish(temp: Path, target: Path) -> None:
        """Rename the complete directory ``temp`` to ``target``. A directory cannot
        replace another atomically: one of that name is moved aside under a temporary
        name first (cleaned as stale if this process dies meanwhile), and back if the
        rename fails."""
        aside = None
        try:
            if target.exists():
                aside = _temp_path(target)
                os.replace(target, aside)
            os.replace(temp, target)
        except OSError as exc:
            if aside is not None:
                with contextlib.suppress(OSError):
                    os.replace(aside, target)
            shutil.rmtree(temp, ignore_errors=True)
            kept = (
                f"the previous checkpoint of that name is still at {aside}: rename it back"
                if aside is not None and aside.exists()
                else f"the checkpoints in {target.parent} are unchanged"
            )
            raise CheckpointError(
                f"could not rename the complete sharded checkpoint {temp} to {target}: "
                f"{describe_os_error(exc)}. It is removed; {kept}; "
                f"{_pointer_state(target.parent)}."
            ) from exc
        fsync_dir(target.parent)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)


def _write_shards(tensors: Any, temp: Path, group: Any, asynchronous: bool) -> Future[Any] | None:
    """Every rank writes its shards into ``temp``: ``dcp.async_save`` (returns once the
    state is staged) or ``dcp.save``. In one process (no process group) DCP's entry
    points only warn that there is none; its writer is called directly, in a thread of
    its own after a host copy when asynchronous."""
    if group is not None:
        if asynchronous:
            return dcp_async_save(tensors, checkpoint_id=temp, process_group=group)  # type: ignore[return-value]
        dcp_save(tensors, checkpoint_id=temp, process_group=group)
        return None

    def write(state: Any) -> None:
        _save_state_dict(state, storage_writer=FileSystemWriter(temp), no_dist=True)

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
        trainer: Trainer,
        path: str | os.PathLike[str],
        *,
        asynchronous: bool = False,
        update_last: bool = False,
    ) -> ShardedSave:
        """Start a sharded save of ``trainer``'s run to the directory ``path``; every rank
        calls it at the same boundary. With ``asynchronous`` it returns once the state is
        staged to host memory (``dcp.async_save``); otherwise once this rank's shards are
        written. Either way the checkpoint is complete only after :meth:`ShardedSave.wait`
        (on rank 0)."""
        strategy = trainer.strategy
        target = Path(os.fspath(path))
        zero = strategy.is_global_zero
        temp = Path(strategy.broadcast_object(str(_temp_path(target)) if zero else None))
        parts = trainer.stateful_parts()
        module = trainer.module
        if module is None:
            raise CheckpointError("there is no module to save yet: fit has not started.")
        optimizers = list(trainer.optimizers)
        plain = {k: p for k, p in parts.items() if not is_tensor_part(k)}
        state = collect_state(trainer, plain, to_host=True)  # gathers every rank's generators
        header = state["loopbus"]
        header["parts"] = list(parts)
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
        tensors = _tensor_state(module, optimizers)
        try:
            future = _write_shards(tensors, temp, self._process_group(), asynchronous)
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            if zero:
                shutil.rmtree(temp, ignore_errors=True)
            raise _shards_failed(target, exc) from exc
        info = {
            "format": header["format"],
            "format_version": header["format_version"],
            "layout": LAYOUT,
            "global_step": header["global_step"],
            "epoch": header["epoch"],
            "created": header["created"],
            "world_size": strategy.world_size,
            "strategy": strategy.name,
        }
        return ShardedSave(
            target,
            temp,
            future,
            writer_rank=zero,
            info=info,
            update_last=update_last,
            plain=state if zero else None,
        )


def no_full_state(strategy: str) -> CheckpointError:
    """Why ``Trainer.state_dict()`` has no answer under a strategy that shards the module."""
    return CheckpointError(
        f"trainer.state_dict() under strategy={strategy!r}: every rank holds only its "
        "shards of the module and optimizer state. Use trainer.save_checkpoint(path) (a "
        "sharded checkpoint, every rank writing its shards) and "
        "loopbus.consolidate_checkpoint(path, out) for one full file."
    )


def save_sharded(trainer: Trainer, path: str | os.PathLike[str]) -> Path:
    """``Trainer.save_checkpoint`` under a strategy that shards the module's state: a
    sharded checkpoint directory at ``path``, every rank writing its shards; returns on
    every rank once the checkpoint is complete."""
    target = ShardedCheckpointWriter().save(trainer, path).wait()
    trainer.strategy.barrier()
    return target


async def save_sharded_async(trainer: Trainer, path: str | os.PathLike[str]) -> Path:
    """:func:`save_sharded`, the state staged to host memory first and the shards
    written in the background (``dcp.async_save``); the event loop stays free."""
    pending = ShardedCheckpointWriter().save(trainer, path, asynchronous=True)
    target = await anyio.to_thread.run_sync(pending.wait)
    trainer.strategy.barrier()
    return target


# ---------------------------------------------------------------- checking


def _marker(path: Path) -> dict[str, Any]:
    marker = path / SHARDED_MARKER
    if not path.is_dir():
        raise CheckpointError(f"no sharded checkpoint at {path}: it is not a directory.")
    if not marker.is_file():
        names = sorted(p.name for p in path.iterdir())[:10]
        if (path / ".metadata").is_file() or (path / SHARDED_STATE).is_file():
            raise CheckpointError(
                f"the sharded checkpoint {path} is incomplete: it has no completeness "
                f"marker {marker.name}, which rank 0 writes last, once every rank has "
                "written its shards (the save was interrupted, or the marker was deleted). "
                "Load another checkpoint, for example the previous one in its directory."
            )
        raise CheckpointError(
            f"{path} is not a loopbus checkpoint: a directory without a completeness "
            f"marker ({marker.name}) nor checkpoint files (it holds {names}). Pass a "
            "checkpoint file, a sharded checkpoint's directory or a directory the "
            "Checkpoint plugin writes into."
        )
    try:
        info = read_json(marker, Marker)
    except OSError as exc:
        raise CheckpointError(
            f"cannot read the completeness marker {marker}: {describe_os_error(exc)}"
        ) from None
    except ValueError as exc:
        raise CheckpointError(
            f"the completeness marker {marker} is damaged: {exc}. Load another checkpoint, "
            "for example the previous one in its directory."
        ) from None
    if info.layout != LAYOUT:
        raise CheckpointError(f"the completeness marker {marker} is not a sharded checkpoint's.")
    return {k: v for k, v in msgspec.structs.asdict(info).items() if v is not None}


def verify_sharded(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check a sharded checkpoint against its completeness marker: every file it lists is
    there with the size it had when written. Returns the marker; raises
    :class:`CheckpointError` naming the file that is missing or has another size."""
    p = Path(os.fspath(path))
    info = _marker(p)
    files = info.get("files")
    if not isinstance(files, dict) or SHARDED_STATE not in files:
        raise CheckpointError(f"the completeness marker {p / SHARDED_MARKER} lists no files.")
    for name, size in files.items():
        file = p / str(name)
        try:
            actual = file.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(
                f"the sharded checkpoint {p} is missing its file {file} (a shard "
                "or its metadata): it was deleted or not copied. Load another checkpoint, "
                "or copy the whole directory."
            ) from None
        if actual != size:
            raise CheckpointError(
                f"the file {file} of the sharded checkpoint {p} is truncated or modified: "
                f"its completeness marker records {size} bytes but it has {actual}. Load "
                "another checkpoint, for example the previous one in its directory."
            )
    return info


def _read_state(path: Path) -> dict[str, Any]:
    file = path / SHARDED_STATE
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(
            f"cannot read {file}, the plain part of the sharded checkpoint {path}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    check_loaded(state, file)
    header = check_header(state, str(path))
    if not isinstance(header.get("sharded"), Mapping):
        raise CheckpointError(f"{file} is not the state file of a sharded checkpoint.")
    return state  # type: ignore[no-any-return]


# ---------------------------------------------------------------- loading


def _module_problems(
    path: Path, module: torch.nn.Module, metadata: Any
) -> tuple[list[str], list[str], list[str]]:
    """The module's entries missing from the checkpoint, those unexpected in it, and
    those whose (global) shapes differ."""
    saved: dict[str, Any] = {
        key[len("module.") :]: getattr(meta, "size", None)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith("module.")
    }
    current: dict[str, Any] = get_model_state_dict(module)
    name = own_class(module).__name__
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    reshaped = [
        f"module: {k!r} has shape {tuple(saved[k])} in the checkpoint but "
        f"{tuple(v.shape)} in {name}"
        for k, v in current.items()
        if k in saved and saved[k] is not None and tuple(saved[k]) != tuple(v.shape)
    ]
    return (
        [f"module: {name} has {k!r}" for k in missing[:8]],
        [f"module: {k!r} (not in {name})" for k in unexpected[:8]],
        reshaped,
    )


def _optimizer_problems(saved: list[Any], optimizers: list[torch.optim.Optimizer]) -> list[str]:
    if len(saved) != len(optimizers):
        return [f"optimizers: {len(saved)} in the checkpoint but {len(optimizers)} in this run"]
    problems = []
    for index, (spec, opt) in enumerate(zip(saved, optimizers, strict=True)):
        cls = qualname(type(opt))
        if spec.get("class") != cls:
            problems.append(
                f"optimizers/{index}: a {spec.get('class')} in the checkpoint but a {cls} "
                "in this run"
            )
        elif spec.get("groups") != len(opt.param_groups):
            problems.append(
                f"optimizers/{index}: {spec.get('groups')} parameter groups in the "
                f"checkpoint but {len(opt.param_groups)} in this run"
            )
    return problems


def _for_world_size(state: dict[str, Any], world_size: int, parts: Mapping[str, Any]) -> None:
    """Adapt the plain state to another world size: every rank needs generators (rank
    ``r`` takes those of saved rank ``r mod W``); a stateful loader's position is one
    rank's, which means nothing at another world size."""
    saved = int(state["loopbus"]["sharded"].get("world_size", 1))
    if saved == world_size:
        return
    if "data/train" in parts and "data/train" in state:
        raise CheckpointError(
            f"the checkpoint was taken on {saved} ranks and this run has {world_size}: the "
            "position of its stateful training loader (StatefulDataLoader) is one rank's "
            "and cannot be resharded. Resume on the same number of ranks, or pass a plain "
            "DataLoader (loopbus then keeps the position as samples consumed, valid at any "
            "world size)."
        )
    if _mid_epoch(state) and not ("data/sampler" in state and "data/sampler" in parts):
        raise CheckpointError(
            f"the checkpoint was taken inside an epoch on {saved} rank(s) and this run has "
            f"{world_size}, but the position in that epoch is not kept as samples consumed "
            "on both sides (only a training DataLoader that loopbus shards under DDP or "
            "FSDP keeps it so; one process does not shard its loader). Resume on "
            f"{saved} rank(s), or from a checkpoint taken between epochs."
        )
    if "data/sampler" not in parts:
        state.pop("data/sampler", None)  # between epochs: the next one starts afresh
    rng = state.get("rng")
    if isinstance(rng, dict) and isinstance(rng.get("ranks"), list) and rng["ranks"]:
        ranks = rng["ranks"]
        state["rng"] = {"ranks": [ranks[r % len(ranks)] for r in range(world_size)]}


def _mid_epoch(state: Mapping[str, Any]) -> bool:
    """Whether the checkpoint's training loop was inside an epoch."""
    for key, value in state.items():
        if key.startswith("loops/") and isinstance(value, Mapping):
            train = value.get("loops", {}).get("epoch_loop")
            if isinstance(train, Mapping) and train.get("state", {}).get("in_epoch"):
                return True
    return False


def load_sharded(
    parts: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    world_size: int,
    strict: bool = True,
) -> tuple[CheckpointMismatch, ResumePlan]:
    """Load the sharded checkpoint at ``path`` into a registry's parts, on every rank
    (collective under a process group): DCP reads each rank's part of every tensor,
    resharding as needed; the plain parts load as from a file checkpoint. Every part is
    checked before any loads."""
    p = Path(os.fspath(path))
    verify_sharded(p)
    state = _read_state(p)
    sharded = state["loopbus"]["sharded"]
    module = parts["module"].module
    keys = sorted((k for k in parts if k.startswith("optimizers/")), key=lambda k: int(k[11:]))
    optimizers = [parts[k].obj for k in keys]
    try:
        metadata = _SafeReader(p).read_metadata()
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(
            f"cannot read the shard index {p / '.metadata'} of {p}: {type(exc).__name__}: {exc}"
        ) from exc
    missing, unexpected, mismatched = _module_problems(p, module, metadata)
    mismatched += _optimizer_problems(list(sharded.get("optimizers", [])), optimizers)
    _for_world_size(state, world_size, parts)
    plain = {k: part for k, part in parts.items() if not is_tensor_part(k)}
    result, _, _ = _check(plain, state)
    tensors = CheckpointMismatch(tuple(missing), tuple(unexpected), tuple(mismatched))
    if strict and (result or tensors):
        both = "\n".join(
            x for x in (str(tensors) if tensors else "", str(result) if result else "") if x
        )
        raise CheckpointError(
            f"the checkpoint {p} does not match this run:\n{both}\nMake the run match the "
            "checkpoint (same model, optimizers, schedulers, plugins, registered objects "
            "and kind of loader), or load what matches with strict=False."
        )
    _load_tensors(p, module, optimizers, list(sharded.get("grads", [])), partial=not strict)
    result, plan = load_state(plain, state, strict=strict, source=str(p))
    merged = CheckpointMismatch(
        result.missing + tensors.missing,
        result.unexpected + tensors.unexpected,
        result.mismatched + tensors.mismatched,
    )
    return merged, plan


def _load_tensors(
    path: Path,
    module: torch.nn.Module,
    optimizers: list[torch.optim.Optimizer],
    grad_names: list[str],
    *,
    partial: bool,
) -> None:
    params = dict(module.named_parameters())
    for param in params.values():
        param.grad = None  # the optimizers' state is initialised without gradients
    targets = _tensor_state(module, optimizers)
    targets["grads"] = {n: torch.zeros_like(params[n]) for n in grad_names if n in params}
    if not targets["grads"]:
        del targets["grads"]
    if not optimizers:
        del targets["optim"]
    try:
        _load_state_dict(
            targets,
            storage_reader=_SafeReader(path),
            planner=_LoadPlanner(allow_partial_load=partial),
            no_dist=not _distributed(),
        )
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        raise _shard_error(path, exc) from None
    if optimizers:
        set_state_dict(
            module,
            optimizers,
            model_state_dict=targets["module"],
            optim_state_dict=targets["optim"],
        )
    else:
        set_model_state_dict(module, targets["module"])
    for name, grad in targets.get("grads", {}).items():
        params[name].grad = grad


async def read_for_resume(
    parts: Mapping[str, Any], path: str | os.PathLike[str], world_size: int, strict: bool
) -> tuple[CheckpointMismatch, ResumePlan]:
    """Load the checkpoint ``fit(ckpt_path=...)`` resumes from into a registry's parts: a
    sharded one on every rank (:func:`load_sharded`), a file read in a worker thread."""
    if is_sharded_checkpoint(path):
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


# ---------------------------------------------------------------- consolidation


def _indexed_optimizers(optim: Mapping[str, Any], specs: list[Any]) -> dict[str, Any]:
    """Split DCP's optimizer state (keyed by parameter name, the optimizers' parameter
    groups one after the other) into each optimizer's own ``state_dict()`` (keyed by
    position, as ``torch.optim`` saves it)."""
    groups = list(optim.get("param_groups", []))
    states = optim.get("state", {})
    out: dict[str, Any] = {}
    at = 0
    for index, spec in enumerate(specs):
        mine = groups[at : at + int(spec["groups"])]
        at += int(spec["groups"])
        names = [n for g in mine for n in g["params"]]
        position = {n: i for i, n in enumerate(names)}
        out[f"optimizers/{index}"] = {
            "class": spec["class"],
            "state_dict": {
                "state": {position[n]: states[n] for n in names if n in states},
                "param_groups": [dict(g, params=[position[n] for n in g["params"]]) for g in mine],
            },
        }
    return out


def consolidate(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The sharded checkpoint at ``path`` as one full checkpoint dict, read in this
    process (no process group; every shard is read, so the whole state must fit in this
    host's memory). The same dict a file checkpoint holds: ``module`` is the full state
    dict, each ``optimizers/<i>`` its optimizer's own ``state_dict()``."""
    p = Path(os.fspath(path))
    verify_sharded(p)
    state = _read_state(p)
    tensors: dict[str, Any] = {}
    reader = _SafeReader(p)
    with contextlib.suppress(OSError):  # a missing index is DCP's to report
        reader.read_metadata()  # a refused one is said as such, not as DCP reports it
    try:
        _load_state_dict(
            tensors,
            storage_reader=reader,
            planner=_ReadAllPlanner(),  # type: ignore[no-untyped-call]
            no_dist=True,
        )
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        raise _shard_error(p, exc) from None
    sharded = state["loopbus"]["sharded"]
    state["module"] = tensors.get("module", {})
    state["grads"] = tensors.get("grads", {})
    state.update(_indexed_optimizers(tensors.get("optim", {}), list(sharded["optimizers"])))
    header = dict(state["loopbus"])
    header["layout"] = "consolidated"
    header["consolidated"] = {"from": p.name, "at": time.time()}
    state["loopbus"] = header
    return state


def consolidate_checkpoint(path: str | os.PathLike[str], out: str | os.PathLike[str]) -> Path:
    """Write the sharded checkpoint at ``path`` as one checkpoint file ``out`` (atomically,
    with its completeness marker), loadable with ``torch.load(out, weights_only=True)``,
    :func:`loopbus.load_checkpoint`, ``Module.load_from_checkpoint`` or a single-process
    ``fit(ckpt_path=out)``. Run it in one process. ``out`` must not exist: nothing is
    overwritten."""
    target = Path(os.fspath(out))
    if target.exists():
        raise CheckpointError(
            f"will not overwrite {target} with the consolidated checkpoint of {path}: it "
            "exists. Pass a new file name."
        )
    return write_checkpoint(consolidate(path), target)
