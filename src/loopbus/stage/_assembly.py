"""A stage put together from its parts: what the loops are given (:class:`StageHost`),
the batch sources, the steps, and the checkpoint registry. Each function takes the parts
it needs and returns a value; the trainer calls them in sequence when a stage starts.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.from_thread
import torch

from loopbus.checkpoint._parts import (
    GradsPart,
    HparamsPart,
    LoaderPart,
    LoopPart,
    ModulePart,
    OptimizerPart,
    PrecisionPart,
    RngPart,
    SchedulerPart,
)
from loopbus.data._device import CudaBatchSource, pin_batch
from loopbus.data._sampler import ElasticDistributedSampler, SamplerPart
from loopbus.data._sources import Sources
from loopbus.distributed._stopping import StopControl
from loopbus.distributed._strategy import Strategy
from loopbus.loop._loop import Loop
from loopbus.loop._loops import Records, TrainEpochLoop
from loopbus.records._recorder import Recorder
from loopbus.state._runstate import RunState
from loopbus.state._stateful import Stateful
from loopbus.step._compile import prepare_compiled
from loopbus.step._module import Module
from loopbus.step._optim import LRSchedulers
from loopbus.step._precision import Precision
from loopbus.step._step import (
    EvalStep,
    StepBoundary,
    StepEvents,
    StepOptions,
    StepParts,
    TrainStep,
    build_eval_step,
    compiled,
)

from .._exceptions import CheckpointError, MisconfigurationError
from ..events import EventBus
from ._options import TrainerOptions
from ._plugin import Plugin

if TYPE_CHECKING:
    from ._preemption import Preemption

__all__ = [
    "StageHost",
    "StageParts",
    "active_plugins",
    "build_host",
    "build_registry",
    "build_sources",
    "check_registration",
]


@dataclass(frozen=True, slots=True)
class StageParts:
    """The parts a stage runs with, assembled once by the trainer (when the stage
    starts, or when a checkpoint is composed outside one) and passed whole to what builds
    the loops' host, the checkpoint registry and the stage's task group: ``stage`` (None
    outside one), the module, the options, the run state, the recorder and its bus, the
    precision, the strategy, the optimizers and schedulers, the stop control and the
    preemption signals' handling, the root loops, the trainer's plugins and those that
    act in this stage on this rank (``active``)."""

    stage: str | None
    module: Module | None
    options: TrainerOptions
    state: RunState
    recorder: Recorder
    bus: EventBus
    precision: Precision
    strategy: Strategy
    optimizers: list[torch.optim.Optimizer]
    schedulers: LRSchedulers
    stop: StopControl
    preemption: Preemption
    loops: Mapping[str, Loop[Any]]
    plugins: list[Plugin]
    active: list[Plugin]


class StageHost:
    """What a stage gives its loops (the ``LoopHost`` they read): the run state, the
    options, the batch sources, the training step (``fit`` only), the evaluation steps,
    the records and the stop control. Built once per stage by :func:`build_host`."""

    __slots__ = (
        "_eval_step",
        "_train_step",
        "options",
        "records",
        "sources",
        "state",
        "stop",
    )

    def __init__(
        self,
        parts: StageParts,
        *,
        sources: Sources,
        train_step: TrainStep | None,
        eval_step: Callable[[str], EvalStep],
    ) -> None:
        self.state = parts.state
        self.options = parts.options
        self.sources = sources
        self.records: Records = parts.recorder
        self.stop = parts.stop
        self._train_step = train_step
        self._eval_step = eval_step

    @property
    def train_step(self) -> TrainStep:
        step = self._train_step
        if step is None:
            raise RuntimeError(
                f"the {self.state.stage!r} stage runs no training step; only fit trains."
            )
        return step

    def eval_step(self, stage: str) -> EvalStep:
        return self._eval_step(stage)


def build_sources(options: TrainerOptions) -> Sources:
    """The batch sources of a stage on ``options.device``: on CUDA with
    ``device_prefetch``, batches copied ahead on a side stream (pinned on the prefetch
    worker when there is one); on another accelerator, moved as the loop takes them;
    on the CPU, as the loader made them."""
    device = options.device
    if device.type == "cuda" and options.device_prefetch:
        return Sources(
            prefetch=options.prefetch,
            prepare=pin_batch if options.prefetch else None,
            device_source=functools.partial(
                CudaBatchSource, device=device, depth=options.device_prefetch
            ),
        )
    return Sources(prefetch=options.prefetch, move_to=None if device.type == "cpu" else device)


def _emit_from_worker(deliver: Callable[[Any, Any], None], entries: Any, event: Any) -> None:
    """Deliver an in-step event from the worker thread on the event loop's thread."""
    anyio.from_thread.run_sync(deliver, entries, event)


