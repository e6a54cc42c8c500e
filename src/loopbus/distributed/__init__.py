"""How a run spreads over processes: the ``Strategy`` interface, one process, DDP,
FSDP2, tensor parallelism with FSDP2 on a named mesh, fault-tolerant replica groups on
torchft (``_ft.py``), and the stop control
(``_stopping.py``): the one place that turns stop requests into a stop, agreed across
ranks over the collectives a strategy gives.

Imports ``loopbus.step``, ``loopbus.data``, ``loopbus.state``.
"""

from __future__ import annotations

from ._ddp import DDPStrategy as DDPStrategy
from ._fsdp import FSDPStrategy as FSDPStrategy
from ._ft import FaultTolerantStrategy as FaultTolerantStrategy
from ._model_parallel import ModelParallelStrategy as ModelParallelStrategy
from ._stopping import StopTransport as StopTransport
from ._strategy import SingleProcess as SingleProcess
from ._strategy import Strategy as Strategy

__all__ = [
    "DDPStrategy",
    "FSDPStrategy",
    "FaultTolerantStrategy",
    "ModelParallelStrategy",
    "SingleProcess",
    "StopTransport",
    "Strategy",
]
