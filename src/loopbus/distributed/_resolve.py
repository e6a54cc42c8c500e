"""Which strategy a trainer runs with: ``Trainer(strategy=...)`` resolved to an instance.
Above the strategies it names, so that none of them imports another's module lazily."""

from __future__ import annotations

from ._ddp import DDPStrategy
from ._fsdp import FSDPStrategy
from ._ft import FaultTolerantStrategy
from ._strategy import SingleProcess, Strategy, launched_distributed

__all__ = ["resolve_strategy"]


def resolve_strategy(
    name: str | Strategy, process_group_timeout_s: float, stop_check_interval_s: float
) -> Strategy:
    """The strategy of ``Trainer(strategy=...)``: an instance as given, or one by name
    (``"auto"``: DDP under a launcher of several processes, else one process; ``"ft"``:
    fault tolerant, configured from the environment)."""
    if isinstance(name, Strategy):
        return name
    if name == "auto":
        name = "ddp" if launched_distributed() else "single"
    if name == "ddp":
        return DDPStrategy(process_group_timeout_s, stop_check_interval_s)
    if name == "fsdp":
        return FSDPStrategy(
            process_group_timeout_s=process_group_timeout_s,
            stop_check_interval_s=stop_check_interval_s,
        )
    if name == "ft":
        return FaultTolerantStrategy()
    return SingleProcess()
