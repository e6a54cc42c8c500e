from __future__ import annotations

import math
import threading
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import torch

import loopbus
from loopbus import HandlerError, MisconfigurationError, Module, Plugin, Trainer, on
from loopbus.events import (
    AfterBackward,
    BeforeOptimizerStep,
    Event,
    ExceptionRaised,
    FitCompleted,
    PutRecord,
    Teardown,
    TrainBatchCompleted,
)
from tests.helpers import TinyModule, make_loader

VAL = [
    "ValidationStarted",
    "ValidationBatchStarted",
    "ValidationBatchCompleted",
    "ValidationBatchStarted",
    "ValidationBatchCompleted",
    "ValidationCompleted",
]


def one_epoch(val_after: tuple[int, ...]) -> list[str]:
    out = ["EpochStarted", "TrainEpochStarted"]
    for b in range(4):
        out.append("TrainBatchStarted")
        if b in val_after:
            out += VAL
        out.append("TrainBatchCompleted")
    return [*out, "TrainEpochCompleted", "EpochCompleted"]


# The documented order (docs/events.md): validation that is due after a batch runs in
# that batch's on_advance_end, i.e. before its TrainBatchCompleted.
EXPECTED_VAL_EVERY_2 = [
    "FitStarted",
    *one_epoch(val_after=(1, 3)),
    *one_epoch(val_after=(1, 3)),
    "FitCompleted",
    "Teardown",
]


def names(events: list[Any], skip: tuple[type, ...] = (PutRecord, AfterBackward, BeforeOptimizerStep)) -> list[str]:
    return [type(e).__name__ for e in events if not isinstance(e, skip)]


async def test_full_event_order_with_validation_every_n_steps() -> None:
    trainer = Trainer(max_epochs=2, val_check_interval=2, plugins=[])
    events: list[Any] = []
    trainer.subscribe(Event, events.append)
    await trainer.fit(TinyModule(), make_loader(n=64, batch_size=16), make_loader(n=32, batch_size=16))
    assert names(events) == EXPECTED_VAL_EVERY_2
    assert trainer.global_step == 8


async def test_event_order_with_validation_at_epoch_end_and_inner_events() -> None:
    trainer = Trainer(max_epochs=1, plugins=[])
    events: list[Any] = []
    trainer.subscribe(Event, events.append)
    await trainer.fit(TinyModule(), make_loader(n=32, batch_size=16), make_loader(n=32, batch_size=16))
    assert names(events, skip=()) == [
        "FitStarted",
        "EpochStarted",
        "TrainEpochStarted",
        "TrainBatchStarted",
        "AfterBackward",
        "BeforeOptimizerStep",
        "PutRecord",
        "TrainBatchCompleted",
        "TrainBatchStarted",
        "AfterBackward",
        "BeforeOptimizerStep",
        "PutRecord",
        "TrainBatchCompleted",
        *[n if n != "ValidationBatchCompleted" else "PutRecord" for n in VAL[:3]],
        "ValidationBatchCompleted",
        "ValidationBatchStarted",
        "PutRecord",
        "ValidationBatchCompleted",
        "ValidationCompleted",
        "TrainEpochCompleted",
        "EpochCompleted",
        "FitCompleted",
        "Teardown",
    ]
    records = [e for e in events if isinstance(e, PutRecord)]
    assert [(r.name, r.step, r.epoch) for r in records] == [
        ("train/loss", 1, 0),
        ("train/loss", 2, 0),
        ("val/loss", 2, 0),
        ("val/loss", 2, 0),
    ]
    assert all(type(r.value) is float for r in records)
    assert records[0].source == "TinyModule"


async def test_records_reach_only_their_destinations_in_step_order() -> None:
    class Multi(TinyModule):
        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            loss = super().training_step(batch, ctx)
            self.put("only/loggers", 1.0, destinations="loggers")
            self.put("bar+cb", 2, destinations=("progress_bar", "callbacks"))
            return loss

    trainer = Trainer(max_epochs=1, plugins=[])
    got: dict[str, list[tuple[str, int]]] = {d: [] for d in loopbus.DESTINATIONS}
    for role, seen in got.items():
        trainer.subscribe(PutRecord, lambda r, seen=seen: seen.append((r.name, r.step)), destination=role)
    await trainer.fit(Multi(), make_loader(n=32, batch_size=16))
    assert got["loggers"] == [("train/loss", 1), ("only/loggers", 1), ("train/loss", 2), ("only/loggers", 2)]
    assert got["callbacks"] == [("train/loss", 1), ("bar+cb", 1), ("train/loss", 2), ("bar+cb", 2)]
    assert got["progress_bar"] == got["callbacks"]
    assert got["external"] == [("train/loss", 1), ("train/loss", 2)]
    assert trainer.latest["only/loggers"].value == 1.0


