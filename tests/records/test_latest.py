"""``trainer.latest``: the last value of every name across stages, and what one handler
of an event puts is visible to the handlers after it (same event)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import loopbus
from loopbus import Module, Plugin, Trainer, on
from loopbus.events import EpochCompleted, PutRecord, ValidationCompleted
from tests.helpers import TinyModule, make_loader

pytestmark = pytest.mark.anyio


class Predicting(TinyModule):
    def predict_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        self.put("predict/seen", batch[0].shape[0])
        out: torch.Tensor = self(batch[0])
        return out


async def test_latest_keeps_every_stage() -> None:
    module = Predicting()
    trainer = Trainer(max_epochs=1, plugins=[])
    await trainer.fit(module, make_loader(), make_loader())
    after_fit = {name: r.value for name, r in trainer.latest.items()}
    assert set(after_fit) == {"train/loss", "val/loss"}

    result = await trainer.test(module, make_loader())
    # test returns (and stage_latest holds) only its own records ...
    assert set(result) == {"test/loss"}
    assert set(trainer.stage_latest) == {"test/loss"}
    # ... while latest still has fit's, unchanged.
    assert set(trainer.latest) == {"train/loss", "val/loss", "test/loss"}
    assert trainer.latest["train/loss"].value == after_fit["train/loss"]

    await trainer.predict(module, make_loader())
    assert set(trainer.latest) == {"train/loss", "val/loss", "test/loss", "predict/seen"}
    assert trainer.latest["predict/seen"].value == 16


async def test_a_newer_stage_overwrites_a_name() -> None:
    module = TinyModule()
    trainer = Trainer(max_epochs=1, plugins=[])
    await trainer.fit(module, make_loader(), make_loader())
    fit_record = trainer.latest["val/loss"]
    # Different data, so a different loss: validate's record replaces fit's.
    result = await trainer.validate(module, make_loader(seed=5))
    assert result == {"val/loss": trainer.latest["val/loss"].value}
    assert trainer.latest["val/loss"].value != fit_record.value
    assert trainer.latest["val/loss"].source == "TinyModule"
    assert "train/loss" in trainer.latest


async def test_latest_is_in_checkpoints_across_stages() -> None:
    module = TinyModule()
    trainer = Trainer(max_epochs=1, plugins=[])
    await trainer.fit(module, make_loader(), make_loader())
    await trainer.test(module, make_loader())
    records = trainer.state_dict()["records"]
    assert set(records) == {"train/loss", "val/loss", "test/loss"}


class EpochAccuracy(Module):
    """Puts ``val/x`` (this epoch's number) from a ValidationCompleted handler."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        loss: torch.Tensor = self.layer(batch[0]).sum()
        return loss

    def validation_step(self, batch: Any, ctx: Any) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    @on(ValidationCompleted, priority=10)
    def put_x(self, event: ValidationCompleted) -> None:
        # A tensor, as a torchmetrics compute() returns: read on the host in a flush.
        self.put("val/x", torch.tensor(float(event.epoch)))


class NewBest(Plugin):
    """Runs after the module's handler (lower priority) and reads ``trainer.latest``."""

    delivery = loopbus.Delivery(priority=-10)

    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []
        self.records: list[tuple[str, int]] = []
        self.trainer: Trainer | None = None

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer

    @on(ValidationCompleted)
    def report(self, event: ValidationCompleted) -> None:
        assert self.trainer is not None
        self.seen.append((event.epoch, float(self.trainer.latest["val/x"].value)))
        self.records.append(("handler", event.epoch))

    @on(PutRecord)
    def record(self, record: PutRecord) -> None:
        if record.name == "val/x":
            self.records.append(("record", record.epoch))


async def test_later_handler_sees_this_epochs_record() -> None:
    plugin = NewBest()
    trainer = Trainer(max_epochs=3, plugins=[plugin])
    await trainer.fit(EpochAccuracy(), make_loader(n=32), make_loader(n=16))
    # Each epoch's handler sees that epoch's value, not the previous validation's.
    assert plugin.seen == [(0, 0.0), (1, 1.0), (2, 2.0)]
    # And record subscribers get the record before the next handler runs.
    assert plugin.records == [
        ("record", 0),
        ("handler", 0),
        ("record", 1),
        ("handler", 1),
        ("record", 2),
        ("handler", 2),
    ]


class Counting(Plugin):
    """Counts the flushes between handlers: put records per step reach the loggers."""

    def __init__(self) -> None:
        self.values: list[float] = []

    @on(EpochCompleted, priority=5)
    def put_epoch(self, event: EpochCompleted) -> None:
        self.put("epoch/n", event.epoch)

    @on(EpochCompleted, priority=-5)
    def read_epoch(self, event: EpochCompleted) -> None:
        assert self._trainer is not None
        self.values.append(float(self._trainer.latest["epoch/n"].value))

    def setup(self, trainer: Trainer, stage: str) -> None:
        self._trainer = trainer

    _trainer: Trainer | None = None


async def test_same_event_visibility_for_plugins_without_validation() -> None:
    plugin = Counting()
    trainer = Trainer(max_epochs=2, plugins=[plugin])
    await trainer.fit(TinyModule(), make_loader(n=32))
    assert plugin.values == [0.0, 1.0]


class PutsTwice(TinyModule):
    """Puts one name twice a step: to callbacks (someone listens) and then to loggers
    (nobody does), or the other way round."""

    def __init__(self, first: str, second: str) -> None:
        super().__init__()
        self.order = (first, second)

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        first, second = self.order
        self.put("twice", 1.0, destinations=first)
        self.put("twice", 2.0, destinations=second)
        return super().training_step(batch, ctx)


@pytest.mark.parametrize(("first", "second"), [("callbacks", "loggers"), ("loggers", "callbacks")])
async def test_the_latest_of_a_name_is_the_last_put_whoever_listens(
    first: str, second: str
) -> None:
    trainer = Trainer(max_epochs=1, plugins=[], limit_train_batches=2)
    heard: list[float] = []
    trainer.subscribe(
        PutRecord,
        lambda r: heard.append(r.value) if r.name == "twice" else None,
        destination="callbacks",
    )
    await trainer.fit(PutsTwice(first, second), make_loader())
    assert heard == ([1.0, 1.0] if first == "callbacks" else [2.0, 2.0])
    assert trainer.latest["twice"].value == 2.0
    assert trainer.latest["twice"].destinations == (second,)
