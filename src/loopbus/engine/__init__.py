"""Loops, scopes, the trainer, the module and state. Imports events, never plugins."""

from __future__ import annotations

from ._checkpoint import CheckpointMismatch as CheckpointMismatch
from ._checkpoint import checkpoint_info as checkpoint_info
from ._checkpoint import is_sharded_checkpoint as is_sharded_checkpoint
from ._checkpoint import latest_checkpoint as latest_checkpoint
from ._checkpoint import load_checkpoint as load_checkpoint
from ._checkpoint import remove_checkpoint as remove_checkpoint
from ._checkpoint import remove_stale_temporaries as remove_stale_temporaries
from ._checkpoint import write_checkpoint as write_checkpoint
from ._dcp import ShardedCheckpointWriter as ShardedCheckpointWriter
from ._dcp import ShardedSave as ShardedSave
from ._dcp import consolidate_checkpoint as consolidate_checkpoint
from ._ddp import DDPStrategy as DDPStrategy
from ._fsdp import FSDPStrategy as FSDPStrategy
from ._loop import Loop as Loop
from ._loop import LoopEvents as LoopEvents
from ._loops import EvaluationLoop as EvaluationLoop
from ._loops import FitLoop as FitLoop
from ._loops import PredictionLoop as PredictionLoop
from ._loops import TrainEpochLoop as TrainEpochLoop
from ._module import Module as Module
from ._options import TrainerOptions as TrainerOptions
from ._plugin import Delivery as Delivery
from ._plugin import Plugin as Plugin
from ._precision import Precision as Precision
from ._precision import register_precision as register_precision
from ._progress import Counters as Counters
from ._progress import Progress as Progress
from ._records import Publication as Publication
from ._records import PutMixin as PutMixin
from ._records import register_destination as register_destination
from ._run import run as run
from ._runstate import ResumePlan as ResumePlan
from ._runstate import RunState as RunState
from ._sampler import ElasticDistributedSampler as ElasticDistributedSampler
from ._scope import Scope as Scope
from ._seed import seed_everything as seed_everything
from ._state import Stateful as Stateful
from ._strategy import SingleProcess as SingleProcess
from ._strategy import Strategy as Strategy
from ._trainer import SchedulerConfig as SchedulerConfig
from ._trainer import Trainer as Trainer
from ._trainer import set_default_plugins as set_default_plugins

__all__ = [
    "ElasticDistributedSampler",
    "ShardedCheckpointWriter",
    "ShardedSave",
    "consolidate_checkpoint",
    "is_sharded_checkpoint",
    "checkpoint_info",
    "CheckpointMismatch",
    "Counters",
    "DDPStrategy",
    "EvaluationLoop",
    "FSDPStrategy",
    "FitLoop",
    "Loop",
    "LoopEvents",
    "Module",
    "Delivery",
    "Plugin",
    "Precision",
    "PredictionLoop",
    "Progress",
    "Publication",
    "PutMixin",
    "ResumePlan",
    "RunState",
    "SchedulerConfig",
    "Scope",
    "SingleProcess",
    "Stateful",
    "Strategy",
    "TrainEpochLoop",
    "Trainer",
    "TrainerOptions",
    "latest_checkpoint",
    "load_checkpoint",
    "register_destination",
    "register_precision",
    "remove_checkpoint",
    "remove_stale_temporaries",
    "run",
    "seed_everything",
    "set_default_plugins",
    "write_checkpoint",
]
