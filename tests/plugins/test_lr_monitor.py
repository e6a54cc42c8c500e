from __future__ import annotations

from typing import Any

import pytest
import torch

import loopbus
from loopbus import Plugin, PutRecord, Trainer, on
from loopbus.plugins import LearningRateMonitor
from tests.helpers import TinyModule, make_loader


class Records(Plugin):
    delivery = loopbus.Delivery(destination="loggers")

    def __init__(self) -> None:
        self.seen: list[PutRecord] = []

    @on(PutRecord)
    def keep(self, record: PutRecord) -> None:
        self.seen.append(record)

    def values(self, name: str) -> list[tuple[int, Any]]:
        return [(r.step, r.value) for r in self.seen if r.name == name]


class TwoGroups(TinyModule):
    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(
            [
                {"params": [self.layer.weight], "lr": 0.1},
                {"params": [self.layer.bias], "lr": 0.01, "momentum": 0.5},
            ],
            momentum=0.9,
        )
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


async def test_puts_each_param_group_every_step() -> None:
    records = Records()
    trainer = Trainer(
        max_steps=3, plugins=[records, LearningRateMonitor(log_momentum=True)], device="cpu"
    )
    await trainer.fit(TwoGroups(), make_loader(n=64))
    # The rate a step used, in the row of that step.
    assert records.values("lr-SGD/pg1") == [(1, 0.1), (2, 0.05), (3, 0.025)]
    assert records.values("lr-SGD/pg2") == [(1, 0.01), (2, 0.005), (3, 0.0025)]
    assert records.values("momentum-SGD/pg1") == [(1, 0.9), (2, 0.9), (3, 0.9)]
    assert records.values("momentum-SGD/pg2") == [(1, 0.5), (2, 0.5), (3, 0.5)]
    assert {r.destinations for r in records.seen if r.name.startswith("lr-")} == {("loggers",)}


async def test_epoch_interval_names_and_destinations() -> None:
    class Named(TinyModule):
        def configure_optimizers(self) -> Any:
            return torch.optim.Adam([{"params": self.parameters(), "name": "body"}], lr=0.002)

    records = Records()
    monitor = LearningRateMonitor(
        "epoch", log_momentum=True, destinations=["loggers", "progress_bar"]
    )
    trainer = Trainer(max_epochs=2, plugins=[records, monitor], device="cpu")
    await trainer.fit(Named(), make_loader(n=64))
    assert records.values("lr-Adam/body") == [(1, 0.002), (5, 0.002)]
    assert records.values("momentum-Adam/body") == [(1, 0.9), (5, 0.9)]
    assert trainer.latest["lr-Adam/body"].destinations == ("loggers", "progress_bar")


async def test_several_optimizers_of_one_class() -> None:
    class Manual(TinyModule):
        automatic_optimization = False

        def __init__(self) -> None:
            super().__init__()
            self.other = torch.nn.Linear(4, 2)

        def training_step(self, batch: Any, ctx: Any) -> None:  # type: ignore[override]
            for opt in self.optimizers():
                opt.zero_grad()
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self(x) + self.other(x), y)
            self.manual_backward(loss)
            for opt in self.optimizers():
                opt.step()

        def configure_optimizers(self) -> Any:
            return [
                torch.optim.SGD(self.layer.parameters(), lr=0.1),
                torch.optim.SGD(self.other.parameters(), lr=0.2),
            ]

    records = Records()
    trainer = Trainer(max_steps=1, plugins=[records, LearningRateMonitor()], device="cpu")
    await trainer.fit(Manual(), make_loader(n=32))
    assert records.values("lr-SGD") == [(1, 0.1)]
    assert records.values("lr-SGD-1") == [(1, 0.2)]


def test_bad_interval_is_reported() -> None:
    with pytest.raises(ValueError, match=r"logging_interval=.*got 'batch'"):
        LearningRateMonitor("batch")  # type: ignore[arg-type]
