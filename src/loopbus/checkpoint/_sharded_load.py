"""Loading sharded checkpoints (``_sharded_save.py`` writes them): checked against their
completeness marker, read safely, and either loaded into a run or consolidated.

Loading for a resume (:func:`load_sharded`) lets ``torch.distributed.checkpoint`` (DCP)
read each rank's part of every tensor, whatever the world size or the sharding at save
time; :func:`consolidate` reads all shards in one process (no process group) into one
full checkpoint dict, the same as a file checkpoint's.

Non-tensor values DCP saves inside its shard files (the optimizers' parameter groups)
are read with ``torch.load(..., weights_only=True)`` too, and the shard index
(``.metadata``, a pickle that DCP itself reads with ``pickle.load``) by an unpickler that
finds only the classes an index is made of: nothing else is unpickled. The completeness
marker and what the state file holds are bounded as for a file checkpoint.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from loopbus.state._runstate import ResumePlan
from loopbus.step._params import own_class

from .._exceptions import CheckpointError
from .._untrusted import check_state_nesting
from ..storage import RemotePath, Storage, located, location, store_for
from ._diagnose import _refusal, check_loaded
from ._format import (
    SHARDED_MARKER,
    SHARDED_STATE,
    Marker,
    check_header,
    describe_os_error,
    read_remote_json,
)
from ._parts import CheckpointMismatch, LoopPart, _check, load_state, qualname
from ._sharded_save import LAYOUT, _distributed, _tensor_state, is_tensor_part
from ._write import write_checkpoint

__all__ = [
    "consolidate",
    "consolidate_checkpoint",
    "load_sharded",
    "verify_sharded",
]


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


class _SafeIndex:
    """Reads DCP's shard index with :class:`_IndexUnpickler` (for DCP's readers)."""

    fs: Any
    path: Any

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


def _reader(path: Path | RemotePath) -> Any:
    """A safe DCP reader of the sharded checkpoint at ``path``: a local directory, or a
    URL's prefix read through DCP's fsspec reader with the URL's storage options."""
    store, name = located(path)
    return store.dcp_reader(name, mixin=_SafeIndex)


def _shard_error(path: Path | RemotePath, exc: BaseException) -> CheckpointError:
    """A DCP failure as a :class:`CheckpointError`: one of ours that DCP wrapped (it
    gathers every rank's exception) as it is, anything else naming the checkpoint."""
    for wrapped in getattr(exc, "failures", {}).values():
        failure = wrapped[0] if isinstance(wrapped, tuple) else wrapped  # (exception, trace)
        if isinstance(failure, CheckpointError):
            return failure
    if isinstance(exc, CheckpointError):
        return exc
    return CheckpointError(f"cannot read the shards of {path}: {type(exc).__name__}: {exc}")


# ---------------------------------------------------------------- checking


def _marker(path: Path | RemotePath, inside: Storage) -> tuple[Marker, dict[str, int]]:
    """The completeness marker of the sharded checkpoint ``path`` (whose directory is the
    store ``inside``) and the directory's entries, name -> size; raises
    :class:`CheckpointError` saying why there is no marker to check it against."""
    marker = path / SHARDED_MARKER
    objects, prefixes = inside.contents()
    if SHARDED_MARKER not in objects:
        if not objects and not prefixes and (why := _no_directory(path)) is not None:
            raise CheckpointError(f"no sharded checkpoint at {path}: {why}.")
        names = sorted(set(objects) | prefixes)[:10]
        if ".metadata" in objects or SHARDED_STATE in objects:
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
        info = read_remote_json(inside, SHARDED_MARKER, Marker)
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
    return info, objects


def _no_directory(path: Path | RemotePath) -> str | None:
    """Why ``path`` is no directory (an empty one is, where the store has them), or None."""
    store, name = located(path)
    if store.is_directory(name):
        return None
    return "it is not a directory" if store.size(name) is not None else "nothing is there"


