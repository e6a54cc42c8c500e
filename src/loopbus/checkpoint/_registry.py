""":class:`CheckpointRegistry`: what a checkpoint is saved from. The trainer builds one
for each save (``Trainer.checkpoint_registry()``) and hands it to the functions that
compose and write checkpoints, which read nothing else of the run: the registry's
stateful parts by key, the module and optimizers (for the header and for the state a
sharded checkpoint writes through ``torch.distributed.checkpoint``), how far the run is,
and the strategy's collectives and ranks that saving uses (:class:`SaveStrategy`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from loopbus.state._stateful import Stateful

__all__ = ["CheckpointRegistry", "RegistrySource", "SaveStrategy"]


class SaveStrategy(Protocol):
    """What saving reads of the strategy: which rank writes the plain state and completes
    a checkpoint, the world size and name a sharded checkpoint's marker records, and the
    collectives that agree on its temporary name and wait for every rank."""

    @property
    def name(self) -> str: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_global_zero(self) -> bool: ...

    def broadcast_object(self, obj: Any) -> Any: ...

    def barrier(self) -> None: ...


@dataclass(frozen=True)
class CheckpointRegistry:
    """The run as a checkpoint is saved from it, at one boundary.

    ``parts``: the stateful parts a checkpoint is composed from, by key
    (``Trainer.stateful_parts()``); ``module`` and ``optimizers``: the module (its class
    goes into the header) and optimizers, whose state a sharded checkpoint writes as
    shards; ``global_step`` and ``epoch``: how far the run is, for the header;
    ``strategy``: the ranks and collectives saving uses (:class:`SaveStrategy`);
    ``weights``: the module whose weights a sharded checkpoint writes as the module's,
    if not ``module`` (``Trainer.checkpoint_weights_from``); ``config``: the run's
    configuration (``Trainer.run_config``), carried in the header, or None."""

    parts: Mapping[str, Stateful]
    module: torch.nn.Module | None
    optimizers: Sequence[torch.optim.Optimizer]
    global_step: int
    epoch: int
    strategy: SaveStrategy
    weights: torch.nn.Module | None = None
    config: Mapping[str, Any] | None = None

    def only(self, keep: Callable[[str], bool]) -> CheckpointRegistry:
        """This registry with only the parts whose key ``keep`` accepts."""
        return dataclasses.replace(self, parts={k: p for k, p in self.parts.items() if keep(k)})


class RegistrySource(Protocol):
    """What builds a :class:`CheckpointRegistry` for a save: the trainer."""

    def checkpoint_registry(self) -> CheckpointRegistry: ...
