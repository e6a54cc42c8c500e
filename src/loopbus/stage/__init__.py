"""A stage (fit, validate, test, predict) put together and run: the ``Trainer`` facade,
its options, the assembly of the parts, the stage's lifecycle, preemption, the
``Plugin`` base, and ``loopbus.run`` for synchronous code.

The top of the engine: imports every package above, never ``loopbus.plugins`` (the
standard plugins are named by ``loopbus`` itself).
"""

from __future__ import annotations

from ._options import TrainerOptions as TrainerOptions
from ._plugin import Delivery as Delivery
from ._plugin import Plugin as Plugin
from ._run import run as run
from ._run import run_or_return as run_or_return
from ._trainer import Trainer as Trainer
from ._trainer import set_default_plugins as set_default_plugins

__all__ = [
    "Delivery",
    "Plugin",
    "Trainer",
    "TrainerOptions",
    "run",
    "run_or_return",
    "set_default_plugins",
]
