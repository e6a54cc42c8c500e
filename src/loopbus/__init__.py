"""loopbus: an async, event-driven training-loop engine for PyTorch.

The packages, each importing only those below it (a test enforces it):

    plugins                      the standard plugins; public names only
    stage                        Trainer, options, assembly, lifecycle, preemption
    loop                         the Loop contract and the built-in loops
    checkpoint                   parts, file format, sharded checkpoints, RNG states
    storage                      URLs and object stores (fsspec, imported on use)
    distributed                  strategies: one process, DDP, FSDP2, TP x FSDP2
    step                         Module, optimizers, precision, train/eval steps
    records                      put, the recorder
    data                         batch sources, device moves, the elastic sampler
    state                        run state, Stateful, scopes, seeding
    stream, dashboard            the metric stream; import events only, never torch
    events                       events, records, the bus; no torch
    loopbus._exceptions, _validate, _untrusted, _durable   the base layer

This module only re-exports, and makes what it exports carry the public name
(``loopbus.MisconfigurationError`` in a traceback, not the private module it lives in).
The engine's names (and with them torch and the standard plugins) are imported on first
use: ``import loopbus.stream`` and the ``loopbus`` command stay light.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from . import events as events
from . import stream as stream
from ._durable import fsync_dir as fsync_dir
from ._durable import naming_errors as naming_errors
from ._durable import replace_atomically as replace_atomically
from ._exceptions import CheckpointError as CheckpointError
from ._exceptions import HandlerError as HandlerError
from ._exceptions import LoopbusError as LoopbusError
from ._exceptions import MisconfigurationError as MisconfigurationError
from ._exceptions import Preempted as Preempted
from ._exceptions import ScopeLeakError as ScopeLeakError
from ._exceptions import StopLoop as StopLoop
from ._exceptions import StreamError as StreamError
from ._exceptions import SubscriptionError as SubscriptionError
from ._exceptions import fixup_module_metadata as _fixup_module_metadata
from ._untrusted import check_json_nesting as check_json_nesting
from ._validate import check_choice as check_choice
from ._validate import check_int as check_int
from ._validate import check_local_path as check_local_path
from ._validate import check_number as check_number
from ._version import __version__ as __version__
from .events import DESTINATIONS as DESTINATIONS
from .events import CustomEvent as CustomEvent
from .events import Event as Event
from .events import EventBus as EventBus
from .events import PutRecord as PutRecord
from .events import Subscription as Subscription
from .events import on as on
from .stream import connect as connect

if TYPE_CHECKING:
    from . import plugins as plugins
    from .checkpoint import CheckpointMismatch as CheckpointMismatch
    from .checkpoint import CheckpointRegistry as CheckpointRegistry
    from .checkpoint import ShardedCheckpointWriter as ShardedCheckpointWriter
    from .checkpoint import ShardedSave as ShardedSave
    from .checkpoint import checkpoint_info as checkpoint_info
    from .checkpoint import consolidate_checkpoint as consolidate_checkpoint
    from .checkpoint import is_sharded_checkpoint as is_sharded_checkpoint
    from .checkpoint import latest_checkpoint as latest_checkpoint
    from .checkpoint import load_checkpoint as load_checkpoint
    from .checkpoint import remove_checkpoint as remove_checkpoint
    from .checkpoint import remove_incomplete_checkpoints as remove_incomplete_checkpoints
    from .checkpoint import remove_stale_temporaries as remove_stale_temporaries
    from .checkpoint import write_checkpoint as write_checkpoint
    from .data import ElasticDistributedSampler as ElasticDistributedSampler
    from .data import is_datamodule as is_datamodule
    from .data import prepare_datamodule as prepare_datamodule
    from .distributed import DDPStrategy as DDPStrategy
    from .distributed import FSDPStrategy as FSDPStrategy
    from .distributed import ModelParallelStrategy as ModelParallelStrategy
    from .distributed import SingleProcess as SingleProcess
    from .distributed import Strategy as Strategy
    from .loop import EvaluationLoop as EvaluationLoop
    from .loop import FitLoop as FitLoop
    from .loop import Loop as Loop
    from .loop import LoopEvents as LoopEvents
    from .loop import PredictionLoop as PredictionLoop
    from .loop import Progress as Progress
    from .loop import TrainEpochLoop as TrainEpochLoop
    from .records import Publication as Publication
    from .records import register_destination as register_destination
    from .stage import Delivery as Delivery
    from .stage import Plugin as Plugin
    from .stage import Trainer as Trainer
    from .stage import run as run
    from .stage import run_or_return as run_or_return
    from .stage import set_default_plugins as set_default_plugins
    from .state import RngSnapshot as RngSnapshot
    from .state import Scope as Scope
    from .state import Stateful as Stateful
    from .state import profiling_ranges as profiling_ranges
    from .state import seed_everything as seed_everything
    from .step import Module as Module
    from .step import Precision as Precision
    from .step import SchedulerConfig as SchedulerConfig
    from .step import TrainerView as TrainerView
    from .step import register_precision as register_precision
    from .storage import RemotePath as RemotePath
    from .storage import StoreDeadlines as StoreDeadlines
    from .storage import is_url as is_url


#: The engine's public names, each with the package that defines it; imported on first
#: use.
_ENGINE_NAMES = {
    "ElasticDistributedSampler": "data",
    "is_datamodule": "data",
    "prepare_datamodule": "data",
    "ShardedCheckpointWriter": "checkpoint",
    "ShardedSave": "checkpoint",
    "checkpoint_info": "checkpoint",
    "consolidate_checkpoint": "checkpoint",
    "is_sharded_checkpoint": "checkpoint",
    "CheckpointMismatch": "checkpoint",
    "CheckpointRegistry": "checkpoint",
    "DDPStrategy": "distributed",
    "Delivery": "stage",
    "EvaluationLoop": "loop",
    "FSDPStrategy": "distributed",
    "ModelParallelStrategy": "distributed",
    "FitLoop": "loop",
    "Loop": "loop",
    "LoopEvents": "loop",
    "Module": "step",
    "Plugin": "stage",
    "Precision": "step",
    "PredictionLoop": "loop",
    "Progress": "loop",
    "Publication": "records",
    "RemotePath": "storage",
    "StoreDeadlines": "storage",
    "RngSnapshot": "state",
    "SchedulerConfig": "step",
    "Scope": "state",
    "SingleProcess": "distributed",
    "Stateful": "state",
    "Strategy": "distributed",
    "TrainEpochLoop": "loop",
    "Trainer": "stage",
    "TrainerOptions": "stage",
    "TrainerView": "step",
    "is_url": "storage",
    "latest_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "profiling_ranges": "state",
    "register_destination": "records",
    "register_precision": "step",
    "remove_checkpoint": "checkpoint",
    "remove_incomplete_checkpoints": "checkpoint",
    "remove_stale_temporaries": "checkpoint",
    "run": "stage",
    "run_or_return": "stage",
    "seed_everything": "state",
    "set_default_plugins": "stage",
    "write_checkpoint": "checkpoint",
}

__all__ = [
    "ElasticDistributedSampler",
    "is_datamodule",
    "prepare_datamodule",
    "ShardedCheckpointWriter",
    "ShardedSave",
    "checkpoint_info",
    "consolidate_checkpoint",
    "is_sharded_checkpoint",
    "DESTINATIONS",
    "CheckpointError",
    "CustomEvent",
    "Delivery",
    "CheckpointMismatch",
    "CheckpointRegistry",
    "DDPStrategy",
    "EvaluationLoop",
    "Event",
    "EventBus",
    "FSDPStrategy",
    "FitLoop",
    "HandlerError",
    "Loop",
    "LoopEvents",
    "LoopbusError",
    "MisconfigurationError",
    "ModelParallelStrategy",
    "Module",
    "Plugin",
    "Precision",
    "Preempted",
    "PredictionLoop",
    "Progress",
    "Publication",
    "PutRecord",
    "RemotePath",
    "RngSnapshot",
    "SchedulerConfig",
    "StoreDeadlines",
    "Scope",
    "ScopeLeakError",
    "SingleProcess",
    "Stateful",
    "StopLoop",
    "Strategy",
    "StreamError",
    "Subscription",
    "SubscriptionError",
    "TrainEpochLoop",
    "Trainer",
    "TrainerOptions",
    "TrainerView",
    "__version__",
    "check_choice",
    "check_int",
    "check_json_nesting",
    "check_local_path",
    "fsync_dir",
    "is_url",
    "naming_errors",
    "replace_atomically",
    "check_number",
    "connect",
    "events",
    "latest_checkpoint",
    "load_checkpoint",
    "on",
    "plugins",
    "profiling_ranges",
    "register_destination",
    "register_precision",
    "remove_checkpoint",
    "remove_incomplete_checkpoints",
    "remove_stale_temporaries",
    "run",
    "run_or_return",
    "seed_everything",
    "set_default_plugins",
    "stream",
    "write_checkpoint",
]


#: Whether the engine's names are bound here (see _load_engine).
_engine_loaded = False


def _bind(name: str) -> Any:
    value = getattr(importlib.import_module(f".{_ENGINE_NAMES[name]}", __name__), name)
    globals()[name] = value
    return value


def _load_engine() -> None:
    """Bind the engine's names here, then import the standard plugins (written against
    those names, like user code; importing them registers the mixed precisions and the
    default progress bar). A name its package has not loaded yet (the package loads it
    on first use: the sharded checkpoint's, whose modules import
    ``torch.distributed.checkpoint``, which a run without sharded state never needs) is
    bound at its own first use, by ``__getattr__``."""
    global _engine_loaded
    _engine_loaded = True
    namespace = globals()
    for name, where in _ENGINE_NAMES.items():
        held = vars(importlib.import_module(f".{where}", __name__))
        if name in held:
            namespace[name] = held[name]
    _fixup_module_metadata(__name__, namespace)
    plugins = sys.modules.get(f"{__name__}.plugins")
    if plugins is not None and getattr(plugins.__spec__, "_initializing", False):
        # ``import loopbus.plugins`` came first and asked for an engine name: it is
        # renamed once the import system binds it here (see _Package.__setattr__).
        return
    importlib.import_module(".plugins", __name__)


class _Package(types.ModuleType):
    """This module's type: its public names for the finished ``loopbus.plugins``."""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "plugins" and isinstance(value, types.ModuleType):
            _fixup_module_metadata(value.__name__, vars(value))


def __getattr__(name: str) -> Any:
    if name not in _ENGINE_NAMES and name != "plugins":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if not _engine_loaded:
        _load_engine()
    if name in globals():
        return globals()[name]
    value = _bind(name)  # loaded by its package on first use
    _fixup_module_metadata(__name__, {"__all__": [name], name: value})
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_fixup_module_metadata(__name__, globals())
sys.modules[__name__].__class__ = _Package
