"""A run's checkpoints: the registry of stateful parts a checkpoint is composed from, the
run's state as a dict and back, saving it to a file or a sharded directory (on the ranks
that must write, with every rank returning once it is durable), and the checkpoint
``ckpt_path="last"`` or ``"best"`` names among the trainer's plugins (each a
:class:`CheckpointSource`, or a plugin with Lightning's attribute names).

:class:`RunCheckpoints` owns what only checkpoints need (the registered objects, the
weights saved in place of the module's, the running stage's registry, its training data
and DataModule) and reads the rest from the trainer's parts as one value
(:class:`StageParts`); :class:`CheckpointMethods` is the trainer's public face of it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import anyio.to_thread
import torch
from torch.autograd.profiler import record_function

from loopbus.checkpoint._locate import newest
from loopbus.checkpoint._parts import CheckpointMismatch, ModulePart, collect_state, load_state
from loopbus.checkpoint._registry import CheckpointRegistry
from loopbus.checkpoint._write import write_checkpoint
from loopbus.data._datamodule import stateful_datamodule
from loopbus.state._ranges import RANGES
from loopbus.state._runstate import ResumePlan
from loopbus.state._stateful import Stateful

from .._exceptions import MisconfigurationError
from ..storage import RemotePath, location
from ._assembly import StageParts, build_registry, check_registration

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = [
    "CheckpointMethods",
    "CheckpointSource",
    "RunCheckpoints",
    "checkpoint_writers",
    "resolve_resume_path",
    "resolve_weights_path",
]


class RunCheckpoints:
    """The checkpoint verbs of one run. ``parts_now()`` is the trainer's parts as they
    are now (outside a stage too); ``config_now()`` the run's configuration, saved with
    each checkpoint. The trainer tells it when a stage starts (:meth:`stage_started`) and
    ends (:meth:`stage_ended`)."""

    def __init__(
        self,
        parts_now: Callable[[], StageParts],
        config_now: Callable[[], Mapping[str, Any] | None],
    ) -> None:
        self._parts_now = parts_now
        self._config_now = config_now
        self._registered: dict[str, Stateful] = {}
        #: The running stage's registry (None outside a stage: built on demand).
        self._registry: dict[str, Any] | None = None
        #: What checkpoints save as the module's weights, if not the module.
        self._weights_from: torch.nn.Module | None = None
        #: The training data of the current (or last) fit, for its loader's state.
        self._train_data: Any = None
        #: The DataModule of the running stage, saved with its checkpoints when stateful.
        self._datamodule: Any = None

    def stage_started(self, parts: StageParts, train_data: Any, datamodule: Any) -> None:
        """A stage starts with ``parts``: its registry is built once, now. ``train_data``
        is the fit's training data (None: the last fit's stays)."""
        if train_data is not None:
            self._train_data = train_data
        self._datamodule = datamodule
        self._registry = self._build(parts)

    def stage_ended(self) -> None:
        """The stage ended: its registry, its DataModule and the substitute weights go."""
        self._registry = None
        self._weights_from = None
        self._datamodule = None

    def register(self, name: str, obj: Stateful) -> None:
        """See :meth:`CheckpointMethods.register_stateful`."""
        check_registration(self._registered, name, obj, self._parts_now().state.stage)
        self._registered[name] = obj

    def weights_from(self, source: torch.nn.Module | None) -> None:
        """See :meth:`CheckpointMethods.checkpoint_weights_from`."""
        if source is not None and not isinstance(source, torch.nn.Module):
            raise MisconfigurationError(
                "checkpoint_weights_from(source) takes a torch.nn.Module holding the weights "
                f"to save as the module's (or None), got {type(source).__name__}."
            )
        parts = self._parts_now()
        if parts.state.stage is None:
            raise RuntimeError(
                "checkpoint_weights_from() applies to the running stage; call it while one "
                "runs (from a plugin's setup or a handler)."
            )
        self._weights_from = source
        if self._registry is not None and parts.module is not None:
            self._registry["module"] = ModulePart(source if source is not None else parts.module)

    def parts(self) -> dict[str, Stateful]:
        """See :meth:`CheckpointMethods.stateful_parts`."""
        if self._registry is not None:
            return dict(self._registry)
        return self._build(self._parts_now())

    def registry(self) -> CheckpointRegistry:
        """See :meth:`CheckpointMethods.checkpoint_registry`."""
        now = self._parts_now()
        return CheckpointRegistry(
            parts=dict(self._registry) if self._registry is not None else self._build(now),
            module=now.module,
            optimizers=now.optimizers,
            global_step=now.state.step,
            epoch=now.state.epoch,
            strategy=now.strategy,
            weights=self._weights_from,
            config=self._config_now(),
        )

    def _build(self, parts: StageParts) -> dict[str, Any]:
        registry = build_registry(
            parts,
            epoch_loop=parts.loops["fit"].epoch_loop,  # type: ignore[attr-defined]
            train_data=self._train_data,
            registered=self._registered,
        )
        if self._weights_from is not None:
            registry["module"] = ModulePart(self._weights_from)
        if self._datamodule is not None and stateful_datamodule(self._datamodule):
            registry["datamodule"] = self._datamodule
        return registry

    def state_dict(self, to_host: bool = False) -> dict[str, Any]:
        """See :meth:`CheckpointMethods.state_dict`."""
        strategy = self._parts_now().strategy
        if strategy.sharded_state:
            from loopbus.checkpoint._sharded_save import no_full_state

            raise no_full_state(strategy.name)
        if RANGES.on:  # profiling_ranges(True): the capture as a profiler range
            with record_function("loopbus.checkpoint"):
                return collect_state(self.registry(), to_host=to_host)
        return collect_state(self.registry(), to_host=to_host)

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> CheckpointMismatch:
        """See :meth:`CheckpointMethods.load_state_dict`."""
        return self.loaded(*load_state(self.parts(), state, strict=strict))

    def loaded(self, mismatch: CheckpointMismatch, plan: ResumePlan) -> CheckpointMismatch:
        """A checkpoint was loaded into the parts: the run resumes by ``plan``."""
        now = self._parts_now()
        now.state.plan_resume(plan)
        now.schedulers.resumed_at(plan.step)
        return mismatch

    def save(self, path: str | os.PathLike[str]) -> Path | RemotePath:
        """See :meth:`CheckpointMethods.save_checkpoint`."""
        target = location(path, owner=f"save_checkpoint({str(path)!r})")
        strategy = self._parts_now().strategy
        if strategy.sharded_state:
            from loopbus.checkpoint._sharded_save import save_sharded

            return save_sharded(self.registry(), target)
        state = self.state_dict()
        if strategy.is_global_zero:
            target = write_checkpoint(state, target)
        strategy.barrier()
        return target

    async def save_async(self, path: str | os.PathLike[str]) -> Path | RemotePath:
        """See :meth:`CheckpointMethods.save_checkpoint_async`."""
        target = location(path, owner=f"save_checkpoint_async({str(path)!r})")
        strategy = self._parts_now().strategy
        if strategy.sharded_state:
            from loopbus.checkpoint._sharded_save import save_sharded_async

            return await save_sharded_async(self.registry(), target)
        state = self.state_dict(to_host=True)
        if strategy.is_global_zero:
            target = await anyio.to_thread.run_sync(write_checkpoint, state, target)
        strategy.barrier()
        return target


class CheckpointMethods:
    """The trainer's checkpoint methods (a base of :class:`Trainer`): each hands over to
    the run's :class:`RunCheckpoints` (``checkpoints``), which owns their state."""

    checkpoints: RunCheckpoints

    def register_stateful(self, name: str, obj: Stateful) -> None:
        """Save and restore ``obj`` (anything with ``state_dict``/``load_state_dict``: a
        data module, an EMA copy of the weights, a metric) with every checkpoint of this
        trainer, under the key ``"user/<name>"``. Register before the stage whose
        checkpoints should hold it starts; a resumed run must register the same names."""
        self.checkpoints.register(name, obj)

    def checkpoint_weights_from(self, source: torch.nn.Module | None) -> None:
        """Save the weights of ``source`` as the checkpoint's ``"module"`` entry instead of
        the module's own, for the rest of the running stage (None: the module's own
        again). ``source`` is a copy of the module's weights with the same state-dict keys,
        such as the averaged weights of ``WeightAveraging``: the checkpoint's weights are
        then what ``test(ckpt_path=...)`` and ``Module.load_from_checkpoint`` load, while
        the plugin keeps the module's own weights in its state. A checkpoint loaded into
        the run loads its ``"module"`` entry into ``source``. Every kind of checkpoint
        follows it (a file, ``state_dict()``, a sharded directory); the trainer forgets it
        when the stage ends."""
        self.checkpoints.weights_from(source)

    def stateful_parts(self) -> dict[str, Stateful]:
        """The registry a checkpoint is composed from, key -> :class:`Stateful` part:
        the run state, the generators, the module, its hyperparameters, each optimizer and
        scheduler, the precision, the loop tree, every stateful plugin, the training loader
        when it is stateful, gradients mid-accumulation, the latest records and every
        registered object. Built when a stage starts; a new dict each call."""
        return self.checkpoints.parts()

    def checkpoint_registry(self) -> CheckpointRegistry:
        """What a checkpoint of the run is saved from, now: the parts of
        :meth:`stateful_parts`, the module and optimizers, how far the run is, and the
        strategy whose ranks and collectives saving uses. A new value each call;
        ``ShardedCheckpointWriter.save`` takes it (or the trainer, which it asks)."""
        return self.checkpoints.registry()

    def state_dict(self, *, to_host: bool = False) -> dict[str, Any]:
        """The run's state as a checkpoint dict of plain tensors and Python primitives,
        one entry per part of :meth:`stateful_parts`. With ``to_host`` the tensors are
        copies in host memory (safe to write while training goes on); otherwise the live
        tensors. Under FSDP no rank holds it whole: :class:`CheckpointError`."""
        return self.checkpoints.state_dict(to_host)

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> CheckpointMismatch:
        """Load a checkpoint dict into this run (module and optimizers must be set up:
        resume through ``fit(..., ckpt_path=...)``). With ``strict`` any part that is
        missing, unexpected or incompatible raises :class:`CheckpointError`; without,
        what matches loads and the returned :class:`CheckpointMismatch` lists the rest."""
        return self.checkpoints.load_state_dict(state, strict)

    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path | RemotePath:
        """Write the run's state to ``path`` atomically (temporary file, fsync, rename,
        completeness marker) and return the path. Blocks until the file is durable.

        Under DDP every rank must call it (the state holds every rank's generators):
        rank 0 writes, and all ranks return once the file is there. Under FSDP ``path``
        is a sharded checkpoint directory, every rank writing its shards.

        ``path`` may be a URL (``s3://bucket/run/x.ckpt``; a :class:`~loopbus.RemotePath`
        carries storage options): the object, then its completeness marker are uploaded
        (under FSDP every rank's shards, then the marker), and a ``RemotePath`` is
        returned."""
        return self.checkpoints.save(path)

    async def save_checkpoint_async(self, path: str | os.PathLike[str]) -> Path | RemotePath:
        """Copy the run's state to host memory now, write it in a worker thread, and
        return once it is durable; the event loop stays free meanwhile. Under DDP, as
        :meth:`save_checkpoint`: called on every rank, written by rank 0 (under FSDP:
        every rank its shards, staged first, then written in the background). ``path``
        may be a URL, as for :meth:`save_checkpoint`."""
        return await self.checkpoints.save_async(path)