# ---------------------------------------------------------------- failures
class Boom(Plugin):
    @on(TrainBatchCompleted, once=3)
    def explode(self, event: TrainBatchCompleted) -> None:
        raise ValueError("bad metric")


class QueuedBoom(Plugin):
    delivery = loopbus.Delivery(mode="queued")

    @on(TrainBatchCompleted, once=3)
    async def explode(self, event: TrainBatchCompleted) -> None:
        raise ValueError("bad metric")


class Recorder(Plugin):
    def __init__(self) -> None:
        self.closing: list[str] = []
        self.torn_down = False

    @on(ExceptionRaised)
    def failed(self, event: ExceptionRaised) -> None:
        self.closing.append(f"ExceptionRaised:{type(event.error).__name__}")

    @on(Teardown)
    def last(self, event: Teardown) -> None:
        self.closing.append(f"Teardown:{event.reason}")

    def teardown(self, trainer: Trainer, stage: str) -> None:
        self.torn_down = True


@pytest.mark.parametrize("plugin", [Boom, QueuedBoom])
async def test_handler_error_names_plugin_and_event_and_tears_down(plugin: type[Plugin]) -> None:
    tasks_before = {t.id for t in anyio.get_running_tasks()}
    threads_before = set(threading.enumerate())
    recorder = Recorder()
    # yield_interval_s=0: queued consumers run after every step, so the failure stops the
    # run mid-way (with the default they may only run in the final drain; see the docs).
    trainer = Trainer(max_epochs=3, plugins=[plugin(), recorder], yield_interval_s=0)
    module = TinyModule()
    with pytest.raises(
        HandlerError,
        match=rf"{plugin.__name__}\.explode raised ValueError while handling TrainBatchCompleted "
        r"\(loop 'train'\): bad metric",
    ) as info:
        await trainer.fit(module, make_loader())
    assert isinstance(info.value.__cause__, ValueError)
    assert recorder.closing == ["ExceptionRaised:HandlerError", "Teardown:failed"]
    assert trainer.global_step < 12
    assert recorder.torn_down
    assert trainer.stage is None
    assert {t.id for t in anyio.get_running_tasks()} == tasks_before
    assert set(threading.enumerate()) == threads_before
    with pytest.raises(RuntimeError, match=r"outside a Trainer stage"):
        module.put("late", 1.0)


async def test_step_error_propagates_unchanged_and_restores_modes() -> None:
    class Broken(TinyModule):
        def validation_step(self, batch: Any, ctx: Any) -> None:
            raise ZeroDivisionError("in validation")

    recorder = Recorder()
    trainer = Trainer(max_epochs=1, val_check_interval=1, plugins=[recorder])
    module = Broken()
    with pytest.raises(ZeroDivisionError, match="in validation"):
        await trainer.fit(module, make_loader(), make_loader())
    assert module.training  # eval mode was undone
    assert torch.is_grad_enabled()
    assert recorder.closing == ["ExceptionRaised:ZeroDivisionError", "Teardown:failed"]


async def test_cancel_from_the_host_stops_at_a_step_boundary() -> None:
    class AdamModule(TinyModule):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    tasks_before = {t.id for t in anyio.get_running_tasks()}
    recorder = Recorder()
    trainer = Trainer(max_epochs=10_000, plugins=[recorder], yield_interval_s=0.001)
    module = AdamModule()
    scope = anyio.CancelScope()

    def cancel_soon(event: TrainBatchCompleted) -> None:
        # The host's scope runs out a moment after the first step, wherever the run is then.
        if scope.deadline == math.inf:
            scope.deadline = anyio.current_time() + 0.05

    trainer.subscribe(TrainBatchCompleted, cancel_soon)
    with scope:
        await trainer.fit(module, make_loader())
    assert scope.cancelled_caught
    assert trainer.global_step > 0
    assert recorder.closing == ["Teardown:cancelled"]
    # No half-done step: the optimizer stepped exactly global_step times.
    state = trainer.optimizers[0].state[module.layer.weight]
    assert int(state["step"]) == trainer.global_step
    assert trainer.stage is None
    assert {t.id for t in anyio.get_running_tasks()} == tasks_before


async def test_request_stop_ends_fit_without_an_exception() -> None:
    class Stopper(Plugin):
        @on(TrainBatchCompleted, once=5)
        def halt(self, event: TrainBatchCompleted) -> None:
            self.trainer.request_stop("enough")

        def setup(self, trainer: Trainer, stage: str) -> None:
            self.trainer = trainer

    trainer = Trainer(max_epochs=100, plugins=[Stopper()])
    done: list[FitCompleted] = []
    trainer.subscribe(FitCompleted, done.append)
    reasons: list[str] = []
    trainer.subscribe(Teardown, lambda e: reasons.append(e.reason))
    await trainer.fit(TinyModule(), make_loader())
    assert trainer.global_step == 5
    assert done[0].stopped
    assert done[0].reason == "enough"
    assert reasons == ["stopped"]


