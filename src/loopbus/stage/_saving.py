"""The trainer's checkpoint methods: the registry of stateful parts a checkpoint is
composed from, the run's state as a dict and back, and saving it to a file or a sharded
directory (on the ranks that must write, with every rank returning once it is durable).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread
import torch
from torch.autograd.profiler import record_function

from loopbus.checkpoint._parts import CheckpointMismatch, ModulePart, collect_state, load_state
from loopbus.checkpoint._registry import CheckpointRegistry
from loopbus.checkpoint._sharded_save import no_full_state, save_sharded, save_sharded_async
from loopbus.checkpoint._write import write_checkpoint
from loopbus.data._datamodule import stateful_datamodule
from loopbus.state._ranges import RANGES
from loopbus.state._runstate import ResumePlan
from loopbus.state._stateful import Stateful

from .._exceptions import MisconfigurationError
from ..storage import RemotePath, location
from ._assembly import StageParts, build_registry, check_registration

if TYPE_CHECKING:
    from loopbus.distributed._strategy import Strategy
    from loopbus.loop._loop import Loop
    from loopbus.loop._loops import EvaluationLoop, FitLoop, PredictionLoop
    from loopbus.records._recorder import Recorder
    from loopbus.state._runstate import RunState
    from loopbus.step._module import Module
    from loopbus.step._optim import LRSchedulers
    from loopbus.step._precision import Precision

    from ._plugin import Plugin

__all__ = ["CheckpointMethods"]


class CheckpointMethods:
    """The trainer's checkpoint methods (a base of :class:`Trainer`, which sets the
    attributes declared here)."""

    state: RunState
    strategy: Strategy
    recorder: Recorder
    module: Module | None
    optimizers: list[torch.optim.Optimizer]
    precision: Precision
    plugins: list[Plugin]
    fit_loop: FitLoop
    validate_loop: EvaluationLoop
    test_loop: EvaluationLoop
    predict_loop: PredictionLoop
    _schedulers: LRSchedulers
    _registered: dict[str, Stateful]
    _datamodule: Any
    _parts: dict[str, Any] | None
    _train_data: Any
    #: What checkpoints save as the module's weights, if not the module (see
    #: :meth:`checkpoint_weights_from`); None again when the stage ends.
    _weights_from: torch.nn.Module | None = None

    @property
    def loops(self) -> dict[str, Loop[Any]]:
        raise NotImplementedError  # the trainer's root loops

    @property
    def run_config(self) -> Mapping[str, Any] | None:
        raise NotImplementedError  # the run's configuration (RunViews)

    def register_stateful(self, name: str, obj: Stateful) -> None:
        """Save and restore ``obj`` (anything with ``state_dict``/``load_state_dict``: a
        data module, an EMA copy of the weights, a metric) with every checkpoint of this
        trainer, under the key ``"user/<name>"``. Register before the stage whose
        checkpoints should hold it starts; a resumed run must register the same names."""
        check_registration(self._registered, name, obj, self.state.stage)
        self._registered[name] = obj

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
        if source is not None and not isinstance(source, torch.nn.Module):
            raise MisconfigurationError(
                "checkpoint_weights_from(source) takes a torch.nn.Module holding the weights "
                f"to save as the module's (or None), got {type(source).__name__}."
            )
        if self.state.stage is None:
            raise RuntimeError(
                "checkpoint_weights_from() applies to the running stage; call it while one "
                "runs (from a plugin's setup or a handler)."
            )
        self._weights_from = source
        if self._parts is not None and self.module is not None:
            self._parts["module"] = ModulePart(source if source is not None else self.module)

    def stateful_parts(self) -> dict[str, Stateful]:
        """The registry a checkpoint is composed from, key -> :class:`Stateful` part:
        the run state, the generators, the module, its hyperparameters, each optimizer and
        scheduler, the precision, the loop tree, every stateful plugin, the training loader
        when it is stateful, gradients mid-accumulation, the latest records and every
        registered object. Built when a stage starts; a new dict each call."""
        if self._parts is not None:
            return dict(self._parts)
        return self._build_parts()

    def checkpoint_registry(self) -> CheckpointRegistry:
        """What a checkpoint of the run is saved from, now: the parts of
        :meth:`stateful_parts`, the module and optimizers, how far the run is, and the
        strategy whose ranks and collectives saving uses. A new value each call;
        ``ShardedCheckpointWriter.save`` takes it (or the trainer, which it asks)."""
        return CheckpointRegistry(
            parts=self.stateful_parts(),
            module=self.module,
            optimizers=self.optimizers,
            global_step=self.state.step,
            epoch=self.state.epoch,
            strategy=self.strategy,
            weights=self._weights_from,
            config=self.run_config,
        )

    def _stage_parts(self, stage: str | None, active: list[Plugin]) -> StageParts:
        raise NotImplementedError  # the trainer's parts now (Trainer)

    def _build_parts(self) -> dict[str, Any]:
        parts = build_registry(
            self._stage_parts(self.state.stage, []),
            epoch_loop=self.fit_loop.epoch_loop,
            train_data=self._train_data,
            registered=self._registered,
        )
        if self._weights_from is not None:
            parts["module"] = ModulePart(self._weights_from)
        if self._datamodule is not None and stateful_datamodule(self._datamodule):
            parts["datamodule"] = self._datamodule
        return parts

    def state_dict(self, *, to_host: bool = False) -> dict[str, Any]:
        """The run's state as a checkpoint dict of plain tensors and Python primitives,
        one entry per part of :meth:`stateful_parts`. With ``to_host`` the tensors are
        copies in host memory (safe to write while training goes on); otherwise the live
        tensors. Under FSDP no rank holds it whole: :class:`CheckpointError`."""
        if self.strategy.sharded_state:
            raise no_full_state(self.strategy.name)
        if RANGES.on:  # profiling_ranges(True): the capture as a profiler range
            with record_function("loopbus.checkpoint"):
                return collect_state(self.checkpoint_registry(), to_host=to_host)
        return collect_state(self.checkpoint_registry(), to_host=to_host)

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> CheckpointMismatch:
        """Load a checkpoint dict into this run (module and optimizers must be set up:
        resume through ``fit(..., ckpt_path=...)``). With ``strict`` any part that is
        missing, unexpected or incompatible raises :class:`CheckpointError`; without,
        what matches loads and the returned :class:`CheckpointMismatch` lists the rest."""
        return self._load(*load_state(self.stateful_parts(), state, strict=strict))

    def _load(self, mismatch: CheckpointMismatch, plan: ResumePlan) -> CheckpointMismatch:
        self.state.plan_resume(plan)
        self._schedulers.resumed_at(plan.step)
        return mismatch

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
        target = location(path, owner=f"save_checkpoint({str(path)!r})")
        if self.strategy.sharded_state:
            return save_sharded(self.checkpoint_registry(), target)
        state = self.state_dict()
        if self.strategy.is_global_zero:
            target = write_checkpoint(state, target)
        self.strategy.barrier()
        return target

    async def save_checkpoint_async(self, path: str | os.PathLike[str]) -> Path | RemotePath:
        """Copy the run's state to host memory now, write it in a worker thread, and
        return once it is durable; the event loop stays free meanwhile. Under DDP, as
        :meth:`save_checkpoint`: called on every rank, written by rank 0 (under FSDP:
        every rank its shards, staged first, then written in the background). ``path``
        may be a URL, as for :meth:`save_checkpoint`."""
        target = location(path, owner=f"save_checkpoint_async({str(path)!r})")
        if self.strategy.sharded_state:
            return await save_sharded_async(self.checkpoint_registry(), target)
        state = self.state_dict(to_host=True)
        if self.strategy.is_global_zero:
            target = await anyio.to_thread.run_sync(write_checkpoint, state, target)
        self.strategy.barrier()
        return target
