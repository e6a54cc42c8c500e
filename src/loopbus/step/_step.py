"""Where a step lives: :class:`TrainStep` runs one optimization step, :class:`EvalStep`
one evaluation step, and :class:`StepBoundary` runs after each (the records' flush, the
yield to other tasks).

A stage builds them once, from explicit inputs (:meth:`TrainStep.build` from a
:class:`StepParts`, :func:`build_eval_step`), and the loops only call them. The variant of the training step
(plain, general, manual) is chosen at build time from the options, so the per-step path
pays only for what is configured. A compiled step (``Trainer(compile=...)``) is chosen
there too: the step's forward (the module's ``training_step``, the loss included) is
compiled once per stage, so no step asks whether it is (what is compiled, and what stays
eager, is in ``_compile``). CUDA-graph steps plug in here; a
strategy changes the step only through the ``StepStrategy`` seam (the gradient-sync
context of accumulation, clipping).

Per-step work here is on the hot path: no allocation or call that is not needed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sized
from contextlib import AbstractContextManager
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Literal, Protocol

import anyio
import anyio.to_thread
import torch
from anyio.lowlevel import checkpoint
from torch.autograd.profiler import record_function

from loopbus.state._ranges import RANGES
from loopbus.state._runstate import RunState
from loopbus.state._scope import Scope

from .._exceptions import MisconfigurationError
from ..events import AfterBackward, BeforeOptimizerStep, StepAborted
from ._compile import compiled, optimizer_step_for
from ._precision import Precision

__all__ = [
    "EvalStep",
    "StepBoundary",
    "StepEvents",
    "StepGate",
    "StepOptions",
    "StepParts",
    "TrainStep",
    "build_eval_step",
    "compiled",
    "optimizer_step_for",
    "run_in_worker",
]

_Tensor = torch.Tensor
StepFn = Callable[[Any, Scope], Any]


class FlushingRecorder(Protocol):
    """What a step boundary asks of the recorder."""

    @property
    def has_pending(self) -> Sized: ...

    @property
    def pending(self) -> Any: ...

    @property
    def inflight(self) -> Sized: ...

    @property
    def readback(self) -> Any: ...

    def route(self) -> list[Any]: ...

    async def deliver(self, routed: list[Any]) -> None: ...

    async def flush(self) -> None: ...

    async def flush_step(self) -> None: ...

    def run_compiled(self, fn: StepFn, batch: Any, ctx: Scope) -> Any: ...


class StepStrategy(Protocol):
    """What the training step asks of the strategy: a context in which backward does
    not synchronise gradients (the non-final micro-batches of an accumulation window,
    DDP's ``no_sync``, FSDP's ``set_requires_gradient_sync(False)``), clipping, and
    whether a checkpoint holds the gradients of an unfinished window."""

    def no_sync(self) -> AbstractContextManager[Any]: ...

    @property
    def saves_window_gradients(self) -> bool: ...

    def clip_gradients(
        self, parameters: list[torch.Tensor], value: float, algorithm: Literal["norm", "value"]
    ) -> None: ...

    def step_gate(
        self,
        module: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        schedulers: Any,
        state: RunState,
    ) -> StepGate | None: ...


class StepGate(Protocol):
    """What a step whose commit is decided across replica groups asks of the strategy
    (fault tolerance): :meth:`commit` after backward (the gradients averaged over the
    groups that take part, then whether the step commits), :meth:`news` (events of the
    quorums since the last call: ``(event type, fields)``), :meth:`retry` (after an
    abort: a new quorum, and the batch planned again from the committed cursor) and
    ``participants`` (the replica groups of the step in flight)."""

    @property
    def participants(self) -> int: ...

    def commit(self) -> bool: ...

    def news(self) -> list[tuple[Any, dict[str, Any]]]: ...

    def retry(self) -> Any: ...


class SchedulerStepper(Protocol):
    """What the training step asks of the LR schedulers."""

    @property
    def per_step(self) -> bool: ...

    @property
    def configured(self) -> bool: ...

    def step(self, interval: str) -> None: ...


class StepBoundary:
    """What runs after every step of a stage: flush the step's records, and at most every
    ``interval`` seconds let other tasks run. How the records go is chosen once: on the
    CPU they are routed at once (those nobody listens to are kept, with nothing to
    await) and the others delivered; where put values are read back from a device
    without waiting (CUDA), the recorder's step flush runs.

    Await the boundary whole (``await boundary()``), or call :meth:`settle`, which does
    what needs no waiting and returns what is left to await (None: nothing)."""

    __slots__ = (
        "_clocked",
        "_deferred",
        "_deliver",
        "_due",
        "_flush",
        "_next_yield",
        "_route",
        "interval",
        "recorder",
    )

    def __init__(self, recorder: FlushingRecorder, interval: float) -> None:
        self.recorder = recorder
        self.interval = interval
        self._next_yield = perf_counter() + interval
        #: Whether it yields at all (``interval`` finite): if not, no step reads the clock.
        self._clocked = self._next_yield != math.inf
        self._route = recorder.route
        self._deliver = recorder.deliver
        #: Whether the values are read back from a device (the step flush runs every step).
        self._deferred = recorder.readback is not None
        self._flush = recorder.flush_step if self._deferred else recorder.flush
        #: Truthy when there is something to flush: the pending records (and on a device,
        #: the step flushes whose values are on their way).
        self._due: Sized = (
            _Either(recorder.has_pending, recorder.inflight)
            if self._deferred
            else recorder.has_pending
        )

    async def __call__(self) -> None:
        if (wait := self.settle()) is not None:
            await wait

    def settle(self) -> Awaitable[None] | None:
        """The boundary as far as it needs no waiting: what is left to await, or None."""
        if self._due and (self._deferred or RANGES.on):  # (a profiler range when on)
            return self._flushed(None)
        route = self._route  # (read, then called: see TrainStep._plain)
        if self._due and (routed := route()):
            return self._flushed(routed)
        if self._clocked and perf_counter() >= self._next_yield:
            return self._yield()
        return None

    async def _flushed(self, routed: list[Any] | None) -> None:
        """Deliver ``routed`` (None: run the flush), then yield if it is time."""
        if routed is not None:
            await self._deliver(routed)
        elif RANGES.on:
            with record_function("loopbus.put_flush"):
                await self._flush()
        else:
            await self._flush()
        if perf_counter() >= self._next_yield:
            await self._yield()

    async def _yield(self) -> None:
        """Let other tasks run (one checkpoint), and set when to do it next."""
        if RANGES.on:
            with record_function("loopbus.boundary"):
                await checkpoint()
        else:
            await checkpoint()
        self._next_yield = perf_counter() + self.interval


class _Either:
    """Truthy while either of two collections is."""

    __slots__ = ("first", "second")

    def __init__(self, first: Sized, second: Sized) -> None:
        self.first = first
        self.second = second

    def __len__(self) -> int:
        return len(self.first) + len(self.second)


async def run_in_worker(step: StepFn, ctx: Scope, limiter: anyio.CapacityLimiter) -> Any:
    """``step(ctx.batch, ctx)`` in the worker thread (``executor="thread"``).

    The batch, scope and output travel in a list that is emptied on both sides, so the
    thread hand-off (the job, its future or outcome, which the worker thread drops a
    moment after the result is delivered) never refers to what the scope owns: otherwise
    the iteration's leak check could see them alive, and they would outlive it.
    """
    box = [step, ctx]
    await anyio.to_thread.run_sync(_run_boxed, box, limiter=limiter)
    return box.pop()


def _run_boxed(box: list[Any]) -> None:
    step, ctx = box
    box.clear()
    box.append(step(ctx.batch, ctx))


def loss_of(output: Any) -> _Tensor | None:
    """The loss in what ``training_step`` returned (None: skip the optimizer step)."""
    if output is None or type(output) is _Tensor or isinstance(output, _Tensor):
        return output
    if isinstance(output, dict):
        try:
            loss = output["loss"]
        except KeyError:
            raise MisconfigurationError(
                "training_step returned a mapping without a 'loss' key; return the loss "
                f"tensor, a mapping with 'loss', or None to skip. Keys were {sorted(output)}."
            ) from None
        if isinstance(loss, _Tensor):
            return loss
    raise MisconfigurationError(
        "training_step must return the loss tensor, a mapping with a 'loss' tensor, or "
        f"None (to skip the optimizer step), got {type(output).__name__}: {output!r}."
    )


@dataclass(frozen=True, slots=True)
class StepEvents:
    """How a step publishes its in-step events (``AfterBackward``,
    ``BeforeOptimizerStep``): the bus's dispatch ``table``, ``emit(entries, event)``
    (direct, or hopping from the worker thread to the event loop), the ``loop`` name
    the events carry and the run ``state`` their step and epoch come from. ``kept``:
    the table's entries of the two events a step reads every time (``table.keep``)."""

    table: Any
    emit: Callable[[Any, Any], Any]
    loop: str
    state: RunState
    kept: dict[type, Any] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        kept = self.table.keep(AfterBackward, BeforeOptimizerStep)
        object.__setattr__(self, "kept", kept)

    def send(self, entries: Any, event_type: Any, ctx: Scope, **fields: Any) -> None:
        state = self.state
        event = event_type(
            loop=self.loop,
            ctx=ctx,
            step=state.step,
            epoch=state.epoch,
            batch_idx=ctx.batch_idx,
            **fields,
        )
        self.emit(entries, event)