# ---------------------------------------------------------------- named by ckpt_path


@runtime_checkable
class CheckpointSource(Protocol):
    """What a plugin that writes checkpoints tells the stage, for ``ckpt_path="last"``
    and ``"best"`` (``loopbus.plugins.Checkpoint`` implements it): the newest checkpoint
    it has written, looked up now; the record it ranks checkpoints by (None: none); and
    the best so far by that record (None: none yet)."""

    @property
    def monitor(self) -> str | None: ...

    @property
    def best_checkpoint_path(self) -> Path | RemotePath | None: ...

    def latest_checkpoint(self) -> Path | RemotePath | None: ...


def checkpoint_writers(plugins: Iterable[Any]) -> list[Any]:
    """The plugins that know where checkpoints are written (a :class:`CheckpointSource`,
    or a plugin with Lightning's ``last_checkpoint_path``): where ``ckpt_path="last"``
    looks."""
    return [
        p for p in plugins if isinstance(p, CheckpointSource) or hasattr(p, "last_checkpoint_path")
    ]


def resolve_last(plugins: Iterable[Any], *, warn: bool = True) -> Path | RemotePath | None:
    """The checkpoint ``ckpt_path="last"`` means: the newest of those the plugins report,
    each looked up now (:meth:`CheckpointSource.latest_checkpoint`) or, for a plugin of
    another kind, its ``last_checkpoint_path`` (a property; a plugin's method of that
    name is called); None (with a warning unless ``warn`` is false) if none has written
    one."""
    providers = checkpoint_writers(plugins)
    if not providers:
        raise MisconfigurationError(
            "ckpt_path='last' needs a plugin that knows where checkpoints are written, such "
            "as loopbus.plugins.Checkpoint(dirpath), among the trainer's plugins; add one or "
            "pass the path of a checkpoint (or of its directory)."
        )
    found: list[Path | RemotePath] = []
    for plugin in providers:
        if isinstance(plugin, CheckpointSource):
            path = plugin.latest_checkpoint()
        else:
            path = plugin.last_checkpoint_path
        if not isinstance(path, (str, os.PathLike)) and callable(path):
            path = path()
        if path is not None:
            found.append(location(path))
    if not found:
        if not warn:
            return None
        where = ", ".join(str(getattr(p, "dirpath", None) or type(p).__name__) for p in providers)
        warnings.warn(
            f"ckpt_path='last' but no checkpoint has been written yet (looked in {where}); "
            "training starts from the beginning.",
            UserWarning,
            stacklevel=4,
        )
        return None
    return newest(found) if len(found) > 1 else found[0]


