"""loopbus: an async, event-driven training-loop engine for PyTorch.

Dependency rule (a test enforces it):  events  <-  engine  <-  plugins
  * ``loopbus.events`` imports neither torch nor the engine;
  * ``loopbus.engine`` imports events, never plugins;
  * ``loopbus.stream`` (the metric stream's protocol, server and client) imports events
    only, so that ``loopbus watch`` starts without importing torch;
  * ``loopbus.plugins`` import only public names (``loopbus``, ``loopbus.events``,
    ``loopbus.stream``).
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
from ._validate import check_number as check_number
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
    from .engine import CheckpointMismatch as CheckpointMismatch
    from .engine import DDPStrategy as DDPStrategy
    from .engine import Delivery as Delivery
    from .engine import ElasticDistributedSampler as ElasticDistributedSampler
    from .engine import EvaluationLoop as EvaluationLoop
    from .engine import FitLoop as FitLoop
    from .engine import FSDPStrategy as FSDPStrategy
    from .engine import Loop as Loop
    from .engine import LoopEvents as LoopEvents
    from .engine import Module as Module
    from .engine import Plugin as Plugin
    from .engine import Precision as Precision
    from .engine import PredictionLoop as PredictionLoop
    from .engine import Progress as Progress
    from .engine import Publication as Publication
    from .engine import SchedulerConfig as SchedulerConfig
    from .engine import Scope as Scope
    from .engine import ShardedCheckpointWriter as ShardedCheckpointWriter
    from .engine import ShardedSave as ShardedSave
    from .engine import SingleProcess as SingleProcess
    from .engine import Stateful as Stateful
    from .engine import Strategy as Strategy
    from .engine import TrainEpochLoop as TrainEpochLoop
    from .engine import Trainer as Trainer
    from .engine import checkpoint_info as checkpoint_info
    from .engine import consolidate_checkpoint as consolidate_checkpoint
    from .engine import is_sharded_checkpoint as is_sharded_checkpoint
    from .engine import latest_checkpoint as latest_checkpoint
    from .engine import load_checkpoint as load_checkpoint
    from .engine import register_destination as register_destination
    from .engine import register_precision as register_precision
    from .engine import remove_checkpoint as remove_checkpoint
    from .engine import remove_stale_temporaries as remove_stale_temporaries
    from .engine import run as run
    from .engine import seed_everything as seed_everything
    from .engine import set_default_plugins as set_default_plugins
    from .engine import write_checkpoint as write_checkpoint

__version__ = "0.1.0"

#: The names re-exported from ``loopbus.engine``, imported on first use.
_ENGINE_NAMES = (
    "ElasticDistributedSampler",
    "ShardedCheckpointWriter",
    "ShardedSave",
    "checkpoint_info",
    "consolidate_checkpoint",
    "is_sharded_checkpoint",
    "CheckpointMismatch",
    "DDPStrategy",
    "Delivery",
    "EvaluationLoop",
    "FSDPStrategy",
    "FitLoop",
    "Loop",
    "LoopEvents",
    "Module",
    "Plugin",
    "Precision",
    "PredictionLoop",
    "Progress",
    "Publication",
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
)

__all__ = [
    "ElasticDistributedSampler",
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
    "Module",
    "Plugin",
    "Precision",
    "Preempted",
    "PredictionLoop",
    "Progress",
    "Publication",
    "PutRecord",
    "SchedulerConfig",
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
    "__version__",
    "check_choice",
    "check_int",
    "check_json_nesting",
    "check_number",
    "connect",
    "events",
    "latest_checkpoint",
    "load_checkpoint",
    "on",
    "plugins",
    "register_destination",
    "register_precision",
    "remove_checkpoint",
    "remove_stale_temporaries",
    "run",
    "seed_everything",
    "set_default_plugins",
    "stream",
    "write_checkpoint",
]


def _load_engine() -> None:
    """Bind the engine's names here, then import the standard plugins (written against
    those names, like user code; importing them registers the mixed precisions and the
    default progress bar)."""
    namespace = globals()
    engine = importlib.import_module(".engine", __name__)
    for name in _ENGINE_NAMES:
        namespace[name] = getattr(engine, name)
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
    if name in _ENGINE_NAMES or name == "plugins":
        _load_engine()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_fixup_module_metadata(__name__, globals())
sys.modules[__name__].__class__ = _Package