@dataclass(frozen=True, slots=True)
class StepOptions:
    """The options of the optimization step (validated by the trainer's options)."""

    accumulate: int = 1
    clip_val: float | None = None
    clip_algorithm: Literal["norm", "value"] = "norm"
    automatic: bool = True


@dataclass(frozen=True, slots=True)
class StepParts:
    """What a training step is built from, assembled once per stage: the forward (the
    module's ``training_step``, or a strategy's wrapper of it), the optimizers and the
    schedulers' stepper, the precision, the strategy's step seam, the run's state, the
    in-step events, the step's options, the step boundary, the worker the step runs in
    (None: inline) and the module."""

    forward: StepFn
    optimizers: list[torch.optim.Optimizer]
    schedulers: SchedulerStepper
    precision: Precision
    strategy: StepStrategy
    state: RunState
    events: StepEvents
    options: StepOptions
    boundary: StepBoundary
    worker: anyio.CapacityLimiter | None
    module: torch.nn.Module


class TrainStep:
    """One optimization step: the forward under the precision's autocast, backward
    (scaled), accumulation under the strategy's gradient-sync context, clipping, the
    optimizer and per-step scheduler steps, or the module's own (manual optimization);
    then the step boundary. Built once per stage by :meth:`build` from the stage's
    :class:`StepParts`, which chooses the variant; the loop calls :meth:`for_epoch` when an epoch starts and the
    function it returns for each batch, then awaits :attr:`boundary`.

    ``worker`` is the capacity limiter of the thread steps run in (None: inline).
    """

    __slots__ = (
        "_accumulators",
        "_forward",
        "_gate",
        "_step_optimizer",
        "_variant",
        "_zero_grad",
        "boundary",
        "events",
        "module",
        "optimizers",
        "options",
        "precision",
        "schedulers",
        "state",
        "strategy",
        "variant",
        "worker",
    )

    def __init__(self, parts: StepParts, optimizer_step: Callable[[], Any] | None = None) -> None:
        optimizers = parts.optimizers
        self.optimizers = optimizers
        self.schedulers = schedulers = parts.schedulers
        # The optimizer's step, compiled or not (automatic optimization without a grad
        # scaler calls it; see optimizer_step_for). Manual optimization never does.
        if optimizer_step is None and optimizers:
            optimizer_step = optimizers[0].step
        self._step_optimizer: Callable[[], Any] = optimizer_step or _no_optimizer_step
        # The plain step's zero_grad (manual optimization never calls it).
        self._zero_grad: Callable[..., Any] = (
            optimizers[0].zero_grad if optimizers else _no_optimizer_step
        )
        precision, strategy, options = parts.precision, parts.strategy, parts.options
        forward, module, state = parts.forward, parts.module, parts.state
        self.precision = precision
        self.strategy = strategy
        self.state = state
        self.events = parts.events
        self.options = options
        self.boundary = parts.boundary
        self.worker = parts.worker
        self.module = module
        autocast = precision.autocast
        # The forward, under autocast only where the precision has one (the plain path
        # calls the module's step directly).
        self._forward: StepFn = forward if autocast is None else _under(autocast, forward)
        #: Each parameter's gradient accumulator node, held for the stage: autograd
        #: keeps a parameter's only weakly, so a step whose graph is gone by the next
        #: forward (the scopes free it) would have them all made again, every step.
        self._accumulators = _accumulators(module)
        #: The strategy's commit gate (None: every step commits; see StepGate).
        self._gate = strategy.step_gate(module, optimizers, schedulers, state)
        #: ``"plain"``, ``"general"``, ``"manual"`` or ``"gated"``: which step runs (see
        #: build).
        self.variant = _choose_variant(options, precision, schedulers, self._gate)
        self._variant: StepFn = {
            "plain": self._plain,
            "general": self._general,
            "manual": self._manual,
            "gated": self._gated,
        }[self.variant]

    @classmethod
    def build(
        cls,
        parts: StepParts,
        compile: Mapping[str, Any] | None = None,
        compile_optimizer: bool | str = "auto",
    ) -> TrainStep:
        """The training step of a stage. ``parts.forward`` is what the step calls for the
        forward (the module's ``training_step``, or a strategy's wrapper of it), compiled
        with the ``compile`` options when given; with automatic optimization exactly one
        optimizer is stepped."""
        module, optimizers, precision = parts.module, parts.optimizers, parts.precision
        if parts.options.automatic and len(optimizers) != 1:
            raise MisconfigurationError(
                f"{type(module).__name__} configures {len(optimizers)} optimizers; "
                "automatic optimization steps exactly one. Set "
                "`automatic_optimization = False` and step them in training_step."
            )
        optimizer_step = None
        if parts.options.automatic:
            optimizer_step = optimizer_step_for(
                optimizers[0],
                compile=compile,
                policy=compile_optimizer,
                scaler=precision.scaler,
                schedulers=parts.schedulers,
            )
        elif compile is not None and compile_optimizer is True:
            raise MisconfigurationError(
                "compile={'optimizer': True}: the optimizer step cannot be compiled: with "
                "automatic_optimization = False the module steps its optimizers itself "
                "(compile that code yourself, or leave 'optimizer' out)."
            )
        forward = compiled(parts.forward, compile, parts.boundary.recorder)
        return cls(dataclasses.replace(parts, forward=forward), optimizer_step)

    def for_epoch(self, closes_window: Callable[[int], bool]) -> StepFn:
        """The step function for an epoch: ``fn(batch, ctx) -> output``.
        ``closes_window(size)`` says whether the batch in flight is the last of an
        accumulation window of ``size`` batches (asked only when accumulating)."""
        accumulate = self.options.accumulate
        if self.variant != "general" or accumulate == 1:
            return self._variant
        return functools.partial(self._general, closes_window=closes_window)

    @property
    def stop_window(self) -> int:
        """How many batches a stop lets complete, counted from the epoch's start: a stop
        takes effect at a boundary that is a multiple of it. The accumulation window
        when a checkpoint cannot hold an unfinished window's gradients (the strategy's
        ``saves_window_gradients``: under DDP and FSDP), so that the checkpoint taken at
        the stop resumes exactly; else 1 (the next batch)."""
        options = self.options
        if options.accumulate > 1 and not self.strategy.saves_window_gradients:
            return options.accumulate
        return 1

    def epoch_completed(self) -> None:
        """An epoch ended: step the schedulers configured with ``interval="epoch"``."""
        self.schedulers.step("epoch")

    # ------------------------------------------------------------ variants
    def _plain(self, batch: Any, ctx: Scope) -> Any:
        """The automatic step without autocast, grad scaling, accumulation, clipping or
        per-step schedulers: forward, backward, optimizer step."""
        # (Callables in attributes read, then called: 3.11 specializes no self.fn(...).)
        forward, step_optimizer, zero_grad = self._forward, self._step_optimizer, self._zero_grad
        output = forward(batch, ctx)
        loss = output if type(output) is _Tensor else loss_of(output)
        if loss is None:
            return output
        loss.backward()  # type: ignore[no-untyped-call]
        table = self.events.kept
        if entries := table[AfterBackward]:
            self.events.send(entries, AfterBackward, ctx)
        if entries := table[BeforeOptimizerStep]:
            self.events.send(entries, BeforeOptimizerStep, ctx, optimizer=self.optimizers[0])
        step_optimizer()
        zero_grad(set_to_none=True)
        self.state.step_completed()
        return output

    def _general(
        self, batch: Any, ctx: Scope, closes_window: Callable[[int], bool] | None = None
    ) -> Any:
        """The automatic step with what the options ask: autocast, grad scaling,
        accumulation (the non-final micro-batches under the strategy's ``no_sync``),
        clipping (the strategy's), per-step schedulers."""
        accumulate = self.options.accumulate
        if accumulate > 1 and closes_window is not None and not closes_window(accumulate):
            # A non-final micro-batch: accumulate locally, synchronise on the last.
            with self.strategy.no_sync():
                output, _ = self._forward_backward(batch, ctx, accumulate)
            return output
        output, has_loss = self._forward_backward(batch, ctx, accumulate)
        if has_loss:
            self._apply(ctx)
        return output

    def _gated(self, batch: Any, ctx: Scope) -> Any:
        """The automatic step whose commit is decided across replica groups (fault
        tolerance): forward and backward, then the gate averages the gradients over the
        groups and says whether the step commits. Only a committed step steps the
        optimizer and the schedulers and counts; an aborted one drops its gradients and
        records (``StepAborted``) and runs again on the batch the next quorum plans, in
        the same iteration, so the loops count committed steps only."""
        gate = self._gate
        assert gate is not None
        events = self.events
        table = events.table
        pending = self.boundary.recorder.pending
        while True:
            mark = len(pending.entries)
            output, _ = self._forward_backward(batch, ctx, 1)
            committed = gate.commit()
            for event_type, fields in gate.news():
                if entries := table[event_type]:
                    events.send(entries, event_type, ctx, **fields)
            if committed:
                break
            dropped = len(pending.entries) - mark
            pending.retract(mark)
            self.optimizers[0].zero_grad(set_to_none=True)
            if entries := table[StepAborted]:
                events.send(
                    entries,
                    StepAborted,
                    ctx,
                    participants=gate.participants,
                    dropped_records=dropped,
                )
            batch = ctx.batch = gate.retry()
        self._apply(ctx)
        return output

    def _manual(self, batch: Any, ctx: Scope) -> Any:
        """``automatic_optimization = False``: the module's step does backward and
        optimizer steps itself; each call counts as one step."""
        output = self._forward(batch, ctx)
        self.state.step_completed()
        return output

    # ------------------------------------------------------------ parts
    def _apply(self, ctx: Scope) -> None:
        """After the backward that closes a window: clipping, the optimizer step and the
        per-step schedulers."""
        clip = self.options.clip_val
        if clip is not None:
            optimizer = self.optimizers[0]
            self.precision.unscale_(optimizer)
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self.strategy.clip_gradients(params, clip, self.options.clip_algorithm)
        self._optimizer_step(ctx)
        if self.schedulers.per_step:
            self.schedulers.step("step")

    def _forward_backward(self, batch: Any, ctx: Scope, accumulate: int) -> tuple[Any, bool]:
        """Forward and backward (scaled) of one batch: the step's output and whether it
        returned a loss (None skips the backward)."""
        output = self._forward(batch, ctx)
        loss = output if type(output) is _Tensor else loss_of(output)
        if loss is None:
            return output, False
        if accumulate > 1:
            loss = loss / accumulate
        precision = self.precision
        if precision.scaler is None:
            loss.backward()  # type: ignore[no-untyped-call]
        else:
            precision.backward(loss)
        entries = self.events.kept[AfterBackward]
        if entries:
            self.events.send(entries, AfterBackward, ctx)
        return output, True

    def _optimizer_step(self, ctx: Scope) -> None:
        """``BeforeOptimizerStep``, the optimizer's step through the precision (its grad
        scaler, if any), ``zero_grad``, and the step's count (the general step)."""
        optimizer = self.optimizers[0]
        entries = self.events.kept[BeforeOptimizerStep]
        if entries:
            self.events.send(entries, BeforeOptimizerStep, ctx, optimizer=optimizer)
        precision = self.precision
        if precision.scaler is None:
            self._step_optimizer()
        else:
            precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        self.state.step_completed()