def _evaluation_function(module: Module, stage: str) -> Callable[[Any, Any], Any]:
    if stage == "validate":
        return module.validation_step
    if stage == "test":
        return module.test_step
    return module.predict_step


def build_host(parts: StageParts, train_loop: str = "train") -> StageHost:
    """Everything the loops of ``parts.stage`` run with, chosen once: where steps run
    (inline, or a worker thread under ``executor="thread"``), the batch sources, the step
    boundary, and for ``fit`` the training step (its forward through the strategy) and
    stop requests agreed across ranks (the strategy's stop transport)."""
    module, options, strategy = parts.module, parts.options, parts.strategy
    recorder = parts.recorder
    assert module is not None  # a stage runs a module
    worker, emit = _step_runner(options, parts.bus)
    prepare_compiled(module, options.compile)  # undone when the stage ends
    boundary = StepBoundary(recorder, options.responsiveness.yield_interval_s)
    train_step = None
    if parts.stage == "fit":
        step_parts = StepParts(
            forward=strategy.wrap(module, parts.state),
            optimizers=parts.optimizers,
            schedulers=parts.schedulers,
            precision=parts.precision,
            strategy=strategy,
            state=parts.state,
            events=StepEvents(parts.bus.table, emit, train_loop, parts.state),
            options=StepOptions(
                accumulate=options.accumulate_grad_batches,
                clip_val=options.gradient_clip_val,
                clip_algorithm=options.gradient_clip_algorithm,
                automatic=bool(module.automatic_optimization),
            ),
            boundary=boundary,
            worker=worker,
            module=module,
        )
        train_step = TrainStep.build(step_parts, options.compile, options.compile_optimizer)
    parts.stop.begin(strategy.stop_transport() if parts.stage == "fit" else None, parts.preemption)
    return StageHost(
        parts,
        sources=build_sources(options),
        train_step=train_step,
        eval_step=_eval_steps(module, options, recorder, parts.precision, boundary, worker),
    )


def _step_runner(
    options: TrainerOptions, bus: EventBus
) -> tuple[anyio.CapacityLimiter | None, Callable[[Any, Any], Any]]:
    """Where steps run and how an in-step event is delivered: inline on the event loop,
    or (``executor="thread"``) in one worker thread that hands events back to the loop."""
    if options.executor == "thread":
        emit = functools.partial(_emit_from_worker, bus.deliver_sync)
        return anyio.CapacityLimiter(1), emit
    return None, bus.deliver_sync


def _eval_steps(
    module: Module,
    options: TrainerOptions,
    recorder: Recorder,
    precision: Precision,
    boundary: StepBoundary,
    worker: anyio.CapacityLimiter | None,
) -> Callable[[str], EvalStep]:
    """The evaluation step of each evaluation stage, by name: one (compiled) function per
    stage, made at its first pass and kept for the stage's later passes."""
    functions: dict[str, Callable[[Any, Any], Any]] = {}

    def eval_step(name: str) -> EvalStep:
        fn = functions.get(name)
        if fn is None:
            fn = functions[name] = compiled(
                _evaluation_function(module, name), options.compile, recorder
            )
        return build_eval_step(
            fn, precision=precision, module=module, boundary=boundary, worker=worker
        )

    return eval_step