def verify_sharded(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Check a sharded checkpoint (a directory, or a URL's prefix) against its
    completeness marker: every file it lists is there with the size it had when written,
    as its store lists them. Returns the marker; raises :class:`CheckpointError` naming
    the file that is missing or has another size."""
    p = location(path)
    inside = store_for(p)
    info, sizes = _marker(p, inside)
    files = info.files
    if not isinstance(files, dict) or SHARDED_STATE not in files:
        raise CheckpointError(f"the completeness marker {p / SHARDED_MARKER} lists no files.")
    for name, size in files.items():
        file = p / str(name)
        actual = sizes.get(str(name))
        if actual is None:
            raise CheckpointError(
                f"the sharded checkpoint {p} is missing its {inside.noun} {file} (a shard "
                "or its metadata): it was deleted or not copied. Load another checkpoint, "
                "or copy the whole directory."
            )
        if actual != size:
            raise CheckpointError(
                f"the {inside.noun} {file} of the sharded checkpoint {p} is truncated or "
                f"modified: its completeness marker records {size} bytes but it has "
                f"{actual}. Load another checkpoint, for example the previous one in its "
                "directory."
            )
    return {k: v for k, v in msgspec.structs.asdict(info).items() if v is not None}


def _read_state(path: Path | RemotePath) -> dict[str, Any]:
    file = path / SHARDED_STATE
    store, name = located(path)
    try:  # read in place, or downloaded first from an object store
        with store.below(name).local_copy(SHARDED_STATE) as local:
            state = torch.load(local, map_location="cpu", weights_only=True)
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
    path: Path | RemotePath, module: torch.nn.Module, metadata: Any
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
    if _mid_epoch(state, parts) and not ("data/sampler" in state and "data/sampler" in parts):
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


def _mid_epoch(state: Mapping[str, Any], parts: Mapping[str, Any]) -> bool:
    """Whether the checkpoint's training loop was inside an epoch, as this run's loops
    read the state they saved."""
    return any(
        isinstance(part, LoopPart) and part.saved_inside_epoch(state.get(key))
        for key, part in parts.items()
    )


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
    checked before any loads. ``path`` may be a URL: every rank reads its part from the
    store."""
    p = location(path)
    verify_sharded(p)
    state = _read_state(p)
    sharded = state["loopbus"]["sharded"]
    module = parts["module"].module
    keys = sorted((k for k in parts if k.startswith("optimizers/")), key=lambda k: int(k[11:]))
    optimizers = [parts[k].obj for k in keys]
    try:
        metadata = _reader(p).read_metadata()
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
    path: Path | RemotePath,
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
            storage_reader=_reader(path),
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
    dict, each ``optimizers/<i>`` its optimizer's own ``state_dict()``. ``path`` may be a
    URL (a :class:`~loopbus.RemotePath` carries storage options)."""
    p = location(path)
    verify_sharded(p)
    state = _read_state(p)
    tensors: dict[str, Any] = {}
    reader = _reader(p)
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


def consolidate_checkpoint(
    path: str | os.PathLike[str], out: str | os.PathLike[str]
) -> Path | RemotePath:
    """Write the sharded checkpoint at ``path`` as one checkpoint file ``out`` (atomically,
    with its completeness marker), loadable with ``torch.load(out, weights_only=True)``,
    :func:`loopbus.load_checkpoint`, ``Module.load_from_checkpoint`` or a single-process
    ``fit(ckpt_path=out)``. Run it in one process. ``out`` must not exist: nothing is
    overwritten.

    Either may be a URL (``s3://bucket/run/epoch=0-step=10.ckpt``; a
    :class:`~loopbus.RemotePath` carries storage options): the shards are read from the
    store, and a URL ``out`` is uploaded with its marker (returned as a ``RemotePath``)."""
    store, name = located(out)
    target = store.path(name)
    if store.exists(name):
        raise CheckpointError(
            f"will not overwrite {target} with the consolidated checkpoint of {path}: it "
            "exists. Pass a new file name."
        )
    return write_checkpoint(consolidate(path), target)
