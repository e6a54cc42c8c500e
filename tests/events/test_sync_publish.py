"""``trainer.publish`` from synchronous code: queued in order, delivered at the next
boundary, never lost for want of an ``await``; custom events get step and epoch."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
import torch

import loopbus
from loopbus import CustomEvent, Event, Plugin, Publication, Trainer, on
from loopbus.events import PutRecord, Teardown, TrainBatchCompleted
from tests.helpers import TinyModule, make_loader

pytestmark = pytest.mark.anyio


class Spike(CustomEvent, frozen=True, kw_only=True):
    batch_idx: int


class Plain(Event, frozen=True, kw_only=True):
    text: str


class Publishing(TinyModule):
    """Publishes a Spike from its synchronous training_step, after putting its loss."""

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        loss = super().training_step(batch, ctx)
        # No await: this is synchronous code.
        self.trainer.publish(Spike(batch_idx=ctx.batch_idx))
        return loss


class Listener(Plugin):
    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.trainer: Trainer | None = None

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer

    @on(Spike)
    async def spike(self, event: Spike) -> None:
        assert self.trainer is not None
        # The loss put before the event in the same step is already visible.
        loss = self.trainer.latest["train/loss"]
        self.log.append(("spike", event.batch_idx, event.step, event.epoch, loss.step))

    @on(PutRecord)
    def record(self, record: PutRecord) -> None:
        if record.name == "train/loss":
            self.log.append(("loss", record.step))

    @on(TrainBatchCompleted)
    def batch(self, event: TrainBatchCompleted) -> None:
        self.log.append(("batch", event.batch_idx))


@pytest.mark.parametrize("executor", ["inline", "thread"])
async def test_sync_step_publishes_in_order(executor: Any) -> None:
    listener = Listener()
    trainer = Trainer(max_epochs=2, plugins=[listener], executor=executor)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "coroutine was never awaited"
        await trainer.fit(Publishing(), make_loader(n=32))
        gc.collect()
    expected: list[tuple[Any, ...]] = []
    for epoch in range(2):
        for b in range(2):
            done = epoch * 2 + b  # optimizer steps completed before this step
            expected += [
                ("loss", done + 1),
                # step/epoch as the step saw them (global_step before its optimizer step).
                ("spike", b, done, epoch, done + 1),
                ("batch", b),
            ]
    assert listener.log == expected


async def test_explicit_step_and_epoch_are_kept() -> None:
    seen: list[Spike] = []

    class Module(TinyModule):
        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            self.trainer.publish(Spike(batch_idx=0, step=100, epoch=7))
            return super().training_step(batch, ctx)

    trainer = Trainer(max_steps=1, plugins=[])
    trainer.subscribe(Spike, seen.append)
    await trainer.fit(Module(), make_loader(n=16))
    assert [(e.step, e.epoch) for e in seen] == [(100, 7)]


async def test_awaited_publish_delivers_before_returning() -> None:
    order: list[str] = []

    class Announcer(Plugin):
        @on(TrainBatchCompleted, once=1)
        async def announce(self, event: TrainBatchCompleted) -> None:
            publication = trainer.publish(Plain(text="hello"))
            assert isinstance(publication, Publication)
            order.append("before await")
            await publication
            order.append("after await")

    trainer = Trainer(max_steps=2, plugins=[Announcer()])
    trainer.subscribe(Plain, lambda e: order.append(e.text))
    await trainer.fit(TinyModule(), make_loader(n=32))
    assert order == ["before await", "hello", "after await"]


async def test_publish_from_a_sync_handler_reaches_later_handlers() -> None:
    order: list[str] = []

    class First(Plugin):
        delivery = loopbus.Delivery(priority=10)

        @on(TrainBatchCompleted, once=1)
        def first(self, event: TrainBatchCompleted) -> None:
            trainer.publish(Plain(text="from first"))
            order.append("first")

    class Second(Plugin):
        @on(TrainBatchCompleted, once=1)
        def second(self, event: TrainBatchCompleted) -> None:
            order.append("second")

    trainer = Trainer(max_steps=2, plugins=[First(), Second()])
    trainer.subscribe(Plain, lambda e: order.append(e.text))
    await trainer.fit(TinyModule(), make_loader(n=32))
    assert order == ["first", "from first", "second"]


async def test_publish_from_teardown_is_delivered() -> None:
    got: list[str] = []

    class Closing(Plugin):
        @on(Teardown)
        def closing(self, event: Teardown) -> None:
            trainer.publish(Plain(text=f"bye {event.stage}"))

    trainer = Trainer(max_steps=1, plugins=[Closing()])
    trainer.subscribe(Plain, lambda e: got.append(e.text))
    await trainer.fit(TinyModule(), make_loader(n=16))
    assert got == ["bye fit"]


async def test_publish_outside_a_stage_raises() -> None:
    trainer = Trainer(max_steps=1, plugins=[])
    with pytest.raises(RuntimeError, match=r"no stage runs.*await trainer\.bus\.publish"):
        trainer.publish(Plain(text="x"))
    with pytest.raises(TypeError, match=r"takes an event .* got 'x'"):
        trainer.publish("x")  # type: ignore[arg-type]
