"""How a run spreads over processes: the ``Strategy`` interface, one process, DDP and
FSDP2, and the exchange that agrees stop requests across ranks.

Imports ``loopbus.step``, ``loopbus.data``, ``loopbus.state``.
"""

from __future__ import annotations

from ._ddp import DDPStrategy as DDPStrategy
from ._fsdp import FSDPStrategy as FSDPStrategy
from ._strategy import SingleProcess as SingleProcess
from ._strategy import Strategy as Strategy

__all__ = [
    "DDPStrategy",
    "FSDPStrategy",
    "SingleProcess",
    "Strategy",
]
