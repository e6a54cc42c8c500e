"""The training step's room: the variant is chosen once, from the options; the variants
agree; the options are one frozen, validated value; modules and plugins are bound through
their own public methods."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from loopbus import MisconfigurationError, Plugin, Precision, Strategy, Trainer, TrainerOptions
from loopbus.events import EventBus, TrainBatchCompleted
from loopbus.state._runstate import RunState
from loopbus.step._step import (
    StepBoundary,
    StepEvents,
    StepOptions,
    StepParts,
    TrainStep,
)
from tests.helpers import TinyModule, make_loader


class _Schedulers:
    def __init__(self, per_step: bool = False) -> None:
        self.per_step = per_step
        self.steps: list[str] = []

    def step(self, interval: str) -> None:
        self.steps.append(interval)


class _Strategy(Strategy):
    def no_sync(self) -> Any:
        raise AssertionError("no accumulation here")


def _step(options: StepOptions, *, optimizers: int = 1, per_step: bool = False) -> TrainStep:
    module = TinyModule()
    trainer = Trainer(plugins=[])
    bus = EventBus()
    state = RunState()
    opts = [torch.optim.SGD(module.parameters(), lr=0.1) for _ in range(optimizers)]
    return TrainStep.build(
        StepParts(
            forward=module.training_step,
            optimizers=opts,
            schedulers=_Schedulers(per_step),
            precision=Precision(),
            strategy=_Strategy(),
            state=state,
            events=StepEvents(bus.table, bus.deliver_sync, "train", state),
            options=options,
            boundary=StepBoundary(trainer.recorder, 0.0),
            worker=None,
            module=module,
        )
    )


def test_the_variant_is_chosen_at_build_time_from_the_options() -> None:
    assert _step(StepOptions()).variant == "plain"
    assert _step(StepOptions(clip_val=1.0)).variant == "general"
    assert _step(StepOptions(accumulate=2)).variant == "general"
    assert _step(StepOptions(), per_step=True).variant == "general"
    assert _step(StepOptions(automatic=False), optimizers=2).variant == "manual"
    # Without accumulation the epoch's function is the variant itself: nothing per batch.
    step = _step(StepOptions())
    assert step.for_epoch(lambda size: True) == step._plain


def test_automatic_optimization_with_two_optimizers_is_refused_at_build_time() -> None:
    with pytest.raises(MisconfigurationError, match="automatic optimization steps exactly one"):
        _step(StepOptions(), optimizers=2)


async def test_the_plain_and_the_general_step_train_bit_identically() -> None:
    # A clipping norm no gradient reaches scales by exactly 1: the general path then
    # does the plain path's arithmetic, through its own code.
    weights = []
    for clip in (None, 1e12):
        torch.manual_seed(0)
        module = TinyModule()
        trainer = Trainer(max_epochs=2, plugins=[], gradient_clip_val=clip)
        await trainer.fit(module, make_loader(shuffle=True))
        weights.append(module.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_the_options_are_one_frozen_validated_value() -> None:
    trainer = Trainer(max_epochs=3, limit_train_batches=0.5, plugins=[])
    options = trainer.options
    assert isinstance(options, TrainerOptions)
    assert (trainer.max_epochs, trainer.limit_train_batches) == (3, 0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.max_epochs = 4  # type: ignore[misc]
    trainer.max_epochs = 4
    assert trainer.options.max_epochs == 4
    assert options.max_epochs == 3
    with pytest.raises(MisconfigurationError, match="max_epochs"):
        trainer.max_epochs = -5
    with pytest.raises(MisconfigurationError, match="accumulate_grad_batches"):
        trainer.accumulate_grad_batches = 0
    assert trainer.options.max_epochs == 4  # a refused change changes nothing
    with pytest.raises(AttributeError, match=r"Trainer.device cannot be changed"):
        trainer.device = torch.device("cpu")
    assert TrainerOptions.parse(fast_dev_run=True).limit_val_batches == 1


async def test_module_and_plugins_are_bound_through_their_own_methods() -> None:
    seen: list[Any] = []

    class Probe(Plugin):
        def setup(self, trainer: Trainer, stage: str) -> None:
            self.put("probe/setup", 1)

    module = TinyModule()
    probe = Probe()
    trainer = Trainer(max_steps=2, plugins=[probe])
    trainer.subscribe(TrainBatchCompleted, lambda e: seen.append(module.trainer))
    await trainer.fit(module, make_loader())
    assert seen == [trainer, trainer]
    assert trainer.latest["probe/setup"].source == "Probe"
    # Unbound when the stage ends.
    with pytest.raises(RuntimeError, match="not attached to a running Trainer"):
        _ = module.trainer
    with pytest.raises(RuntimeError, match="outside a Trainer stage"):
        probe.put("late", 1)
    with pytest.raises(RuntimeError, match="outside a Trainer stage"):
        module.put("late", 1)


async def test_each_parameter_keeps_its_gradient_accumulator_for_the_stage() -> None:
    # Autograd holds a parameter's accumulator node only weakly: once a step's scope has
    # freed its graph, a node nothing else holds is made anew by the next forward. The
    # step holds each one for the stage, so a mark set on them at the first batch is
    # still there at the last.
    module = TinyModule()
    trainer = Trainer(max_steps=4, plugins=[])
    marked: list[bool] = []

    def accumulators() -> list[Any]:
        with torch.enable_grad():
            return [p.view_as(p).grad_fn.next_functions[0][0] for p in module.parameters()]

    def mark(event: TrainBatchCompleted) -> None:
        nodes = accumulators()
        if not marked:
            for node in nodes:
                node.metadata["first batch"] = True
        marked.append(all(node.metadata.get("first batch") for node in nodes))

    trainer.subscribe(TrainBatchCompleted, mark)
    await trainer.fit(module, make_loader())
    assert marked == [True] * 4
