"""Learning-rate monitor: puts the learning rate of every optimizer parameter group."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Literal

import torch

from loopbus import Plugin, check_choice, on
from loopbus.events import TrainBatchStarted, TrainEpochStarted

if TYPE_CHECKING:
    from loopbus import TrainerView

__all__ = ["LearningRateMonitor"]

_INTERVALS = {"step": "every training batch", "epoch": "once per epoch"}


class LearningRateMonitor(Plugin):
    """Puts the learning rate of each parameter group of each optimizer.

    Names follow Lightning's: ``lr-SGD`` for an optimizer with one group,
    ``lr-SGD/pg1``, ``lr-SGD/pg2``, ... for several (``lr-SGD/<name>`` when a group has a
    ``"name"`` key), and ``lr-SGD-1`` for the second of two optimizers of one class. With
    ``log_momentum`` it also puts ``momentum-SGD`` (``betas[0]`` for Adam-like
    optimizers).

    ``logging_interval="step"`` puts the rates at the start of every training batch, so
    a record carries the rate its step used and lands in the same logger row as that
    step's loss; ``"epoch"`` puts them once at the start of each epoch::

        trainer = Trainer(plugins=[ProgressBar(), CSVLogger("runs"), LearningRateMonitor()])
    """

    def __init__(
        self,
        logging_interval: Literal["step", "epoch"] = "step",
        *,
        log_momentum: bool = False,
        destinations: str | Iterable[str] = ("loggers",),
    ) -> None:
        check_choice("logging_interval", logging_interval, _INTERVALS, owner="LearningRateMonitor")
        self.logging_interval = logging_interval
        self.log_momentum = log_momentum
        self.destinations = (
            (destinations,) if isinstance(destinations, str) else tuple(destinations)
        )
        self._names: list[tuple[Any, list[str], list[str]]] = []
        self._trainer: TrainerView | None = None

    def setup(self, trainer: TrainerView, stage: str) -> None:
        self._names = []
        if stage == "fit":
            self._trainer = trainer

    def teardown(self, trainer: TrainerView, stage: str) -> None:
        self._names = []
        self._trainer = None

    def _prepare(self, optimizers: Iterable[torch.optim.Optimizer]) -> None:
        seen: Counter[str] = Counter()
        for opt in optimizers:
            cls = type(opt).__name__
            base = f"{cls}-{seen[cls]}" if seen[cls] else cls
            seen[cls] += 1
            groups = opt.param_groups
            suffixes = []
            for j, group in enumerate(groups):
                if "name" in group:
                    suffixes.append(f"/{group['name']}")
                else:
                    suffixes.append("" if len(groups) == 1 else f"/pg{j + 1}")
            self._names.append(
                (
                    opt,
                    [f"lr-{base}{s}" for s in suffixes],
                    [f"momentum-{base}{s}" for s in suffixes],
                )
            )

    def put_rates(self) -> None:
        """Put the current learning rates (and momenta) now."""
        trainer = self._trainer
        if trainer is None:
            return
        if not self._names or len(self._names) != len(trainer.optimizers):
            self._names = []
            self._prepare(trainer.optimizers)
        destinations = self.destinations
        for opt, lr_names, momentum_names in self._names:
            for group, lr_name, momentum_name in zip(
                opt.param_groups, lr_names, momentum_names, strict=True
            ):
                self.put(lr_name, _snapshot(group["lr"]), destinations)
                if self.log_momentum:
                    momentum = group.get("momentum")
                    if momentum is None and "betas" in group:
                        momentum = group["betas"][0]
                    if momentum is not None:
                        self.put(momentum_name, _snapshot(momentum), destinations)

    @on(TrainBatchStarted)
    def _batch_started(self, event: TrainBatchStarted) -> None:
        if self.logging_interval == "step":
            self.put_rates()

    @on(TrainEpochStarted)
    def _epoch_started(self, event: TrainEpochStarted) -> None:
        if self.logging_interval == "epoch":
            self.put_rates()


def _snapshot(value: Any) -> Any:
    # A tensor rate (capturable optimizers) is changed in place by schedulers; put reads
    # values after the step, so put a copy.
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return value
