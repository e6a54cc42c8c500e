"""Which strategy a trainer runs with: ``Trainer(strategy=...)`` resolved to an instance.
Above the strategies it names, so that none of them imports another's module lazily."""

from __future__ import annotations

from ._ddp import DDPStrategy
from ._fsdp import FSDPStrategy
from ._strategy import SingleProcess, Strategy, launched_distributed

__all__ = ["resolve_strategy"]


def resolve_strategy(
    name: str | Strategy, process_group_timeout: float, stop_check_interval: float
) -> Strategy:
    """The strategy of ``Trainer(strategy=...)``: an instance as given, or one by name
    (``"auto"``: DDP under a launcher of several processes, else one process)."""
    if isinstance(name, Strategy):
        return name
    if name == "auto":
        name = "ddp" if launched_distributed() else "single"
    if name == "ddp":
        return DDPStrategy(process_group_timeout, stop_check_interval)
    if name == "fsdp":
        return FSDPStrategy(
            process_group_timeout=process_group_timeout, stop_check_interval=stop_check_interval
        )
    return SingleProcess()