def _plugin_parts(plugins: list[Plugin], taken: set[str]) -> dict[str, Plugin]:
    """Every stateful plugin under ``plugins/<state_key>``; two with one key (two
    instances of a class) numbered in the order given, which a resumed run repeats."""
    parts: dict[str, Plugin] = {}
    for plugin in plugins:
        if type(plugin).state_dict is Plugin.state_dict:
            continue  # keeps no state
        key = f"plugins/{plugin.state_key}"
        if key in parts or key in taken:
            n = 2
            while f"{key}#{n}" in parts:
                n += 1
            key = f"{key}#{n}"
        parts[key] = plugin
    return parts


def build_registry(
    parts: StageParts,
    *,
    epoch_loop: TrainEpochLoop,
    train_data: Any,
    registered: Mapping[str, Stateful],
) -> dict[str, Any]:
    """The registry a checkpoint is composed from, key -> :class:`Stateful` part: the run
    state, the generators, the module and its hyperparameters, each optimizer and
    scheduler, the precision, the loop tree, every stateful plugin, the training loader
    (read by ``epoch_loop``) when it is stateful, gradients mid-accumulation, the latest
    records and every ``registered`` object."""
    module, state = parts.module, parts.state
    if module is None:
        raise CheckpointError(
            "the trainer has no module yet, so there is no run state to save or load; "
            "a checkpoint can be taken once fit (or another stage) has started, and is "
            "loaded with trainer.fit(module, data, ckpt_path=...)."
        )
    registry: dict[str, Any] = {
        "run": state,
        "rng": RngPart(parts.strategy),
        "module": ModulePart(module),
        "hparams": HparamsPart(module),
    }
    for index, opt in enumerate(parts.optimizers):
        registry[f"optimizers/{index}"] = OptimizerPart(opt)
    for index, config in enumerate(parts.schedulers.configs):
        registry[f"lr_schedulers/{index}"] = SchedulerPart(config.scheduler)
    registry["precision"] = PrecisionPart(parts.precision)
    for name, loop in parts.loops.items():
        registry[f"loops/{name}"] = LoopPart(loop)
    registry.update(_plugin_parts(parts.plugins, set(registry)))
    if isinstance(train_data, Stateful):
        registry["data/train"] = LoaderPart(
            train_data,
            epoch_loop.loader_position,
            lambda: epoch_loop.next_epoch_fresh,
            lambda: state.epoch,
        )
    elif isinstance(sampler := getattr(train_data, "sampler", None), ElasticDistributedSampler):
        registry["data/sampler"] = SamplerPart(
            sampler, train_data.batch_size, lambda: epoch_loop.progress.current.completed
        )
    registry["grads"] = GradsPart(module)
    registry["records"] = parts.recorder
    for name, obj in registered.items():
        registry[f"user/{name}"] = obj
    return registry


def check_registration(
    registered: Mapping[str, Stateful], name: str, obj: Any, stage: str | None
) -> None:
    """Raise unless ``obj`` may be registered as ``name`` (``Trainer.register_stateful``):
    a non-empty name without '/', a :class:`Stateful` object, a name not taken by
    another object, and no stage running (``stage`` None)."""
    if not isinstance(name, str) or not name or "/" in name:
        raise MisconfigurationError(
            f"register_stateful needs a non-empty name without '/', got {name!r}."
        )
    if not isinstance(obj, Stateful):
        raise MisconfigurationError(
            f"register_stateful({name!r}, ...) needs an object with state_dict() and "
            f"load_state_dict(state), got {type(obj).__name__}."
        )
    if name in registered and registered[name] is not obj:
        raise MisconfigurationError(
            f"another object is already registered as {name!r}; choose another name."
        )
    if stage is not None:
        raise RuntimeError(
            f"register_stateful({name!r}, ...) was called while {stage!r} "
            "runs; register objects before the stage starts."
        )


def active_plugins(
    plugins: list[Plugin], options: TrainerOptions, strategy: Strategy
) -> list[Plugin]:
    """The plugins that act in this process: those of every rank, and on rank 0 those
    of rank 0 too; under ``fast_dev_run`` none that writes files."""
    return [
        p
        for p in plugins
        if not (options.fast_dev_run and p.writes_files)
        and (p.delivery.ranks == "all" or strategy.is_global_zero)
    ]
