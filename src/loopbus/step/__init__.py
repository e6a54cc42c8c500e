"""One step: the user's ``Module``, its optimizers and schedulers, precision (autocast,
grad scaling), and the train and eval steps that run them (eager or compiled); and
``TrainerView``, the protocol that modules, loops and plugins see the trainer through.

Imports ``loopbus.records``, ``loopbus.data``, ``loopbus.state``, ``loopbus.events``.
"""

from __future__ import annotations

from ._module import Module as Module
from ._optim import SchedulerConfig as SchedulerConfig
from ._precision import Precision as Precision
from ._precision import register_precision as register_precision
from ._trainer_view import TrainerView as TrainerView

__all__ = [
    "Module",
    "Precision",
    "SchedulerConfig",
    "TrainerView",
    "register_precision",
]
