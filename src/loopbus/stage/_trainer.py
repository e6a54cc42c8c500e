"""The Trainer: a facade over the parts of a run. It owns the bus, the loops, the run's
state and the options; a stage is a sequence of calls to parts that take inputs and
return values (``_assembly``: what the loops run with and what a checkpoint holds;
``_lifecycle``: how a stage ends; ``_step``: the steps themselves)."""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.to_thread
import torch

from loopbus.checkpoint._load import load_weights
from loopbus.data._datamodule import close_datamodule, is_datamodule, prepare_datamodule
from loopbus.distributed._resolve import resolve_strategy
from loopbus.distributed._stopping import StopControl
from loopbus.distributed._strategy import Strategy, StrategyName
from loopbus.loop._loop import Loop
from loopbus.loop._loops import EvaluationLoop, FitLoop, PredictionLoop
from loopbus.records._recorder import Publication, Recorder
from loopbus.state._runstate import RunState
from loopbus.state._scope import LeakCheck
from loopbus.step._compile import restore_compiled
from loopbus.step._module import Module
from loopbus.step._optim import LRSchedulers, SchedulerConfig, parse_optimizers
from loopbus.step._precision import Precision, resolve_precision

from .._exceptions import MisconfigurationError
from ..events import Event, EventBus, Subscription
from ._assembly import StageHost, StageParts, active_plugins, build_host
from ._lifecycle import (
    default_resume,
    prepared_fit,
    resume_from,
    running_stage,
    sanity_check,
    subscribed,
)
from ._options import OLD_NAMES, Executor, OptionAttributes, TrainerOptions, unknown_options
from ._plugin import Plugin
from ._preemption import Preemption
from ._run import lightning_arguments, stage_method
from ._saving import CheckpointMethods, RunCheckpoints, resolve_weights_path
from ._views import RunViews

__all__ = ["SchedulerConfig", "Trainer", "set_default_plugins"]

_log = logging.getLogger("loopbus")

_DEFAULT_PLUGINS: list[Callable[[], Plugin]] = []


def set_default_plugins(factories: Iterable[Callable[[], Plugin]]) -> None:
    """Set what ``Trainer(plugins=None)`` uses (``loopbus.plugins`` sets a progress bar and a model summary)."""
    _DEFAULT_PLUGINS[:] = list(factories)


def _check_data(data: Any, name: str) -> None:
    if data is None:
        raise MisconfigurationError(f"{name} is None; pass a DataLoader or another iterable.")
    if not hasattr(data, "__iter__"):
        hint = ""
        if hasattr(data, "__getitem__"):
            hint = (
                " It looks like a Dataset: wrap it in "
                "torch.utils.data.DataLoader(dataset, batch_size=...)."
            )
        raise MisconfigurationError(
            f"{name} must be an iterable of batches (a DataLoader), got "
            f"{type(data).__name__}.{hint}"
        )


