"""The loops: the ``Loop`` contract (Lightning's structure, async, each hook an event),
progress counters, and the built-in fit, epoch, evaluation and prediction loops.

Imports ``loopbus.step``, ``loopbus.data``, ``loopbus.checkpoint`` (RNG states),
``loopbus.state``, ``loopbus.events``.
"""

from __future__ import annotations

from ._loop import Loop as Loop
from ._loop import LoopEvents as LoopEvents
from ._loops import EvaluationLoop as EvaluationLoop
from ._loops import FitLoop as FitLoop
from ._loops import PredictionLoop as PredictionLoop
from ._loops import TrainEpochLoop as TrainEpochLoop
from ._progress import Counters as Counters
from ._progress import Progress as Progress

__all__ = [
    "Counters",
    "EvaluationLoop",
    "FitLoop",
    "Loop",
    "LoopEvents",
    "PredictionLoop",
    "Progress",
    "TrainEpochLoop",
]