# ---------------------------------------------------------------- executors
class DropoutModule(TinyModule):
    def __init__(self) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.drop(x))


async def test_thread_executor_gives_the_same_weights_as_inline() -> None:
    weights = []
    for executor in ("inline", "thread"):
        loopbus.seed_everything(3)
        module = DropoutModule()
        trainer = Trainer(max_epochs=3, plugins=[], executor=executor)  # type: ignore[arg-type]
        inner: list[int] = []
        trainer.subscribe(BeforeOptimizerStep, lambda e, inner=inner: inner.append(e.step))
        await trainer.fit(module, make_loader(shuffle=True), make_loader(n=32))
        assert inner == list(range(12))
        weights.append({k: v.clone() for k, v in module.state_dict().items()})
    assert weights[0].keys() == weights[1].keys()
    for key in weights[0]:
        assert torch.equal(weights[0][key], weights[1][key]), key


# ---------------------------------------------------------------- options
async def test_accumulation_clipping_and_schedulers() -> None:
    class Scheduled(TinyModule):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=1.0)
            return {
                "optimizer": opt,
                "lr_scheduler": {
                    "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
                    "interval": "step",
                    "frequency": 2,
                },
            }

    norms: list[float] = []
    trainer = Trainer(
        max_epochs=1, plugins=[], accumulate_grad_batches=2, gradient_clip_val=0.01
    )

    def grad_norm(event: BeforeOptimizerStep) -> None:
        grads = [p.grad for g in event.optimizer.param_groups for p in g["params"]]
        norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))

    trainer.subscribe(BeforeOptimizerStep, grad_norm)
    # 5 batches: windows of 2, 2 and a last window of 1
    await trainer.fit(Scheduled(), make_loader(n=80, batch_size=16))
    assert trainer.global_step == 3
    assert len(norms) == 3
    assert all(n <= 0.01 + 1e-6 for n in norms)
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.5)


async def test_limits_and_max_steps() -> None:
    trainer = Trainer(max_steps=5, limit_train_batches=3, limit_val_batches=1, plugins=[])
    seen: list[str] = []
    trainer.subscribe(Event, lambda e: seen.append(type(e).__name__))
    await trainer.fit(TinyModule(), make_loader(), make_loader())
    assert trainer.global_step == 5
    assert seen.count("ValidationBatchStarted") == 2  # two epochs ended, one val batch each
    assert seen.count("TrainBatchStarted") == 5


async def test_validate_test_and_predict() -> None:
    trainer = Trainer(plugins=[])
    module = TinyModule()
    metrics = await trainer.validate(module, make_loader())
    assert set(metrics) == {"val/loss"}
    assert isinstance(metrics["val/loss"], float)
    assert module.training  # restored
    assert set(await trainer.test(module, make_loader())) == {"test/loss"}
    x = torch.randn(10, 4)
    predictions = await trainer.predict(module, [x[:5], x[5:]])
    assert len(predictions) == 2
    assert torch.allclose(torch.cat(predictions), module(x).detach())


# ---------------------------------------------------------------- bad input
async def test_misconfigurations_are_explained() -> None:
    trainer = Trainer(plugins=[])
    with pytest.raises(MisconfigurationError, match=r"plain torch.nn.Module: subclass loopbus.Module"):
        await trainer.fit(torch.nn.Linear(2, 2), make_loader())  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationError, match=r"looks like a Dataset: wrap it in"):
        await trainer.fit(TinyModule(), make_loader().dataset)

    class NoVal(Module):
        def training_step(self, batch: Any, ctx: Any) -> Any:
            return None

    with pytest.raises(MisconfigurationError, match=r"needs NoVal.validation_step"):
        await trainer.fit(NoVal(), make_loader(), make_loader())

    class TwoOpts(TinyModule):
        def configure_optimizers(self) -> Any:
            return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)]

    with pytest.raises(MisconfigurationError, match=r"configures 2 optimizers.*automatic_optimization = False"):
        await trainer.fit(TwoOpts(), make_loader())

    class BadLoss(TinyModule):
        def training_step(self, batch: Any, ctx: Any) -> Any:
            return {"los": torch.tensor(1.0)}

    with pytest.raises(MisconfigurationError, match=r"without a 'loss' key.*\['los'\]"):
        await trainer.fit(BadLoss(), make_loader())
    assert trainer.stage is None


def test_plugin_handlers_cannot_shadow_lifecycle_hooks() -> None:
    with pytest.raises(TypeError, match=r"Bad.stop is a Plugin lifecycle hook"):

        class Bad(Plugin):
            @on(TrainBatchCompleted)
            def stop(self, event: Any) -> None:
                pass


