"""One step: the user's ``Module``, its optimizers and schedulers, precision (autocast,
grad scaling), and the train and eval steps that run them (eager or compiled).

Imports ``loopbus.records``, ``loopbus.data``, ``loopbus.state``, ``loopbus.events``.
"""

from __future__ import annotations

from ._module import Module as Module
from ._optim import SchedulerConfig as SchedulerConfig
from ._precision import Precision as Precision
from ._precision import register_precision as register_precision

__all__ = [
    "Module",
    "Precision",
    "SchedulerConfig",
    "register_precision",
]