def resolve_best(plugins: Iterable[Any]) -> Path | RemotePath:
    """The checkpoint ``ckpt_path="best"`` means: the ``best_checkpoint_path`` of the
    plugin that saves checkpoints on a monitored value (``Checkpoint(dirpath,
    monitor=...)``; of a plugin of another kind, its ``best_model_path``, Lightning's
    name). Raises :class:`MisconfigurationError` when there is no such plugin, when
    several could answer, or when it has saved no best checkpoint yet."""
    savers = [p for p in plugins if _best_attribute(p) is not None and hasattr(p, "monitor")]
    monitored = [p for p in savers if p.monitor is not None]
    if not monitored:
        extra = (
            f" (the trainer's {', '.join(repr(p) for p in savers)} monitor nothing, so "
            "they rank no checkpoint as best)"
            if savers
            else ""
        )
        raise MisconfigurationError(
            "ckpt_path='best' needs a Checkpoint plugin that monitors a record, such as "
            "loopbus.plugins.Checkpoint(dirpath, monitor='val/loss'), among the trainer's "
            f"plugins{extra}; add one and fit first, or pass ckpt_path='last' or the path "
            "of a checkpoint."
        )
    best = [(p, getattr(p, str(_best_attribute(p)))) for p in monitored]
    found = [(p, path) for p, path in best if path is not None]
    if not found:
        names = ", ".join(f"{p!r} (monitor {p.monitor!r})" for p in monitored)
        raise MisconfigurationError(
            f"ckpt_path='best' but {names} has saved no best checkpoint yet: it ranks the "
            "checkpoints that fit saves on this trainer after a validation that put the "
            "monitored record (a new Trainer knows nothing of an earlier one's best). Fit "
            "with validation data first, or pass the path of a checkpoint."
        )
    if len(found) > 1:
        listing = "; ".join(f"{p!r} (monitor {p.monitor!r}): {path}" for p, path in found)
        raise MisconfigurationError(
            f"ckpt_path='best' is ambiguous: several Checkpoint plugins have a best "
            f"checkpoint ({listing}). Pass the one you mean, as "
            "ckpt_path=plugin.best_checkpoint_path."
        )
    best_path = found[0][1]
    return location(best_path)