def test_bad_trainer_options() -> None:
    with pytest.raises(MisconfigurationError, match=r"max_epochs must be an int >= 0, got -3"):
        Trainer(max_epochs=-3)
    with pytest.raises(MisconfigurationError, match=r"executor must be 'inline'.*got 'process'"):
        Trainer(executor="process")  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationError, match=r"limit_val_batches must be a number of batches"):
        Trainer(limit_val_batches=1.5)
    with pytest.raises(MisconfigurationError, match=r"instantiate it"):
        Trainer(plugins=[Recorder])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"unknown precision '8-bit'"):
        Trainer(precision="8-bit")
    with pytest.raises(MisconfigurationError, match=r"CUDA is not available|device="):
        if torch.cuda.is_available():
            raise MisconfigurationError("device= skipped on a CUDA machine")
        Trainer(device="cuda")


async def test_one_stage_at_a_time_per_trainer() -> None:
    trainer = Trainer(max_epochs=50, plugins=[])

    async def second() -> None:
        while trainer.stage is None:
            await anyio.lowlevel.checkpoint()
        with pytest.raises(RuntimeError, match=r"already running 'fit'.*one Trainer per run"):
            await trainer.fit(TinyModule(), make_loader())
        trainer.request_stop()

    async with anyio.create_task_group() as tg:
        tg.start_soon(second)
        await trainer.fit(TinyModule(), make_loader())


def test_run_from_sync_code_and_its_errors() -> None:
    trainer = Trainer(max_epochs=1, plugins=[])
    module = TinyModule()
    loopbus.run(trainer.fit, module, make_loader(), backend="trio")
    assert trainer.global_step == 4
    # From synchronous code a stage called directly runs (and returns its result).
    trainer.max_epochs = 2
    result = trainer.fit(module, make_loader())
    assert result is None
    assert trainer.global_step == 8
    with pytest.raises(TypeError, match=r"runs the stage itself"):
        loopbus.run(result)  # type: ignore[arg-type]

    async def coroutine_passed() -> None:
        loopbus.run(trainer.fit(module, make_loader()))  # type: ignore[arg-type]

    with pytest.raises(TypeError, match=r"not loopbus.run\(trainer.fit\(module, data\)\)"):
        anyio.run(coroutine_passed)

    async def nested() -> None:
        loopbus.run(trainer.fit, module, make_loader())

    with pytest.raises(RuntimeError, match=r"already running.*Await the stage instead"):
        anyio.run(nested)


def test_trainer_module_and_plugins_are_garbage_collected_after_fit() -> None:
    import gc
    import weakref

    recorder = Recorder()
    trainer = Trainer(max_epochs=1, plugins=[recorder])
    module = TinyModule()
    sub = trainer.subscribe(PutRecord, lambda r: None, mode="queued")
    loopbus.run(trainer.fit, module, make_loader())
    refs = [weakref.ref(o) for o in (trainer, module, recorder, sub)]
    del trainer, module, recorder, sub
    gc.collect()
    assert [r() for r in refs] == [None, None, None, None]


def test_auto_device_takes_the_local_rank_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def auto_device() -> torch.device:
        return Trainer(device="auto", plugins=[]).device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert auto_device() == torch.device("cuda", 3)
    monkeypatch.setenv("LOCAL_RANK", "5")
    assert auto_device() == torch.device("cuda", 1)
    monkeypatch.delenv("LOCAL_RANK")
    assert auto_device() == torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert auto_device() == torch.device("cpu")


def test_misspelt_and_lightning_options_are_explained() -> None:
    with pytest.raises(TypeError, match=r"'max_epoch': did you mean `max_epochs`\?"):
        Trainer(max_epoch=3)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"'callbacks': loopbus calls these `plugins`"):
        Trainer(callbacks=[])  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"'accelerator': choose the device with `device`"):
        Trainer(accelerator="gpu")  # type: ignore[call-arg]
    with pytest.raises(
        TypeError, match=r"'profiler': the profiler is a plugin: Trainer\(plugins=\[Profiler"
    ):
        Trainer(profiler="simple")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match=r"'colour' is not an option\. Its options are \["):
        Trainer(colour="red")  # type: ignore[call-arg]


def test_minus_one_means_no_limit() -> None:
    trainer = Trainer(max_epochs=-1, max_steps=50)
    assert trainer.max_epochs == math.inf
    assert trainer.max_steps == 50
    trainer = Trainer(max_steps=-1, max_epochs=2)
    assert trainer.max_steps == math.inf
    assert trainer.max_epochs == 2
    trainer = Trainer(max_epochs=-1)
    assert trainer.max_epochs == trainer.max_steps == math.inf
    with pytest.raises(ValueError, match=r"max_epochs must be an int >= 0, got -2"):
        Trainer(max_epochs=-2)