class Trainer(OptionAttributes, RunViews, CheckpointMethods):
    """Runs a :class:`Module` through ``fit``, ``validate``, ``test`` and ``predict``.

    Every stage is a coroutine in async code (``await trainer.fit(module, train_data,
    val_data)``, also in a notebook) and runs to completion when called from synchronous
    code (``trainer.fit(module, train_data, val_data)``, as ``loopbus.run`` does).

    Its options (all keyword-only: ``max_epochs``, ``max_steps``, ``precision``,
    ``plugins``, ``executor``, ``device``, ``strategy``, ...) are validated into one
    frozen :class:`TrainerOptions` (``trainer.options``; each is also an attribute,
    ``trainer.max_epochs``), held in typed groups where each is declared once, with its
    docstring (``TrainerOptions.declarations()`` lists them; the signature below is
    tested against them). Times in seconds end in ``_s`` (``yield_interval_s``); their
    earlier names (``yield_interval``, ...) are deprecated aliases that warn once. Setting
    an option later (``trainer.max_steps = 100``) validates and resolves it as
    ``Trainer(max_steps=100)`` would. ``plugins`` are
    the plugins of every stage (None: the default set, a progress bar and a model summary; ``[]``: none);
    ``precision`` is ``"32"`` (default) or a registered name such as ``"bf16-mixed"``.

    The trainer is a facade: the loops iterate, a :class:`TrainStep` built per stage
    runs each optimization step, and the parts of a stage are assembled by functions of
    their inputs (see ``docs/architecture.md``).
    """

    def __init__(
        self,
        *,
        max_epochs: int | None = None,
        max_steps: int | None = None,
        val_check_interval: int | None = None,
        check_val_every_n_epoch: int = 1,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
        plugins: Iterable[Plugin] | None = None,
        executor: Executor = "inline",
        device: str | torch.device | None = "auto",
        precision: str | int | Precision | None = "32",
        leak_check: LeakCheck | Literal["env"] = "env",
        yield_interval_s: float = 0.005,
        drain_timeout_s: float = 10.0,
        prefetch: int = 0,
        device_prefetch: int = 1,
        put_lag: int = 4,
        strategy: StrategyName | Strategy = "auto",
        process_group_timeout_s: float = 1800.0,
        stop_check_interval_s: float = 0.05,
        num_sanity_val_steps: int = 2,
        fast_dev_run: bool | int = False,
        enable_model_summary: bool = True,
        preemption: bool | Literal["auto"] = "auto",
        preemption_exit_code: int | None = None,
        preemption_grace_s: float | None = None,
        compile: bool | Mapping[str, Any] = False,
        root_dir: str | os.PathLike[str] | None = None,
        name: str = "loopbus_logs",
        version: int | str | None = None,
        **unknown: Any,
    ) -> None:
        given = {k: v for k, v in locals().items() if k not in _NOT_OPTIONS}
        #: The validated options (read them as ``trainer.max_epochs`` and so on).
        self.options = options = _parse_options(given, unknown)
        distribution = options.distribution
        self.precision = resolve_precision(precision)
        #: How the run is spread over processes (one, DDP, FSDP): DDP's wrapper, FSDP's shards.
        self.strategy: Strategy = resolve_strategy(
            distribution.strategy,
            distribution.process_group_timeout_s,
            distribution.stop_check_interval_s,
        )
        self.strategy.setup_environment(distribution.device)
        _notices(options, self.strategy.is_global_zero)
        self.plugins: list[Plugin] = _plugins(plugins)
        #: The run's state (step, epoch, stage, stop request, resume plan); loops advance it.
        self.state = RunState()
        #: The run's records (puts, events, the latest of each), delivered through its bus.
        self.recorder = Recorder(self.state, lag=options.put_lag)
        self.bus: EventBus = self.recorder.bus
        self._init_loops(options.leak_check)
        self._init_run_parts()

    def _init_loops(self, leak_check: LeakCheck) -> None:
        """The root loop of each stage, attached to this trainer's bus."""
        self.fit_loop = FitLoop()
        self.validate_loop = EvaluationLoop(stage="validate")
        self.test_loop = EvaluationLoop(stage="test")
        self.predict_loop = PredictionLoop()
        for loop in self.loops.values():
            loop.attach(bus=self.bus, trainer=self, leak_check=leak_check)

    def _init_run_parts(self) -> None:
        """What a stage sets up: the module and its optimizers, the registry of parts;
        where it stops (the stop control, the preemption signals' handling); the run folder."""
        self._init_run_folder()
        self._stop = StopControl(self.state)
        self._preemption = Preemption(
            self.state, self._stop.request, self.strategy, self.recorder.publish, self.options
        )
        self.module: Module | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self._schedulers = LRSchedulers([], self.state, self.recorder)
        #: The run's checkpoints (the trainer's checkpoint methods hand over to it).
        self.checkpoints = RunCheckpoints(
            lambda: self._stage_parts(self.state.stage, []), lambda: self.run_config
        )
        self._automatic = True
        self._configured_for: Module | None = None
        self._host: StageHost | None = None

    def __repr__(self) -> str:
        return f"<Trainer stage={self.stage!r} step={self.global_step} epoch={self.current_epoch}>"

    @property
    def loops(self) -> dict[str, Loop[Any]]:
        """The root loops of the stages."""
        return {
            "fit": self.fit_loop,
            "validate": self.validate_loop,
            "test": self.test_loop,
            "predict": self.predict_loop,
        }

    @property
    def lr_scheduler_configs(self) -> list[SchedulerConfig]:
        """The LR schedulers of the last ``configure_optimizers``, with their intervals."""
        return self._schedulers.configs

    @property
    def automatic_optimization(self) -> bool:
        """Whether the trainer runs backward and optimizer steps (as of the last fit)."""
        return self._automatic

    @property
    def steps_schedulers_per_step(self) -> bool:
        """Whether an LR scheduler is configured with ``interval="step"``."""
        return self._schedulers.per_step

    def step_lr_schedulers(self, interval: str) -> None:
        """Step the LR schedulers configured with ``interval`` (``"step"`` or
        ``"epoch"``) that are due (the training step does, at those boundaries)."""
        self._schedulers.step(interval)

    def request_stop(self, reason: str | None = None) -> None:
        """Ask the running stage to stop at the next step boundary (under DDP and FSDP: at
        the accumulation window's end), without an exception (validation inside ``fit``
        finishes its pass first). Safe to call from any task and from other threads."""
        self._stop.request(reason)

    def subscribe(self, event_type: Any, handler: Any, **options: Any) -> Subscription:
        """Shortcut for ``trainer.bus.subscribe``."""
        return self.bus.subscribe(event_type, handler, **options)

    def publish(self, event: Event) -> Publication:
        """Publish a (custom) event on this trainer's bus while a stage runs.

        The event is queued at once, after the records put and the events published
        before it, and delivered in that order. ``await trainer.publish(event)`` (from
        async code: a handler, a plugin's ``start``) delivers it before returning; called
        without ``await`` (from synchronous code: ``training_step``, a plain ``def``
        handler) it is delivered at the next step boundary, or between two handlers of
        the event being handled. Either way it is delivered: leaving out ``await`` loses
        nothing. (A stage that fails or is cancelled drops what is still queued, as it
        drops unflushed records.)

        A :class:`~loopbus.events.CustomEvent` left with ``step``/``epoch`` at -1 gets
        the trainer's ``global_step`` and ``current_epoch`` of the moment of this call.

        Raises :class:`RuntimeError` outside a stage, where nothing would deliver it:
        there, ``await trainer.bus.publish(event)`` delivers to inline subscribers.
        """
        return self.recorder.publish(event)

    # ------------------------------------------------------------ stages
    # Each stage method returns a coroutine when an event loop runs in this thread
    # (``await trainer.fit(...)``) and runs to completion from synchronous code.
    @stage_method
    async def fit(
        self,
        module: Module | None = None,
        train_data: Any = None,
        val_data: Any = None,
        *,
        datamodule: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
        ckpt_strict: bool = True,
        **lightning: Any,
    ) -> None:
        """Train ``module`` on ``train_data``, validating on ``val_data`` when given; or
        on a DataModule's loaders (``datamodule=dm``, or ``dm`` in place of
        ``train_data``; see :func:`~loopbus.prepare_datamodule`).

        ``ckpt_path`` resumes from a checkpoint exactly where it was taken (mid-epoch
        included): a file, a directory (its last checkpoint) or ``"last"`` (the newest
        checkpoint of the plugins that write them, such as ``Checkpoint``; a warning and
        a fresh start if there is none yet). ``ckpt_strict=False`` loads what matches the
        current run and warns about the rest (see ``docs/checkpointing.md``).
        """
        module, train_data, val_data, datamodule = _fit_inputs(
            self, module, train_data, val_data, datamodule, lightning
        )
        train_data = await prepared_fit(self, module, train_data, _check_data)
        train_data = self.strategy.prepare_train_data(train_data)
        fitting = self._stage("fit", module, train_data=train_data, datamodule=datamodule)
        async with fitting as parts:
            if ckpt_path is None:  # (a rejoining fault-tolerant group: its newest)
                ckpt_path = default_resume(self.strategy, self.plugins)
            if ckpt_path is not None:
                await resume_from(
                    ckpt_path,
                    ckpt_strict,
                    self.plugins,
                    self.strategy,
                    self.stateful_parts(),
                    self.checkpoints.loaded,
                )
            if val_data is not None:
                await sanity_check(
                    parts,
                    val_data,
                    self.fit_loop.epoch_loop.resumes_mid_epoch,
                    lambda loop, bus: loop.attach(bus=bus, trainer=self, host=self._host),
                )
            await self.fit_loop.run(train_data, val_data)

    @stage_method
    async def validate(
        self,
        module: Module | None = None,
        data: Any = None,
        *,
        datamodule: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
        **lightning: Any,
    ) -> dict[str, float | int | bool]:
        """One pass of ``validation_step`` over ``data``; returns the last value of each
        record put during it. ``ckpt_path`` loads the module's weights first (see
        :meth:`test`)."""
        module, data, datamodule = _stage_inputs(
            self, "validate", module, data, datamodule, lightning
        )
        return await self._evaluate(
            "validate", self.validate_loop, module, data, ckpt_path, datamodule
        )

    @stage_method
    async def test(
        self,
        module: Module | None = None,
        data: Any = None,
        *,
        datamodule: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
        **lightning: Any,
    ) -> dict[str, float | int | bool]:
        """One pass of ``test_step`` over ``data``; returns the last value of each record.

        ``ckpt_path`` loads the module's weights (only those: not the optimizers or the
        loops' state) before the pass: ``"best"`` is the best checkpoint of the
        ``Checkpoint`` plugin that monitors a record (its ``best_checkpoint_path``; an error
        without such a plugin or before it saved one), ``"last"`` the newest checkpoint
        (as for ``fit``; an error if none was written), anything else a checkpoint file
        or directory. None (default) uses the module as it is.

        Without a module (``trainer.test(data, ckpt_path="best")``) the module of the
        trainer's last stage (the one ``fit`` trained) is used."""
        module, data, datamodule = _stage_inputs(self, "test", module, data, datamodule, lightning)
        return await self._evaluate("test", self.test_loop, module, data, ckpt_path, datamodule)

    @stage_method
    async def predict(
        self,
        module: Module | None = None,
        data: Any = None,
        *,
        datamodule: Any = None,
        ckpt_path: str | os.PathLike[str] | None = None,
        **lightning: Any,
    ) -> list[Any]:
        """``predict_step`` over ``data``; returns the outputs in order. ``ckpt_path``
        loads the module's weights first (see :meth:`test`)."""
        module, data, datamodule = _stage_inputs(
            self, "predict", module, data, datamodule, lightning
        )
        _check_data(data, "data")
        _check_module(module, "predict", None)
        async with self._stage("predict", module, datamodule=datamodule):
            if ckpt_path is not None:
                await self._load_weights(ckpt_path, module)
            result: list[Any] = await self.predict_loop.run(data)
        return result

    async def _evaluate(
        self,
        stage: str,
        loop: EvaluationLoop,
        module: Module,
        data: Any,
        ckpt_path: str | os.PathLike[str] | None = None,
        datamodule: Any = None,
    ) -> dict[str, float | int | bool]:
        _check_data(data, "data")
        _check_module(module, stage, f"{'validation' if stage == 'validate' else 'test'}_step")
        async with self._stage(stage, module, datamodule=datamodule):
            if ckpt_path is not None:
                await self._load_weights(ckpt_path, module)
            await loop.run(data)
        return {name: record.value for name, record in self.stage_latest.items()}

    async def _load_weights(self, ckpt_path: str | os.PathLike[str], module: Module) -> None:
        """Load the module's weights (nothing else) from ``ckpt_path``: ``"best"``,
        ``"last"`` or a path (names resolved on rank 0 and broadcast)."""
        path = resolve_weights_path(ckpt_path, self.plugins, self.strategy)
        await anyio.to_thread.run_sync(load_weights, path, module)

    @asynccontextmanager
    async def _stage(
        self, stage: str, module: Module, *, train_data: Any = None, datamodule: Any = None
    ) -> AsyncIterator[StageParts]:
        self.state.begin_stage(stage)  # refuses (changing nothing) if a stage runs
        try:
            parts = self._prepare(stage, module, train_data, datamodule)
            active, recorder = parts.active, parts.recorder
            with subscribed(self, stage, active, module, bus=self.bus, recorder=recorder):
                async with running_stage(
                    parts,
                    lambda plugin, tg: plugin.start(self, stage, tg),
                    lambda plugin: plugin.stop(self, stage),
                ):
                    yield parts
        finally:
            restore_compiled(module)
            module.bind_recorder(None)
            module.bind_trainer(None)
            self.checkpoints.stage_ended()
            self._schedulers.resumed_at(None)
            self._stop.end()
            self.state.end_stage()
            if datamodule is not None:
                close_datamodule(datamodule, stage)

    def _prepare(self, stage: str, module: Module, train_data: Any, datamodule: Any) -> StageParts:
        """Bind the module, move it, configure its optimizers (``fit``), and assemble
        the stage's parts, what the loops run with and what a checkpoint holds (with the
        fit's ``train_data`` and the stage's ``datamodule``)."""
        self.module = module
        module.bind_trainer(self)
        module.bind_recorder(self.recorder, type(module).__name__)
        self.recorder.reset()
        device = self.options.device
        self.recorder.use_device(device, compiled=self.options.compile is not None)
        self.precision.setup(device)
        self.strategy.prepare_module(module, device, self.precision)
        if stage == "fit":
            self._configure(module)
            module.train()
        parts = self._stage_parts(stage, active_plugins(self.plugins, self.options, self.strategy))
        self._host = build_host(parts, train_loop=self.fit_loop.epoch_loop.name)
        for loop in self.loops.values():
            loop.attach(host=self._host)
        self.checkpoints.stage_started(parts, train_data, datamodule)
        return parts

    def _stage_parts(self, stage: str | None, active: list[Plugin]) -> StageParts:
        """The trainer's parts now, as one value (see :class:`StageParts`)."""
        return StageParts(
            stage,
            self.module,
            self.options,
            self.state,
            self.recorder,
            self.bus,
            self.precision,
            self.strategy,
            self.optimizers,
            self._schedulers,
            self._stop,
            self._preemption,
            self.loops,
            self.plugins,
            active,
        )

    def _configure(self, module: Module) -> None:
        """The module's optimizers and schedulers (configured once per module)."""
        if self._configured_for is not module:
            opts, configs = parse_optimizers(module.configure_optimizers(), module)
            self.optimizers = self.strategy.prepare_optimizers(opts, module)
            self._schedulers = LRSchedulers(configs, self.state, self.recorder)
            self._configured_for = module
        self._automatic = bool(module.automatic_optimization)