def _best_attribute(plugin: Any) -> str | None:
    """The name under which ``plugin`` says its best checkpoint: ``best_checkpoint_path``
    (a :class:`CheckpointSource`'s), or Lightning's ``best_model_path`` for a plugin that
    has only that; None for one that has neither."""
    if isinstance(plugin, CheckpointSource):
        return "best_checkpoint_path"
    for name in ("best_checkpoint_path", "best_model_path"):
        if hasattr(plugin, name):
            return name
    return None


def resolve_weights_path(
    ckpt_path: str | os.PathLike[str], plugins: Iterable[Any], strategy: Any
) -> str | os.PathLike[str]:
    """The checkpoint ``ckpt_path`` names for loading weights: ``"best"`` (the best of
    the plugin that monitors a record), ``"last"`` (the newest; an error if none was
    written) or a path as it is. The names are resolved once, on rank 0, and broadcast
    (``strategy.broadcast_object``), so every rank raises the same error or loads the
    same file."""
    _check_ckpt_path(ckpt_path)
    if ckpt_path not in ("best", "last"):
        return ckpt_path
    found: Path | RemotePath | None = None
    problem: str | None = None
    if strategy.is_global_zero:
        try:
            if ckpt_path == "best":
                found = resolve_best(plugins)
            else:
                found = resolve_last(plugins, warn=False)
                if found is None:
                    problem = (
                        "ckpt_path='last' but no checkpoint has been written yet, so "
                        "there are no weights to load; fit first, or pass the path "
                        "of a checkpoint."
                    )
        except MisconfigurationError as exc:
            problem = str(exc)
    found, problem = strategy.broadcast_object((found, problem))
    if problem is not None:
        raise MisconfigurationError(problem)
    assert found is not None
    return found


def resolve_resume_path(
    ckpt_path: str | os.PathLike[str], plugins: Iterable[Any], strategy: Any
) -> str | os.PathLike[str] | None:
    """The checkpoint ``fit(ckpt_path=...)`` resumes from: ``"last"`` is the newest of
    the plugins that write them (None, with a warning, when there is none yet), resolved
    once on rank 0 and broadcast so that every rank loads the same file; anything else
    as it is."""
    _check_ckpt_path(ckpt_path)
    if ckpt_path != "last":
        return ckpt_path
    found = resolve_last(plugins) if strategy.is_global_zero else None
    return strategy.broadcast_object(found)  # type: ignore[no-any-return]


def _check_ckpt_path(ckpt_path: str | os.PathLike[str]) -> None:
    """Before anything runs: a URL's scheme must have its package installed."""
    location(ckpt_path, owner=f"ckpt_path={str(ckpt_path)!r}")