def _under(autocast: Callable[[], AbstractContextManager[Any]], fn: StepFn) -> StepFn:
    """``fn`` run under a fresh ``autocast()`` context."""

    def forward(batch: Any, ctx: Scope) -> Any:
        with autocast():
            return fn(batch, ctx)

    return forward


def _choose_variant(
    options: StepOptions, precision: Precision, schedulers: SchedulerStepper, gate: Any
) -> Literal["plain", "general", "manual", "gated"]:
    if gate is not None:
        if not options.automatic or options.accumulate != 1:
            raise MisconfigurationError(
                "a fault-tolerant step (a strategy with a commit gate) runs with automatic "
                "optimization and accumulate_grad_batches=1 for now; got "
                f"automatic_optimization={options.automatic}, "
                f"accumulate_grad_batches={options.accumulate}."
            )
        return "gated"
    if not options.automatic:
        return "manual"
    if (
        precision.autocast is None
        and precision.scaler is None
        and options.accumulate == 1
        and options.clip_val is None
        and not schedulers.per_step
    ):
        return "plain"
    return "general"


def _accumulators(module: torch.nn.Module) -> list[torch.Tensor]:
    """What holds the gradient accumulator of each plain parameter of ``module`` that
    takes gradients: a one-element sum of it, whose graph holds the node, in C++ only (a
    node handed to Python costs a GIL round trip at each reference a step takes), and
    no storage (a view would keep a replaced ``.data``). Tensor subclasses are left."""
    with torch.enable_grad():
        return [
            param.reshape(-1)[:1].sum()
            for param in module.parameters()
            if type(param) is torch.nn.Parameter and param.requires_grad
        ]


