"""Optimizers and LR schedulers: what ``configure_optimizers`` returns, parsed once, and
the schedulers stepped at their interval."""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Protocol

import torch

from .._exceptions import MisconfigurationError

if TYPE_CHECKING:
    from loopbus.state._runstate import RunState

__all__ = ["LRSchedulers", "SchedulerConfig", "parse_optimizers"]


class SchedulerConfig:
    """A learning-rate scheduler and when to step it."""

    __slots__ = ("frequency", "interval", "monitor", "scheduler")

    def __init__(
        self,
        scheduler: Any,
        interval: str = "epoch",
        frequency: int = 1,
        monitor: str | None = None,
    ) -> None:
        if interval not in ("epoch", "step"):
            raise MisconfigurationError(
                f"lr scheduler interval must be 'epoch' or 'step', got {interval!r}."
            )
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
            raise MisconfigurationError(
                f"lr scheduler frequency must be an int >= 1, got {frequency!r}."
            )
        if not hasattr(scheduler, "step"):
            raise MisconfigurationError(f"{scheduler!r} is not an LR scheduler (no .step()).")
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and not monitor:
            raise MisconfigurationError(
                "ReduceLROnPlateau needs a metric: configure it as {'scheduler': sched, "
                "'monitor': 'val/loss'} with the name of a put record."
            )
        self.scheduler = scheduler
        self.interval = interval
        self.frequency = frequency
        self.monitor = monitor

    def __repr__(self) -> str:
        return (
            f"SchedulerConfig({type(self.scheduler).__name__}, interval={self.interval!r}, "
            f"frequency={self.frequency}, monitor={self.monitor!r})"
        )


def parse_scheduler(item: Any) -> SchedulerConfig:
    if isinstance(item, SchedulerConfig):
        return item
    if isinstance(item, dict):
        unknown = set(item) - {"scheduler", "interval", "frequency", "monitor", "name", "strict"}
        if unknown or "scheduler" not in item:
            raise MisconfigurationError(
                "an lr scheduler config is {'scheduler': s, 'interval': 'epoch'|'step', "
                f"'frequency': 1, 'monitor': name}}; got keys {sorted(item)}."
            )
        return SchedulerConfig(
            item["scheduler"],
            item.get("interval", "epoch"),
            item.get("frequency", 1),
            item.get("monitor"),
        )
    return SchedulerConfig(item)


def parse_optimizers(
    value: Any, module: torch.nn.Module
) -> tuple[list[Any], list[SchedulerConfig]]:
    what = f"{type(module).__name__}.configure_optimizers()"
    if isinstance(value, torch.optim.Optimizer):
        return [value], []
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, (list, tuple)):
        if (
            len(value) == 2
            and isinstance(value[0], (list, tuple))
            and isinstance(value[1], (list, tuple))
        ):
            opts = list(value[0])
            scheds = [parse_scheduler(s) for s in value[1]]
        elif all(isinstance(v, dict) for v in value) and value:
            opts, scheds = [], []
            for d in value:
                if "optimizer" not in d:
                    raise MisconfigurationError(f"{what} returned a dict without 'optimizer'.")
                opts.append(d["optimizer"])
                if d.get("lr_scheduler") is not None:
                    scheds.append(parse_scheduler(d["lr_scheduler"]))
        else:
            opts, scheds = list(value), []
        bad = [o for o in opts if not isinstance(o, torch.optim.Optimizer)]
        if bad or not opts:
            raise MisconfigurationError(
                f"{what} must return torch optimizers; got {bad or value!r}."
            )
        return opts, scheds
    raise MisconfigurationError(
        f"{what} returned {value!r}; return an optimizer, a list of them, "
        "(optimizers, schedulers), or {'optimizer': opt, 'lr_scheduler': sched}."
    )


class RecordReader(Protocol):
    """What a scheduler that monitors a record asks of the recorder."""

    def last_value(self, name: str) -> Any: ...

    def latest_records(self) -> dict[str, Any]: ...


class LRSchedulers:
    """The LR schedulers of a fit and when they step: ``step("step")`` after each
    optimizer step, ``step("epoch")`` at each epoch end, each config at its frequency
    (a monitoring one with the last value of its record). Built when the optimizers are
    configured; ``resumed_at(step)`` tells it a checkpoint put the run at ``step``, so
    that the first scheduler steps after a resume, before any optimizer step in this
    process, do not trigger torch's warning about their order (it is right)."""

    __slots__ = ("_resumed_at", "configs", "configured", "per_step", "records", "state")

    def __init__(
        self, configs: list[SchedulerConfig], state: RunState, records: RecordReader
    ) -> None:
        self.configs = configs
        self.state = state
        self.records = records
        #: Whether a scheduler is configured with ``interval="step"``.
        self.per_step = any(c.interval == "step" for c in configs)
        #: Whether any scheduler is configured (it changes the learning rate).
        self.configured = bool(configs)
        self._resumed_at: int | None = None

    def resumed_at(self, step: int | None) -> None:
        """A checkpoint put the run at ``step`` (None: the stage ended)."""
        self._resumed_at = step

    def step(self, interval: str) -> None:
        """Step the schedulers configured with ``interval`` that are due."""
        if self._resumed_at is not None and self._resumed_at == self.state.step:
            with warnings.catch_warnings():
                warnings.filterwarnings(
                    "ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before"
                )
                self._step(interval)
            return
        self._step(interval)

    def _step(self, interval: str) -> None:
        state = self.state
        for config in self.configs:
            if config.interval != interval:
                continue
            counter = state.step if interval == "step" else state.epoch + 1
            if counter % config.frequency:
                continue
            if config.monitor is None:
                config.scheduler.step()
                continue
            value = self.records.last_value(config.monitor)
            if value is None:
                raise MisconfigurationError(
                    f"the LR scheduler monitors {config.monitor!r}, but no record of that name "
                    f"was put; put names so far: {sorted(self.records.latest_records())}."
                )
            config.scheduler.step(value)
