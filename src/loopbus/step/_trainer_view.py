"""``TrainerView``: what a module, a loop and a plugin read or call on the trainer that
runs them.

``Module.trainer``, ``Loop.trainer`` and the ``Plugin`` hooks' ``trainer`` argument are
typed with it: at run time they are the :class:`~loopbus.Trainer` itself, which
satisfies it structurally (``mypy`` checks that). It lives here, below the loops and
the stage, so that the parts the trainer runs name no type above their own layer; a
member whose precise type lives higher up (the strategy, the loops) is typed ``Any``
and documented.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from loopbus.events import Event, PutRecord, Subscription
    from loopbus.records import Publication
    from loopbus.state._runstate import RunState
    from loopbus.state._stateful import Stateful

    from ._optim import SchedulerConfig
    from ._precision import Precision

__all__ = ["TrainerView"]


@runtime_checkable
class TrainerView(Protocol):
    """The trainer as the parts it runs see it: where the run is, the ranks, the latest
    records, the parts of the run, and the calls a module or a plugin makes on it
    (stop, subscribe, publish, checkpoint). ``loopbus.Trainer`` satisfies it, also as
    ``isinstance(trainer, TrainerView)`` checks (every member present)."""

    # -- where the run is
    @property
    def global_step(self) -> int:
        """Optimizer steps taken in this run (restored by a resume)."""
        ...

    @property
    def current_epoch(self) -> int:
        """The epoch running (or the next one, between epochs), from 0."""
        ...

    @property
    def stage(self) -> str | None:
        """``"fit"``, ``"validate"``, ``"test"``, ``"predict"``, or None between stages."""
        ...

    @property
    def sanity_checking(self) -> bool:
        """Whether the validation sanity check before ``fit`` is running."""
        ...

    @property
    def should_stop(self) -> bool:
        """Whether a stop was requested and took effect."""
        ...

    @property
    def stop_reason(self) -> str | None:
        """Why the run stopped, if it was asked to."""
        ...

    @property
    def state(self) -> RunState:
        """The run's state: stage, step, epoch, the stop, the resume plan."""
        ...

    # -- the ranks
    @property
    def world_size(self) -> int: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def local_rank(self) -> int: ...

    @property
    def is_global_zero(self) -> bool: ...

    # -- the run folder
    @property
    def run_dir(self) -> os.PathLike[str] | None:
        """The run's folder (``root_dir/name/version_N``), or None: where plugins given
        no folder of their own write."""
        ...

    @property
    def run_config(self) -> Mapping[str, Any] | None:
        """The run's configuration (plain data), or None."""
        ...

    # -- the latest records
    @property
    def latest(self) -> Mapping[str, PutRecord]:
        """The last record of each name put in this trainer's life."""
        ...

    @property
    def stage_latest(self) -> Mapping[str, PutRecord]:
        """The last record of each name put in the current (or last) stage."""
        ...

    # -- the parts of the run
    @property
    def module(self) -> torch.nn.Module | None:
        """The module of the current (or last) stage."""
        ...

    @property
    def optimizers(self) -> Sequence[torch.optim.Optimizer]: ...

    @property
    def lr_scheduler_configs(self) -> Sequence[SchedulerConfig]: ...

    @property
    def precision(self) -> Precision: ...

    @property
    def strategy(self) -> Any:
        """The :class:`~loopbus.Strategy` (typed ``Any``: it lives above this layer)."""
        ...

    @property
    def loops(self) -> Mapping[str, Any]:
        """The root :class:`~loopbus.Loop` of each stage, by stage name."""
        ...

    @property
    def max_epochs(self) -> float: ...

    @property
    def enable_model_summary(self) -> bool: ...

    # -- what a module or a plugin asks of it
    def request_stop(self, reason: str | None = None) -> None:
        """Ask the running stage to stop at the next step boundary."""
        ...

    def subscribe(self, event_type: Any, handler: Any, **options: Any) -> Subscription:
        """Subscribe ``handler`` to ``event_type`` on the trainer's bus."""
        ...

    def publish(self, event: Event) -> Publication:
        """Publish a (custom) event while a stage runs (``await`` it to deliver now)."""
        ...

    def state_dict(self, *, to_host: bool = False) -> dict[str, Any]:
        """The run's state, as a checkpoint holds it."""
        ...

    def register_stateful(self, name: str, obj: Stateful) -> None:
        """Save ``obj`` with the run's checkpoints (under ``user/<name>``)."""
        ...

    def checkpoint_weights_from(self, source: torch.nn.Module | None) -> None:
        """Save ``source``'s weights as the checkpoint's module weights for the rest of
        the running stage (None: the module's own)."""
        ...

    def stateful_parts(self) -> Mapping[str, Stateful]:
        """The checkpoint registry: every stateful part of the run, by key."""
        ...

    def checkpoint_registry(self) -> Any:
        """What a checkpoint is saved from now: a
        :class:`~loopbus.checkpoint.CheckpointRegistry` (typed ``Any``: it lives above
        this layer)."""
        ...

    def save_checkpoint(self, path: str | os.PathLike[str]) -> os.PathLike[str]: ...

    async def save_checkpoint_async(self, path: str | os.PathLike[str]) -> os.PathLike[str]: ...
