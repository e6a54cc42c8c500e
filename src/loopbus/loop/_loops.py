"""The trainer's loops, built on :class:`Loop`:

``FitLoop`` (one iteration per epoch) -> ``TrainEpochLoop`` (one iteration per batch)
-> ``EvaluationLoop`` (validation, run from the epoch loop); ``EvaluationLoop`` also
serves ``validate``/``test`` and ``PredictionLoop`` serves ``predict``.

The loops iterate; they do not know the trainer. A stage gives them a :class:`LoopHost`
(``loop.attach(host=...)``): the run state, the options, the batch sources, the steps,
the records and the stop control. That is all they read of the run. They never decide
a stop themselves: ``done`` reads ``state.stop_requested``; the stop control's check
runs between two batches (:meth:`Loop.iteration_boundary`) and its settling after a
validation and between epochs.

Per-step work here is on the hot path: no allocation or call that is not needed.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from anyio.lowlevel import checkpoint
from torch.autograd.profiler import record_function

from loopbus.checkpoint._rng_state import (
    capture_epoch_rng,
    capture_rng,
    epoch_rng_state,
    restore_epoch_rng,
    restore_rng,
    set_sampler_epoch,
)
from loopbus.data._sources import Source, Sources, batch_limit, skip_consumed
from loopbus.distributed._stopping import StopControl
from loopbus.state._ranges import RANGES, in_range
from loopbus.state._runstate import RunState
from loopbus.state._scope import Scope, TrackedScope
from loopbus.state._stateful import is_stateful
from loopbus.step._step import EvalStep, StepBoundary, TrainStep, run_in_worker

from ..events import (
    EpochCompleted,
    EpochStarted,
    FitCompleted,
    FitStarted,
    LoopEvent,
    PredictBatchCompleted,
    PredictBatchStarted,
    PredictCompleted,
    PredictStarted,
    TestBatchCompleted,
    TestBatchStarted,
    TestCompleted,
    TestStarted,
    TrainBatchCompleted,
    TrainBatchStarted,
    TrainEpochCompleted,
    TrainEpochStarted,
    ValidationBatchCompleted,
    ValidationBatchStarted,
    ValidationCompleted,
    ValidationStarted,
)
from ._loop import IterationHook, Loop, LoopEvents

__all__ = [
    "EvaluationLoop",
    "FitLoop",
    "LoopHost",
    "PredictionLoop",
    "SanityCheckLoop",
    "TrainEpochLoop",
]


class Records(Protocol):
    """What the loops ask of the recorder at their rare boundaries."""

    async def flush_pending(self) -> None: ...

    def discard_pending(self) -> None: ...


class LoopLimits(Protocol):
    """The options the loops read: how long they run and when validation runs (the
    trainer's options satisfy it)."""

    @property
    def max_epochs(self) -> float: ...

    @property
    def max_steps(self) -> float: ...

    @property
    def val_check_interval(self) -> int | None: ...

    @property
    def check_val_every_n_epoch(self) -> int: ...

    @property
    def limit_train_batches(self) -> int | float | None: ...

    @property
    def limit_val_batches(self) -> int | float | None: ...

    @property
    def limit_test_batches(self) -> int | float | None: ...

    @property
    def limit_predict_batches(self) -> int | float | None: ...


class LoopHost(Protocol):
    """What a stage gives its loops, and all they read of the run."""

    @property
    def state(self) -> RunState: ...

    @property
    def options(self) -> LoopLimits: ...

    @property
    def sources(self) -> Sources: ...

    @property
    def train_step(self) -> TrainStep: ...

    @property
    def records(self) -> Records: ...

    @property
    def stop(self) -> StopControl: ...

    def eval_step(self, stage: str) -> EvalStep:
        """The evaluation step of a pass of ``stage`` ("validate", "test", "predict")."""


class _Hosted:
    """The host a stage attached (see :class:`LoopHost`)."""

    _host: Any
    name: str

    @property
    def host(self) -> LoopHost:
        host = self._host
        if host is None:
            raise RuntimeError(
                f"the loop {self.name!r} runs inside a Trainer stage, which gives it what it "
                "needs; run it through trainer.fit/validate/test/predict."
            )
        return host  # type: ignore[no-any-return]


class _DataLoop(_Hosted, Loop[Any]):
    """What the batch loops share: fetching and yielding to the event loop."""

    _limit: float = math.inf
    _borrow_batches: bool = False
    _total: int | None = None
    # The source of the run in progress (the loop closes it when the run ends).
    _opened: Source | None = None

    @property
    def total_batches(self) -> int | None:
        """The number of batches the current (or last) run goes through: ``len(data)``
        capped by the ``limit_*_batches`` option, or None when the data has no length and
        no limit applies. Read-only (for progress displays); set when the run starts."""
        return self._total

    def _open_source(
        self, ctx: Scope, sources: Sources, data: Any, iterator: Iterator[Any], track: bool = False
    ) -> None:
        """Open this run's batch source over ``iterator`` (``data``'s position tracked
        when ``track``). The loop owns it until the run ends (:meth:`run` closes it,
        however the run ends); the run scope borrows it."""
        source = sources.open(iterator, data if track else None)
        self._opened = source
        ctx.borrow("source", source)
        # Batches from an in-memory sequence are owned by it, not by the scope: only the
        # leak check (a tracked scope) needs to be told.
        self._borrow_batches = isinstance(data, Sequence) and isinstance(ctx, TrackedScope)
        try:
            total = min(float(len(data)), self._limit)
        except TypeError:  # an iterable without len()
            total = self._limit
        self._total = None if total == math.inf else int(total)

    async def run(self, *args: Any, parent_ctx: Scope | None = None, **kwargs: Any) -> Any:
        try:
            return await super().run(*args, parent_ctx=parent_ctx, **kwargs)
        finally:
            source = self._opened
            self._opened = None
            if source is not None:
                source.close()

    async def on_advance_start(self, ctx: Scope) -> None:
        self._take_batch(ctx)

    def _take_batch(self, ctx: Scope) -> None:
        """``on_advance_start`` as a plain function: the next batch into the scope."""
        take = self._opened.take  # type: ignore[union-attr]
        batch = take() if not RANGES.on else in_range("loopbus.data_fetch", take)
        if self._borrow_batches:
            ctx.borrow("batch", batch)
        else:
            ctx.batch = batch
        ctx.batch_idx = self.progress.current.ready - 1

    async def advance(self, ctx: Scope) -> None:
        if (wait := self._advance(ctx)) is not None:
            await wait

    def _advance(self, ctx: Scope) -> Awaitable[None] | None:
        """``advance`` as a plain function: what is left to await (None: nothing)."""
        raise NotImplementedError

    def iteration_hooks(self) -> tuple[IterationHook | None, IterationHook, IterationHook | None]:
        # The hooks a subclass keeps as they are here are called as plain functions.
        start, advance, end = super().iteration_hooks()
        if type(self).on_advance_start is _DataLoop.on_advance_start:
            start = self._take_batch
        if type(self).advance is _DataLoop.advance:
            advance = self._advance
        return start, advance, end

    #: ``on_advance_start`` then ``advance`` in one plain function (None: none).
    _fetch_and_advance: Callable[[Any, Scope], Awaitable[None] | None] | None = None

    def iteration_shortcut(self) -> IterationHook | None:
        # Where both hooks are this class's own and its batches are not borrowed.
        cls = type(self)
        if cls.on_advance_start is _DataLoop.on_advance_start and cls.advance is _DataLoop.advance:
            return None if self._borrow_batches else self._fetch_and_advance  # type: ignore[return-value]
        return None

    def make_event(self, event_type: type[LoopEvent], ctx: Scope | None, **fields: Any) -> Any:
        if event_type is self.events.advance_started or event_type is self.events.advance_completed:
            fields["batch_idx"] = self.progress.current.ready - 1
        return super().make_event(event_type, ctx, **fields)


class _EpochMarks:
    """What a checkpoint records of the epoch in flight, beside the progress counters:
    the generators' state right before the epoch's ``iter(data)`` (to replay a plain
    loader's order), whether an epoch is in flight, whether the loaded checkpoint was
    taken inside one, and whether the last epoch ended before its loader ran out (a
    stop, ``max_steps``, ``limit_train_batches``): the loader's own position is then
    mid-epoch, and the next epoch starts from its beginning, not from there."""

    _restarting: bool
    run_ctx: Any

    def __init__(self) -> None:
        super().__init__()
        self._epoch_rng: dict[str, Any] | None = None
        self._in_epoch = False
        self._resume_in_epoch = True
        self._cut_short = False

    @property
    def resumes_mid_epoch(self) -> bool:
        """Whether the loop was loaded from a checkpoint taken inside an epoch and has not
        resumed yet."""
        return self._restarting and self._resume_in_epoch

    def loader_position(self) -> dict[str, Any] | None:
        """The position of a stateful training loader as of the last batch fetched for
        training (a batch fetched only to look ahead does not count); None outside an
        epoch (the loader's own state is then current)."""
        ctx = self.run_ctx
        source = ctx.get("source") if ctx is not None else None
        return None if source is None else source.position()

    @property
    def next_epoch_fresh(self) -> bool:
        """Between epochs, whether the last epoch ended before its loader ran out: a
        checkpoint then saves no loader position (the loader's own is mid-epoch), and
        the resumed run starts the next epoch from its beginning, as this one would."""
        return self._cut_short and not self._saved_in_epoch

    @property
    def _saved_in_epoch(self) -> bool:
        """Whether a checkpoint now is inside an epoch (as loaded, until resumed)."""
        return self._resume_in_epoch if self._restarting else self._in_epoch

    def on_save_checkpoint(self) -> dict[str, Any]:
        return {
            "in_epoch": self._saved_in_epoch,
            "epoch_rng": epoch_rng_state(self._epoch_rng),
            "cut_short": self._cut_short,
        }

    def saved_inside_epoch(self, state: Mapping[str, Any]) -> bool:
        """Whether this loop's saved ``state`` was taken inside an epoch (as loading it
        reads it)."""
        extra = state.get("state")
        return isinstance(extra, Mapping) and bool(extra.get("in_epoch", True))

    def on_load_checkpoint(self, state: dict[str, Any]) -> None:
        self._resume_in_epoch = bool(state.get("in_epoch", True))
        self._epoch_rng = state.get("epoch_rng")
        self._cut_short = bool(state.get("cut_short", False))


def _fetch_and_step(loop: TrainEpochLoop, ctx: Scope) -> Awaitable[None] | None:
    """The training loop's ``_take_batch`` then ``_advance`` in one call: its shortcut."""
    if RANGES.on or loop._worker is not None:
        loop._take_batch(ctx)
        return loop._advance(ctx)
    ctx.batch = batch = loop._opened.take()  # type: ignore[union-attr]
    ctx.batch_idx = loop.progress.current.ready - 1
    step = loop._step  # (read, then called: see TrainStep._plain)
    ctx.output = step(batch, ctx)
    return loop._boundary.settle()  # the step boundary, as far as it needs no waiting


class TrainEpochLoop(_EpochMarks, _DataLoop):
    """One epoch of training: an iteration per batch, validation when due."""

    events = LoopEvents(
        TrainEpochStarted, TrainBatchStarted, TrainBatchCompleted, TrainEpochCompleted
    )
    name = "train"

    # This run's step path, taken from the host when the run starts.
    _step: Callable[[Any, Scope], Any]
    _boundary: StepBoundary
    _worker: Any
    _state: RunState
    _stop: StopControl
    _max_steps: float
    _stop_window: int
    _val_every: int | None
    _fetch_and_advance = _fetch_and_step

    def __init__(self) -> None:
        super().__init__()
        self.val_loop: EvaluationLoop = EvaluationLoop(stage="validate")
        self._warned_skip = False

    def reset(self) -> None:
        if self._restarting and not self._resume_in_epoch:
            # Saved between epochs: the next epoch starts from its beginning.
            self.restarting = False
        super().reset()

    @property
    def done(self) -> bool:
        state = self._state
        ready = self.progress.current.ready
        if state.step >= self._max_steps or ready >= self._limit:
            return True
        # Inside an accumulation window a stop may wait for its end (TrainStep.stop_window).
        if state.stop_requested and ready % self._stop_window == 0:
            return True
        return not self._opened.has_next()  # type: ignore[union-attr]

    async def on_run_start(self, ctx: Scope, train_data: Any, val_data: Any = None) -> None:
        host = self.host
        options = host.options
        ctx.borrow("val_data", val_data)
        self._limit = batch_limit(options.limit_train_batches, train_data, "limit_train_batches")
        step = host.train_step
        self._step = step.for_epoch(self.closes_window)
        self._boundary = step.boundary
        self._worker = step.worker
        self._state = host.state
        self._stop = host.stop
        self._max_steps = options.max_steps
        self._stop_window = step.stop_window
        self._val_every = options.val_check_interval
        iterator = self.resume_iterator(train_data)
        self._open_source(ctx, host.sources, train_data, iterator, is_stateful(train_data))
        self._in_epoch = True

    def closes_window(self, size: int) -> bool:
        """Whether the batch in flight is the last of an accumulation window of ``size``
        batches: every ``size``-th of the epoch, the last that ``limit_train_batches``
        allows, or the loader's last (found by looking one batch ahead)."""
        n = self.progress.current.ready
        if n % size == 0 or n >= self._limit:
            return True
        return not self._opened.look_ahead()  # type: ignore[union-attr]

    def resume_iterator(self, data: Any) -> Iterator[Any]:
        """An iterator over ``data``, positioned after the batches this epoch already
        consumed when resuming mid-epoch: a stateful loader was repositioned from the
        checkpoint (O(1)); a plain one is iterated again under the random state it started
        the epoch with (the same shuffled order) and the consumed batches are skipped.
        Either way the global random generators are then set to the checkpoint's."""
        state = self.host.state
        if not self._restarting:
            self._epoch_rng = capture_epoch_rng(data)
            return iter(data)
        plan = state.resume
        resume_rng = state.take_resume_rng()
        if resume_rng is None:
            resume_rng = capture_rng()
        if plan is not None and plan.loader_restored:
            iterator = iter(data)
        else:
            positioned = plan is not None and plan.sampler_positioned
            consumed = 0 if positioned else self.progress.current.completed
            if self._epoch_rng is not None:
                restore_epoch_rng(self._epoch_rng, data)
            iterator = iter(data)
            if consumed:
                skip_consumed(iterator, consumed, warn=not self._warned_skip)
                self._warned_skip = True
        restore_rng(resume_rng)
        state.finish_resume()
        return iterator  # type: ignore[no-any-return]

    def _advance(self, ctx: Scope) -> Awaitable[None] | None:
        if self._worker is not None:
            return _in_worker(self, ctx)
        ctx.output = self._step(ctx.batch, ctx) if not RANGES.on else _in_step(self, ctx)
        return self._boundary.settle()  # the step boundary, as far as it needs no waiting

    def iteration_hooks(self) -> tuple[IterationHook | None, IterationHook, IterationHook | None]:
        start, advance, end = super().iteration_hooks()
        if self._val_every is None and type(self).on_advance_end is TrainEpochLoop.on_advance_end:
            end = None  # no validation inside the epoch: nothing to do after a batch
        return start, advance, end

    def iteration_boundary(self) -> Callable[[], None] | None:
        # Between two batches: the stop control's periodic exchange (None in one process).
        return self._stop.boundary

    async def on_advance_end(self, ctx: Scope) -> None:
        every = self._val_every
        if (
            every is not None
            and self.progress.current.ready % every == 0
            and self._validation_enabled(ctx)
        ):
            await self.val_loop.run(ctx.val_data, parent_ctx=ctx)
            # A stop asked by a validation handler takes effect at this boundary.
            self._stop.settle()

    def _validation_enabled(self, ctx: Scope) -> bool:
        return (
            ctx.get("val_data") is not None
            and self.host.options.limit_val_batches != 0
            and not self._state.stop_requested
        )

    async def on_run_end(self, ctx: Scope) -> None:
        host = self.host
        if self._state.stop_requested:  # still inside the epoch: a checkpoint resumes here
            await host.stop.stopping()
        options = host.options
        if (
            options.val_check_interval is None
            and (self._state.epoch + 1) % options.check_val_every_n_epoch == 0
            and self._validation_enabled(ctx)
        ):
            await self.val_loop.run(ctx.val_data, parent_ctx=ctx)
        await host.records.flush_pending()
        source = ctx.get("source")
        self._cut_short = source is not None and not source.exhausted()
        self._in_epoch = False


def _in_step(loop: TrainEpochLoop, ctx: Scope) -> Any:
    """The training step of ``loop`` inside the profiler range ``loopbus.step``."""
    with record_function("loopbus.step"):
        return loop._step(ctx.batch, ctx)


async def _in_worker(loop: TrainEpochLoop, ctx: Scope) -> None:
    """The training step of ``loop`` in its worker thread, then the step boundary."""
    ctx.output = await run_in_worker(loop._step, ctx, loop._worker)
    await loop._boundary()


class FitLoop(_Hosted, Loop[None]):
    """The whole of ``fit``: an iteration per epoch."""

    events = LoopEvents(FitStarted, EpochStarted, EpochCompleted, FitCompleted)
    name = "fit"

    def __init__(self) -> None:
        super().__init__()
        self.epoch_loop: TrainEpochLoop = TrainEpochLoop()

    @property
    def done(self) -> bool:
        state, options = self.host.state, self.host.options
        return (
            state.stop_requested
            or self.progress.total.completed >= options.max_epochs
            or state.step >= options.max_steps
        )

    async def on_run_start(self, ctx: Scope, train_data: Any, val_data: Any = None) -> None:
        ctx.borrow("train_data", train_data)
        ctx.borrow("val_data", val_data)

    def iteration_boundary(self) -> Callable[[], None] | None:
        # Before every epoch and after the last, on every rank: agree on a stop asked for
        # since the last batch (by epoch-end handlers) before any rank starts another.
        return self.host.stop.settle

    async def on_advance_start(self, ctx: Scope) -> None:
        state = self.host.state
        state.epoch_started(self.progress.total.ready - 1)
        if self._restarting and not self.epoch_loop.resumes_mid_epoch:
            # Resuming between epochs: set the generators as they were when saved (the
            # epoch loop does this itself when it resumes mid-epoch).
            resume_rng = state.take_resume_rng()
            if resume_rng is not None:
                restore_rng(resume_rng)
            state.finish_resume()
        set_sampler_epoch(ctx.train_data, state.epoch)

    async def advance(self, ctx: Scope) -> None:
        await self.epoch_loop.run(ctx.train_data, ctx.val_data, parent_ctx=ctx)

    async def on_advance_end(self, ctx: Scope) -> None:
        host = self.host
        # A fault-tolerant group that healed into a later epoch ended that one, not its own.
        self.progress.total.skip_to(host.state.epoch)
        await host.records.flush_pending()
        host.train_step.epoch_completed()

    async def on_run_end(self, ctx: Scope) -> None:
        host = self.host
        if host.state.stop_requested:  # a stop that came between epochs
            await host.stop.stopping()
        await host.records.flush_pending()

    def make_event(self, event_type: type[LoopEvent], ctx: Scope | None, **fields: Any) -> Any:
        if event_type is FitCompleted:
            state = self.host.state
            fields["stopped"] = state.stop_requested
            fields["reason"] = state.stop_reason
        return super().make_event(event_type, ctx, **fields)


_EVAL_EVENTS = {
    "validate": LoopEvents(
        ValidationStarted, ValidationBatchStarted, ValidationBatchCompleted, ValidationCompleted
    ),
    "test": LoopEvents(TestStarted, TestBatchStarted, TestBatchCompleted, TestCompleted),
    "predict": LoopEvents(
        PredictStarted, PredictBatchStarted, PredictBatchCompleted, PredictCompleted
    ),
}


#: The profiler range of a pass of each evaluation stage (see ``profiling_ranges``).
_RANGE_NAMES = {
    "validate": "loopbus.validation",
    "test": "loopbus.test",
    "predict": "loopbus.predict",
}


class EvaluationLoop(_DataLoop):
    """A pass over evaluation data without gradients, the module in eval mode
    (restored afterwards, even when a step raises)."""

    # This pass's step, taken from the host when the pass starts.
    _pass: EvalStep
    _boundary: Callable[[], Any]
    _state: RunState

    def __init__(self, stage: str = "validate") -> None:
        super().__init__()
        if stage not in ("validate", "test"):
            raise ValueError(f"EvaluationLoop stage must be 'validate' or 'test', got {stage!r}.")
        self.stage = stage
        self.name = stage
        self.events = _EVAL_EVENTS[stage]

    @property
    def done(self) -> bool:
        if self.progress.current.ready >= self._limit:
            return True
        # A stop request ends a validate/test/predict stage; validation inside fit runs
        # to its end (fit stops after it).
        state = self._state
        if state.stop_requested and state.stage == self.stage:
            return True
        return not self.run_ctx.source.has_next()

    def reset(self) -> None:
        # An evaluation pass always starts from its beginning, also after a resume.
        self.progress.reset_on_restart()
        self.progress.reset()

    async def run(self, *args: Any, parent_ctx: Scope | None = None, **kwargs: Any) -> Any:
        step = self.host.eval_step(self.stage)
        self._pass = step
        self._boundary = step.boundary
        with step.evaluating():
            if RANGES.on:
                with record_function(_RANGE_NAMES[self.stage]):
                    return await super().run(*args, parent_ctx=parent_ctx, **kwargs)
            return await super().run(*args, parent_ctx=parent_ctx, **kwargs)

    def _pass_limit(self, options: LoopLimits, data: Any) -> float:
        """How many batches of ``data`` this pass runs (``limit_*_batches``)."""
        option = f"limit_{'val' if self.stage == 'validate' else self.stage}_batches"
        return batch_limit(getattr(options, option), data, option)

    async def on_run_start(self, ctx: Scope, data: Any) -> None:
        host = self.host
        self._limit = self._pass_limit(host.options, data)
        self._state = host.state
        self._open_source(ctx, host.sources, data, iter(data))

    def _advance(self, ctx: Scope) -> Awaitable[None] | None:
        step = self._pass
        if step.worker is not None:
            return _evaluated_in_worker(self, ctx)
        self.keep_output(ctx, step.run(ctx.batch, ctx))
        return self._boundary()

    def keep_output(self, ctx: Scope, output: Any) -> None:
        ctx.output = output

    async def on_run_end(self, ctx: Scope) -> Any:
        await self.host.records.flush_pending()
        return None


async def _evaluated_in_worker(loop: EvaluationLoop, ctx: Scope) -> None:
    """The evaluation step of ``loop`` in its worker thread, then the step boundary."""
    loop.keep_output(ctx, await run_in_worker(loop._pass.run, ctx, loop._pass.worker))
    await loop._boundary()


class PredictionLoop(EvaluationLoop):
    """``predict``: runs ``predict_step`` over the data and returns the outputs."""

    def __init__(self) -> None:
        _DataLoop.__init__(self)
        self.stage = "predict"
        self.name = "predict"
        self.events = _EVAL_EVENTS["predict"]

    async def on_run_start(self, ctx: Scope, data: Any) -> None:
        ctx.predictions = []
        await super().on_run_start(ctx, data)

    def keep_output(self, ctx: Scope, output: Any) -> None:
        ctx.predictions.append(output)
        # Owned by the predictions list, which is handed to the caller at the end.
        ctx.borrow("output", output)

    async def on_run_end(self, ctx: Scope) -> Any:
        await super().on_run_end(ctx)
        return ctx.detach("predictions")


class SanityCheckLoop(EvaluationLoop):
    """``fit``'s sanity check (``Trainer(num_sanity_val_steps=N)``): up to ``steps``
    validation batches before the first training step, so that a broken
    ``validation_step`` fails at once instead of after an epoch.

    The trainer runs it on a bus of its own, to which only the module's handlers are
    subscribed (its ``ValidationCompleted`` handler can reset its metrics; plugins never
    see the run), and the records put during it are dropped, never published: no
    logger, plugin or ``trainer.latest`` sees them. Its events name the loop
    ``"sanity_check"``.
    """

    def __init__(self, steps: float) -> None:
        super().__init__(stage="validate")
        self.name = "sanity_check"
        self.steps = steps

    def _pass_limit(self, options: LoopLimits, data: Any) -> float:
        return min(super()._pass_limit(options, data), self.steps)

    async def on_run_start(self, ctx: Scope, data: Any) -> None:
        await super().on_run_start(ctx, data)
        self._boundary = self._drop_records

    async def _drop_records(self) -> None:
        self.host.records.discard_pending()
        await checkpoint()

    async def on_run_end(self, ctx: Scope) -> Any:
        self.host.records.discard_pending()
        return None
