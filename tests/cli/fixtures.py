"""Class paths the configuration tests name: a plugin that saves the trained weights, a
module with a required argument, data in shapes a stage refuses."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

from loopbus import Plugin, Trainer, on
from loopbus.events import FitCompleted, TrainBatchCompleted
from tests.helpers import TinyModule, make_loader


class SaveWeights(Plugin):
    """Saves the module's weights to ``path`` when ``fit`` ends."""

    def __init__(self, path: str) -> None:
        self.path = path

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer

    @on(FitCompleted)
    def save(self, event: FitCompleted) -> None:
        module = self.trainer.module
        assert module is not None
        torch.save(module.state_dict(), self.target())

    def target(self) -> str:
        return self.path


class NeedsWidth(TinyModule):
    """A module with a required argument."""

    def __init__(self, width: int, lr: float = 0.1) -> None:
        super().__init__(n_in=4, n_out=width, lr=lr)


def three_loaders(n: int = 32) -> tuple[Any, Any, Any]:
    return make_loader(n), make_loader(n), make_loader(n)


def loaders(n: int = 64, batch_size: int = 16) -> tuple[Any, Any]:
    """Training and validation loaders, as ``examples/digits.py``'s ``digits_loaders``."""
    return make_loader(n, batch_size, seed=0), make_loader(n, batch_size, seed=1)


class SaveRankWeights(SaveWeights):
    """Saves each rank's module weights to ``<path>.rank<R>`` when ``fit`` ends."""

    def target(self) -> str:
        return f"{self.path}.rank{self.trainer.global_rank}"


class KillAt(Plugin):
    """Kills its own process (SIGKILL: no handler, nothing flushed) after optimizer step
    ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer

    @on(TrainBatchCompleted)
    def kill(self, event: TrainBatchCompleted) -> None:
        if self.trainer.global_step >= self.step:
            os.kill(os.getpid(), signal.SIGKILL)