def _no_optimizer_step() -> None:
    """The optimizer step of a step without optimizers (manual optimization)."""


class EvalStep:
    """One evaluation step (validation, test, predict): ``step_fn`` without gradients,
    under the precision's autocast; :meth:`evaluating` puts the module in eval mode for
    a pass (restored afterwards, even when a step raises). ``worker`` and ``boundary``
    as for :class:`TrainStep`."""

    __slots__ = ("_fn", "boundary", "module", "worker")

    def __init__(
        self,
        step_fn: StepFn,
        precision: Precision,
        module: torch.nn.Module,
        boundary: Callable[[], Any],
        worker: anyio.CapacityLimiter | None,
    ) -> None:
        self.module = module
        self.boundary = boundary
        self.worker = worker
        autocast = precision.autocast
        self._fn = step_fn if autocast is None else _under(autocast, step_fn)

    def run(self, batch: Any, ctx: Scope) -> Any:
        with torch.no_grad():
            return self._fn(batch, ctx)

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        module = self.module
        was_training = module.training
        module.eval()
        try:
            yield
        finally:
            module.train(was_training)


def build_eval_step(
    step_fn: StepFn,
    *,
    precision: Precision,
    module: torch.nn.Module,
    boundary: Callable[[], Any],
    worker: anyio.CapacityLimiter | None,
) -> EvalStep:
    """The evaluation step of a pass (see :class:`EvalStep`); ``step_fn`` may be a
    compiled function (see :func:`compiled`)."""
    return EvalStep(step_fn, precision, module, boundary, worker)