# Trainer.__init__'s arguments that are not options.
_NOT_OPTIONS = frozenset({"self", "unknown", "plugins", "precision"})


def _parse_options(named: dict[str, Any], unknown: dict[str, Any]) -> TrainerOptions:
    """``Trainer(...)``'s options: ``named`` are its keywords as bound (one left out is
    the very default object of the signature, so only those passed are handed on),
    ``unknown`` the others: the deprecated old names of renamed options, or mistakes
    (explained)."""
    mistakes = {name: value for name, value in unknown.items() if name not in OLD_NAMES}
    if mistakes:
        known = [p for p in inspect.signature(Trainer).parameters if p != "unknown"]
        raise unknown_options(mistakes, known)
    defaults = Trainer.__init__.__kwdefaults__ or {}
    passed = {name: value for name, value in named.items() if value is not defaults[name]}
    return TrainerOptions.parse(**passed, **unknown)


def _notices(options: TrainerOptions, global_zero: bool) -> None:
    """What rank 0 says about the options when the trainer is built."""
    if not global_zero:
        return
    if options.defaulted_epochs:
        _log.warning(
            "Trainer: neither max_epochs nor max_steps was given, so training stops "
            "after max_epochs=1000; pass max_epochs=-1 to train without a limit."
        )
    if options.fast_dev_run:
        _log.warning(
            "Trainer(fast_dev_run=%d): runs %d batch(es) of each stage and one "
            "epoch, with no sanity check; plugins that write files (checkpoints, "
            "logs) are left out, so none are written.",
            options.fast_dev_run,
            options.fast_dev_run,
        )


