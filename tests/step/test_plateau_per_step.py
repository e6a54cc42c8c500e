"""A step-interval ``ReduceLROnPlateau`` monitoring a record the training step puts sees
that step's value (the record is not delivered yet when the scheduler steps)."""

from __future__ import annotations

from typing import Any

import torch

from loopbus import Module, Trainer
from tests.helpers import make_loader


class Seen(torch.optim.lr_scheduler.ReduceLROnPlateau):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[float] = []

    def step(self, metrics: Any, epoch: Any = None) -> None:  # type: ignore[override]
        self.seen.append(float(metrics))
        super().step(metrics)


class PerStep(Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(2, 1)
        self.put_values: list[float] = []

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        value = 10.0 - self.trainer.global_step  # known per step
        self.put_values.append(value)
        self.put("train/metric", torch.tensor(value))
        return self.w(torch.ones(1, 2)).sum()

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        self.plateau = Seen(opt, patience=100)
        return {
            "optimizer": opt,
            "lr_scheduler": {
                "scheduler": self.plateau,
                "interval": "step",
                "monitor": "train/metric",
            },
        }


async def test_a_step_scheduler_sees_the_value_its_step_put() -> None:
    module = PerStep()
    await Trainer(max_steps=6, plugins=[], device="cpu").fit(module, make_loader(n=64))
    assert module.plateau.seen == module.put_values == [10.0, 9.0, 8.0, 7.0, 6.0, 5.0]