def _plugins(plugins: Iterable[Plugin] | None) -> list[Plugin]:
    """The plugins of every stage: the default set for None."""
    chosen = [factory() for factory in _DEFAULT_PLUGINS] if plugins is None else list(plugins)
    for plugin in chosen:
        if not isinstance(plugin, Plugin):
            raise MisconfigurationError(
                f"plugins must be loopbus.Plugin instances, got {plugin!r}"
                + (" (a class: instantiate it)" if isinstance(plugin, type) else "")
                + "."
            )
    return chosen


def _fit_inputs(
    trainer: Trainer,
    module: Any,
    train_data: Any,
    val_data: Any,
    datamodule: Any,
    lightning: dict[str, Any],
) -> tuple[Module, Any, Any, Any]:
    """``fit``'s module, training and validation data, and DataModule, checked; a
    DataModule (given as the training data, or as ``datamodule``) is readied and gives
    the data."""
    if lightning:
        raise lightning_arguments("fit", lightning)
    datamodule, train_data = _datamodule_of("fit", train_data, datamodule, val_data)
    if datamodule is not None:
        checked = _check_module(module, "fit", "training_step")
        train_data, val_data = _ready(trainer, "fit", datamodule, checked)
    _check_data(train_data, "train_data")
    if val_data is not None:
        _check_data(val_data, "val_data")
    module = _check_module(module, "fit", "training_step")
    if val_data is not None:
        _check_module(module, "fit with val_data", "validation_step")
    return module, train_data, val_data, datamodule


def _stage_inputs(
    trainer: Trainer,
    stage: str,
    module: Any,
    data: Any,
    datamodule: Any,
    lightning: dict[str, Any],
) -> tuple[Module, Any, Any]:
    """The module, data and DataModule of an evaluation stage: ``trainer.test(data)``
    (no module) takes the module of the last stage; a DataModule (given as the data, or
    as ``datamodule``) is readied and gives the data."""
    if lightning:
        raise lightning_arguments(stage, lightning)
    if data is None and module is not None and not isinstance(module, torch.nn.Module):
        module, data = None, module
    if module is None:
        module = trainer.module
        if module is None:
            raise MisconfigurationError(
                f"{stage} needs a module: trainer.{stage}(module, data). Without one it "
                "uses the module of the trainer's last stage, and none has run yet."
            )
    datamodule, data = _datamodule_of(stage, data, datamodule, None)
    if datamodule is not None:
        (data,) = _ready(trainer, stage, datamodule, _check_module(module, stage, None))
    return module, data, datamodule


def _ready(trainer: Trainer, stage: str, datamodule: Any, module: Module) -> tuple[Any, ...]:
    """``datamodule`` readied for ``stage`` (:func:`prepare_datamodule`): its loaders.
    ``fit`` takes its validation loader only for a module with ``validation_step``."""

    def wanted(method: str) -> bool:
        return method != "val_dataloader" or stage != "fit" or _defines(module, "validation_step")

    return prepare_datamodule(datamodule, stage, trainer=trainer, wanted=wanted)


def _datamodule_of(stage: str, data: Any, datamodule: Any, other: Any) -> tuple[Any, Any]:
    """``(datamodule, data)`` of a stage method's arguments: a DataModule given where the
    data goes is taken as one; one given as ``datamodule`` must come without loaders
    (``data``, and ``other``: fit's ``val_data``)."""
    if datamodule is None:
        return (data, None) if is_datamodule(data) else (None, data)
    if not is_datamodule(datamodule):
        raise MisconfigurationError(
            f"{stage}(datamodule=...) takes a DataModule (an object with setup(stage) and "
            f"{stage}'s loader methods, such as a LightningDataModule), got "
            f"{type(datamodule).__name__}; pass a loader as the data instead."
        )
    if data is not None or other is not None:
        raise MisconfigurationError(
            f"{stage}() takes its data from a DataModule or from loaders, not both: pass "
            f"trainer.{stage}(module, datamodule=dm) or the loaders alone."
        )
    return datamodule, None


def _defines(module: Module, method: str) -> bool:
    """Whether ``module``'s class defines ``method`` (``Module``'s own does not count)."""
    return getattr(type(module), method, None) is not getattr(Module, method, None)


def _check_module(module: Any, stage: str, method: str | None) -> Module:
    if not isinstance(module, Module):
        extra = ""
        if isinstance(module, torch.nn.Module):
            extra = (
                f" {type(module).__name__} is a plain torch.nn.Module: subclass "
                "loopbus.Module instead and add training_step and configure_optimizers."
            )
        raise MisconfigurationError(
            f"{stage} needs a loopbus.Module, got {type(module).__name__}.{extra}"
        )
    if method is not None and getattr(type(module), method) is getattr(Module, method):
        raise MisconfigurationError(
            f"{stage} needs {type(module).__name__}.{method}(self, batch, ctx); define it."
        )
    return module


if TYPE_CHECKING:
    from loopbus.step._trainer_view import TrainerView

    def _viewed(trainer: Trainer) -> TrainerView:
        """Modules, loops and plugins see the trainer as a ``TrainerView``: ``mypy``
        checks here that ``Trainer`` satisfies the protocol."""
        return trainer
