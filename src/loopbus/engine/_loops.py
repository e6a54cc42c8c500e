"""The trainer's loops, built on :class:`Loop`:

``FitLoop`` (one iteration per epoch) -> ``TrainEpochLoop`` (one iteration per batch)
-> ``EvaluationLoop`` (validation, run from the epoch loop); ``EvaluationLoop`` also
serves ``validate``/``test`` and ``PredictionLoop`` serves ``predict``.

Per-step work here is on the hot path: no allocation or call that is not needed.
"""

from __future__ import annotations

import math
import queue
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from time import perf_counter
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import anyio.to_thread
import torch
from anyio.lowlevel import checkpoint

from .._exceptions import MisconfigurationError
from ..events import (
    AfterBackward,
    BeforeOptimizerStep,
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
from ._device import move_batch
from ._loop import Loop, LoopEvents
from ._rng import (
    capture_epoch_rng,
    capture_rng,
    restore_epoch_rng,
    restore_rng,
    set_sampler_epoch,
)
from ._scope import Scope
from ._state import Stateful

if TYPE_CHECKING:
    pass

__all__ = ["EvaluationLoop", "FitLoop", "PredictionLoop", "SanityCheckLoop", "TrainEpochLoop"]

_Tensor = torch.Tensor
_UNSET: Any = object()
_END: Any = object()


class BatchSource:
    """Hands a loop its batches: one ahead, lazily, so ``done`` can tell whether one is
    left, and keeps the position of a stateful loader as of the last batch handed out.

    * :meth:`has_next` (``done``, between iterations) fetches the batch the next
      iteration trains on, after the previous iteration's events (a checkpoint saved at
      ``TrainBatchCompleted`` sees the loader right after the batch it trained on).
    * :meth:`look_ahead` (inside an iteration: is the batch in flight the last one?)
      fetches too, but first records the loader's position, since the batch it fetches
      has not been trained on.
    * :meth:`position` is the loader state a checkpoint saves: the recorded one while
      a batch fetched ahead is waiting, else the loader's own.
    """

    __slots__ = ("__weakref__", "_pending", "_recorded", "iterator", "loader", "next")

    def __init__(self, iterator: Iterator[Any], loader: Any = None) -> None:
        self.iterator = iterator
        #: The stateful loader whose position is tracked, or None.
        self.loader = loader
        self.next: Any = _UNSET
        self._recorded: dict[str, Any] | None = None
        self._pending: dict[str, Any] | None = None

    def exhausted(self) -> bool:
        """Whether the iterator is known to have run out (a look-ahead found its end)."""
        return self.next is _END

    def close(self) -> None:
        """Release what the source holds (nothing to stop for an inline source)."""

    def has_next(self) -> bool:
        if self.next is _UNSET:
            try:
                self.next = next(self.iterator)
            except StopIteration:
                self.next = _END
        return self.next is not _END

    def look_ahead(self) -> bool:
        """Whether a batch follows the one in flight (fetching it if needed)."""
        if self.next is _UNSET and self.loader is not None:
            self._recorded = self.loader.state_dict()
        return self.has_next()

    def take(self) -> Any:
        """The next batch (``has_next`` must have returned True)."""
        batch = self.next
        self.next = _UNSET
        self._recorded = None
        return batch

    def position(self) -> dict[str, Any] | None:
        """The loader's position as of the last batch handed out (None: untracked)."""
        if self._recorded is not None:
            return self._recorded
        return None if self.loader is None else self.loader.state_dict()


class ThreadedBatchSource(BatchSource):
    """A :class:`BatchSource` whose batches are fetched by a worker thread, up to
    ``depth`` ahead, while the steps run (``Trainer(prefetch=N)`` on CPU): loading that
    releases the GIL (file I/O, decoding in C, torch ops) overlaps with the step.

    The worker records a stateful loader's position right after fetching each batch,
    so :meth:`position` is that of the last batch handed out, never of one fetched
    ahead. Close it (the loops do, however the run ends) to stop the worker.
    """

    __slots__ = ("_closed", "_error", "_prepare", "_queue", "_thread")

    def __init__(
        self,
        iterator: Iterator[Any],
        loader: Any = None,
        depth: int = 1,
        prepare: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(iterator, loader)
        # Applied to every batch on the worker (pinning it for a device copy).
        self._prepare = prepare
        self._queue: queue.Queue[tuple[Any, Any]] = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._error: BaseException | None = None
        # The position before any batch, and the first batch, are taken here on the
        # calling thread: a shuffled loader draws its order from the global generators
        # at its first fetch, which must not race with the step's draws.
        if loader is not None:
            self._recorded = loader.state_dict()
        try:
            first = next(iterator)
            if prepare is not None:
                first = prepare(first)
        except StopIteration:
            first = _END
        self._queue.put((first, None if loader is None else loader.state_dict()))
        del first
        self._thread = threading.Thread(target=self._fetch, name="loopbus-prefetch", daemon=True)
        if self._queue.queue[0][0] is not _END:
            self._thread.start()

    def _fetch(self) -> None:
        put = self._queue.put
        closed = self._closed
        prepare = self._prepare
        try:
            for batch in self.iterator:
                if prepare is not None:
                    batch = prepare(batch)
                item = (batch, None if self.loader is None else self.loader.state_dict())
                while not closed.is_set():
                    try:
                        put(item, timeout=0.05)
                        break
                    except queue.Full:
                        continue
                else:
                    return
                del batch, item
        except BaseException as exc:  # handed to the consumer, raised there
            self._error = exc
        while not closed.is_set():
            try:
                put((_END, None), timeout=0.05)
                return
            except queue.Full:
                continue

    def has_next(self) -> bool:
        if self.next is _UNSET:
            batch, position = self._queue.get()
            if batch is _END and self._error is not None:
                error, self._error = self._error, None
                raise error
            self.next = batch
            self._pending = position
        return self.next is not _END

    def look_ahead(self) -> bool:
        return self.has_next()

    def take(self) -> Any:
        batch = self.next
        self.next = _UNSET
        self._recorded = self._pending
        self._pending = None
        return batch

    def position(self) -> dict[str, Any] | None:
        return self._recorded

    def close(self) -> None:
        """Stop the worker and wait for it (it finishes the fetch in progress)."""
        self._closed.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread.is_alive():
            self._thread.join()
        self.next = _END


def _batch_limit(value: int | float | None, data: Any, option: str) -> float:
    """Number of batches allowed by ``limit_*_batches``: an int is a count, a float a
    fraction of ``len(data)``; None means no limit (inf)."""
    if value is None:
        return math.inf
    if isinstance(value, float):
        try:
            n = len(data)
        except TypeError:
            if value == 1.0:
                return math.inf
            raise MisconfigurationError(
                f"{option}={value!r} is a fraction, but the data has no len(); pass a "
                "number of batches (an int) instead."
            ) from None
        return float(int(n * value))
    return float(value)


def _loss_of(output: Any) -> _Tensor | None:
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


class _DataLoop(Loop[Any]):
    """What the batch loops share: fetching, device moves and yielding to the event loop."""

    _limit: float = math.inf
    _borrow_batches: bool = False
    _total: int | None = None
    # This stage's step path (see StepPath), taken when a run starts.
    _move_to: torch.device | None = None
    _worker: Any = None
    _boundary: Any = None
    _source: BatchSource | None = None

    @property
    def total_batches(self) -> int | None:
        """The number of batches the current (or last) run goes through: ``len(data)``
        capped by the ``limit_*_batches`` option, or None when the data has no length and
        no limit applies. Read-only (for progress displays); set when the run starts."""
        return self._total

    def _start_fetching(
        self, ctx: Scope, data: Any, iterator: Iterator[Any], track_position: bool = False
    ) -> None:
        loader = data if track_position else None
        path = self.trainer.step_path
        depth = path.prefetch
        source: BatchSource
        if depth:
            source = ThreadedBatchSource(iterator, loader, depth, path.prepare)
        else:
            source = BatchSource(iterator, loader)
        if path.device_source is not None:
            # Moved to the device ahead of the step (CUDA side-stream prefetch).
            source = path.device_source(source, pin=path.prepare is None)
        # Owned by the loop until the run ends (closed then, however it ends).
        self._source = source
        ctx.borrow("source", source)
        self._borrow_batches = isinstance(data, Sequence)
        try:
            total = min(float(len(data)), self._limit)
        except TypeError:  # an iterable without len()
            total = self._limit
        self._total = None if total == math.inf else int(total)

    async def run(self, *args: Any, parent_ctx: Scope | None = None, **kwargs: Any) -> Any:
        try:
            return await super().run(*args, parent_ctx=parent_ctx, **kwargs)
        finally:
            source, self._source = self._source, None
            if source is not None:
                source.close()

    def _next_batch(self, it: Scope) -> Any:
        batch = self.run_ctx.source.take()
        device = self._move_to
        if device is not None:
            batch = move_batch(batch, device)
        if self._borrow_batches:
            # Batches from an in-memory sequence are owned by it, not by the scope.
            it.borrow("batch", batch)
        else:
            it.batch = batch
        it.batch_idx = self.progress.current.ready - 1
        return batch

    def make_event(self, event_type: type[LoopEvent], ctx: Scope | None, **fields: Any) -> Any:
        if event_type is self.events.advance_started or event_type is self.events.advance_completed:
            fields["batch_idx"] = self.progress.current.ready - 1
        return super().make_event(event_type, ctx, **fields)


async def _in_thread(step: Callable[[Any, Scope], Any], ctx: Scope, limiter: Any) -> Any:
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


class StepBoundary:
    """What runs after every step of a stage: flush the step's records, and at most every
    ``yield_interval`` seconds let other tasks run. One per stage, owned by the trainer.
    The flush is chosen once: the recorder's step flush where put values are read back
    from a device without waiting (CUDA), its plain flush elsewhere."""

    __slots__ = ("_flush", "_next_yield", "interval", "recorder")

    def __init__(self, recorder: Any, interval: float) -> None:
        self.recorder = recorder
        self.interval = interval
        self._next_yield = perf_counter() + interval
        self._flush = recorder.flush if recorder.readback is None else recorder.flush_step

    async def __call__(self) -> None:
        recorder = self.recorder
        if recorder.pending or recorder.inflight:
            await self._flush()
        if perf_counter() >= self._next_yield:
            await checkpoint()
            self._next_yield = perf_counter() + self.interval


class StepPath(NamedTuple):
    """How a stage runs its steps, chosen once when the stage starts (by the trainer):
    the device batches move to (None: they stay where the loader put them), the
    limiter of the worker thread steps run in (None: inline on the event loop), the
    delivery of in-step events (direct, or hopping from the worker to the loop), the step
    boundary, how many batches a worker thread fetches ahead (0: fetched inline), what
    the training step's forward calls (None: the module's ``training_step``; under DDP
    the wrapper), the distributed strategy (None in a single process), what the
    prefetch worker does to each batch (pinning it for a device copy; None: nothing),
    and what wraps the host batch source to move batches to the device ahead of the
    step (``CudaBatchSource``; None: they move in the step's iteration, on the compute
    stream, if ``move_to`` is set)."""

    move_to: torch.device | None
    worker: Any
    emit: Callable[[Any, Any], Any]
    boundary: StepBoundary
    prefetch: int = 0
    forward: Callable[[Any, Any], Any] | None = None
    strategy: Any = None
    prepare: Callable[[Any], Any] | None = None
    device_source: Callable[..., Any] | None = None


class TrainEpochLoop(_DataLoop):
    """One epoch of training: an iteration per batch, validation when due."""

    events = LoopEvents(
        TrainEpochStarted, TrainBatchStarted, TrainBatchCompleted, TrainEpochCompleted
    )
    name = "train"

    def __init__(self) -> None:
        super().__init__()
        self.val_loop: EvaluationLoop = EvaluationLoop(stage="validate")
        self._warned_skip = False
        # Checkpointed: the generators' state right before this epoch's iter(data) (to
        # replay a plain loader's order), whether an epoch is in flight, and whether the
        # loaded checkpoint was taken inside one.
        self._epoch_rng: dict[str, Any] | None = None
        self._in_epoch = False
        self._resume_in_epoch = True
        # Whether the last epoch ended before its loader ran out (a stop, max_steps,
        # limit_train_batches): the loader's own position is then mid-epoch, and the
        # next epoch starts from the beginning, not from there.
        self._cut_short = False
        # Chosen when the epoch starts (see _choose_step).
        self._step: Callable[[Any, Scope], Any] = self.training_step
        # What the steps call for the forward (the module's training_step, or DDP's
        # wrapper of it) and the distributed strategy (None in a single process).
        self._forward: Callable[[Any, Scope], Any] | None = None
        self._strategy: Any = None

    def reset(self) -> None:
        if self._restarting and not self._resume_in_epoch:
            # Saved between epochs: the next epoch starts from its beginning.
            self.restarting = False
        super().reset()

    @property
    def resumes_mid_epoch(self) -> bool:
        """Whether the loop was loaded from a checkpoint taken inside an epoch and has not
        resumed yet."""
        return self._restarting and self._resume_in_epoch

    @property
    def done(self) -> bool:
        trainer = self._trainer
        assert trainer is not None
        state = trainer.state
        strategy = self._strategy
        if strategy is not None:
            # Under DDP, one asynchronous all-reduce per batch boundary (after the
            # batch's events), read at the next one: a stop asked on any rank stops
            # every rank at the same boundary, one step later.
            strategy.exchange_stop(state)
        if state.stop_requested or state.step >= trainer.max_steps:
            return True
        if self.progress.current.ready >= self._limit:
            return True
        return not self.run_ctx.source.has_next()

    async def on_run_start(self, ctx: Scope, train_data: Any, val_data: Any = None) -> None:
        trainer = self.trainer
        ctx.borrow("val_data", val_data)
        self._limit = _batch_limit(trainer.limit_train_batches, train_data, "limit_train_batches")
        path = trainer.step_path
        self._move_to = path.move_to
        self._worker = path.worker
        self._boundary = path.boundary
        module = trainer.module
        assert module is not None
        self._forward = path.forward or module.training_step
        self._strategy = path.strategy
        self._step = self._choose_step()
        self._start_fetching(
            ctx, train_data, self.resume_iterator(train_data), isinstance(train_data, Stateful)
        )
        self._in_epoch = True

    def _choose_step(self) -> Callable[[Any, Scope], Any]:
        """The synchronous step for this stage's options: the plain automatic step when
        nothing is configured that needs the general one."""
        trainer = self.trainer
        if type(self).training_step is not TrainEpochLoop.training_step:
            return self.training_step  # a subclass's own step
        if not trainer.automatic_optimization:
            return self.manual_step
        precision = trainer.precision
        if (
            precision.autocast is None
            and precision.scaler is None
            and trainer.accumulate_grad_batches == 1
            and trainer.gradient_clip_val is None
            and not trainer.steps_schedulers_per_step
        ):
            return self.plain_step
        return self.training_step

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
        """Whether a checkpoint now is inside an epoch (loaded but not resumed yet: as
        loaded)."""
        return self._resume_in_epoch if self._restarting else self._in_epoch

    def resume_iterator(self, data: Any) -> Iterator[Any]:
        """An iterator over ``data``, positioned after the batches this epoch already
        consumed when resuming mid-epoch.

        A stateful loader (``state_dict``/``load_state_dict``, such as torchdata's
        ``StatefulDataLoader``) was repositioned from the checkpoint: O(1). A plain loader
        is iterated again under the random state it started the epoch with (so a shuffled
        loader yields the same order) and the consumed batches are skipped. Either way the
        global random generators are then set to the checkpoint's state.
        """
        state = self.trainer.state
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
            consumed = self.progress.current.completed
            if self._epoch_rng is not None:
                restore_epoch_rng(self._epoch_rng, data)
            iterator = iter(data)
            if consumed:
                if not self._warned_skip:
                    warnings.warn(
                        f"resuming mid-epoch by skipping the {consumed} batches this epoch "
                        "already consumed, in the same (shuffled) order as before: the data "
                        "loader is not stateful, so they are loaded again and dropped. Use "
                        "torchdata.stateful_dataloader.StatefulDataLoader to resume in O(1).",
                        UserWarning,
                        stacklevel=2,
                    )
                    self._warned_skip = True
                for _ in range(consumed):
                    try:
                        next(iterator)
                    except StopIteration:
                        break
        restore_rng(resume_rng)
        state.finish_resume()
        return iterator  # type: ignore[no-any-return]

    async def on_advance_start(self, ctx: Scope) -> None:
        self._next_batch(ctx)

    async def advance(self, ctx: Scope) -> None:
        worker = self._worker
        if worker is None:
            ctx.output = self._step(ctx.batch, ctx)
        else:
            ctx.output = await _in_thread(self._step, ctx, worker)
        await self._boundary()

    def plain_step(self, batch: Any, ctx: Scope) -> Any:
        """The automatic step without autocast, grad scaling, accumulation, clipping or
        per-step schedulers: forward, backward, optimizer step."""
        trainer = self._trainer
        assert trainer is not None
        output = self._forward(batch, ctx)  # type: ignore[misc]
        loss = output if type(output) is _Tensor else _loss_of(output)
        if loss is None:
            return output
        loss.backward()  # type: ignore[no-untyped-call]
        table = trainer.bus.table
        entries = table[AfterBackward]
        if entries:
            self._emit(entries, AfterBackward, ctx)
        optimizer = trainer.optimizers[0]
        entries = table[BeforeOptimizerStep]
        if entries:
            self._emit(entries, BeforeOptimizerStep, ctx, optimizer=optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        trainer.state.step_completed()
        return output

    def manual_step(self, batch: Any, ctx: Scope) -> Any:
        """``automatic_optimization = False``: the module's step does backward and
        optimizer steps itself; each call counts as one step."""
        trainer = self._trainer
        assert trainer is not None
        module = trainer.module
        assert module is not None
        autocast = trainer.precision.autocast
        forward = self._forward or module.training_step  # a subclass calling early
        if autocast is None:
            output = forward(batch, ctx)
        else:
            with autocast():
                output = forward(batch, ctx)
        trainer.state.step_completed()
        return output

    def training_step(self, batch: Any, ctx: Scope) -> Any:
        """The general synchronous step: forward (under autocast), backward (scaled),
        accumulation, clipping, optimizer and per-step scheduler steps. Runs on the event
        loop thread or in the worker thread."""
        trainer = self._trainer
        assert trainer is not None
        if not trainer.automatic_optimization:
            return self.manual_step(batch, ctx)
        precision = trainer.precision
        accumulate = trainer.accumulate_grad_batches
        strategy = self._strategy
        if strategy is not None and accumulate > 1 and not self._at_accumulation_boundary():
            # A non-final micro-batch under DDP: accumulate locally, sync on the last.
            with strategy.no_sync():
                output, _ = self._forward_backward(batch, ctx, accumulate)
            return output
        output, has_loss = self._forward_backward(batch, ctx, accumulate)
        if not has_loss:
            return output
        if accumulate > 1 and strategy is None and not self._at_accumulation_boundary():
            return output
        table = trainer.bus.table
        optimizer = trainer.optimizers[0]
        clip = trainer.gradient_clip_val
        if clip is not None:
            precision.unscale_(optimizer)
            params = [p for g in optimizer.param_groups for p in g["params"]]
            if trainer.gradient_clip_algorithm == "norm":
                torch.nn.utils.clip_grad_norm_(params, clip)
            else:
                torch.nn.utils.clip_grad_value_(params, clip)
        entries = table[BeforeOptimizerStep]
        if entries:
            self._emit(entries, BeforeOptimizerStep, ctx, optimizer=optimizer)
        if precision.scaler is None:
            optimizer.step()
        else:
            precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        trainer.state.step_completed()
        if trainer.steps_schedulers_per_step:
            trainer.step_lr_schedulers("step")
        return output

    def _forward_backward(self, batch: Any, ctx: Scope, accumulate: int) -> tuple[Any, bool]:
        """Forward (under autocast) and backward (scaled) of one batch: the step's output
        and whether it returned a loss (None skips the backward)."""
        trainer = self._trainer
        assert trainer is not None
        module = trainer.module
        assert module is not None
        precision = trainer.precision
        autocast = precision.autocast
        forward = self._forward or module.training_step  # a subclass calling early
        if autocast is None:
            output = forward(batch, ctx)
        else:
            with autocast():
                output = forward(batch, ctx)
        loss = output if type(output) is _Tensor else _loss_of(output)
        if loss is None:
            return output, False
        if accumulate > 1:
            loss = loss / accumulate
        if precision.scaler is None:
            loss.backward()  # type: ignore[no-untyped-call]
        else:
            precision.backward(loss)
        entries = trainer.bus.table[AfterBackward]
        if entries:
            self._emit(entries, AfterBackward, ctx)
        return output, True

    def _emit(self, entries: Any, event_type: Any, ctx: Scope, **fields: Any) -> None:
        """Deliver an in-step event (from the worker thread too) to its handlers."""
        event = self.make_event(event_type, ctx, batch_idx=ctx.batch_idx, **fields)
        self.trainer.step_path.emit(entries, event)

    def _at_accumulation_boundary(self) -> bool:
        trainer = self._trainer
        assert trainer is not None
        n = self.progress.current.ready
        if n % trainer.accumulate_grad_batches == 0 or n >= self._limit:
            return True
        # The last batch of the epoch closes the window too: look one batch ahead.
        return not self.run_ctx.source.look_ahead()

    async def on_advance_end(self, ctx: Scope) -> None:
        trainer = self._trainer
        assert trainer is not None
        every = trainer.val_check_interval
        if (
            every is not None
            and self.progress.current.ready % every == 0
            and self._validation_enabled(ctx)
        ):
            await self.val_loop.run(ctx.val_data, parent_ctx=ctx)
            strategy = self._strategy
            if strategy is not None:
                # A stop asked by a validation handler takes effect at this boundary.
                strategy.settle_stop(trainer.state)

    def _validation_enabled(self, ctx: Scope) -> bool:
        trainer = self._trainer
        assert trainer is not None
        return (
            ctx.get("val_data") is not None
            and trainer.limit_val_batches != 0
            and not trainer.should_stop
        )

    async def on_run_end(self, ctx: Scope) -> None:
        trainer = self.trainer
        n = trainer.check_val_every_n_epoch
        if (
            trainer.val_check_interval is None
            and (trainer.current_epoch + 1) % n == 0
            and self._validation_enabled(ctx)
        ):
            await self.val_loop.run(ctx.val_data, parent_ctx=ctx)
        recorder = trainer.recorder
        if recorder.pending or recorder.inflight:
            await recorder.flush()
        source = ctx.get("source")
        self._cut_short = source is not None and not source.exhausted()
        self._in_epoch = False

    def on_save_checkpoint(self) -> dict[str, Any]:
        return {
            "in_epoch": self._saved_in_epoch,
            "epoch_rng": self._epoch_rng,
            "cut_short": self._cut_short,
        }

    def on_load_checkpoint(self, state: dict[str, Any]) -> None:
        self._resume_in_epoch = bool(state.get("in_epoch", True))
        self._epoch_rng = state.get("epoch_rng")
        self._cut_short = bool(state.get("cut_short", False))


class FitLoop(Loop[None]):
    """The whole of ``fit``: an iteration per epoch."""

    events = LoopEvents(FitStarted, EpochStarted, EpochCompleted, FitCompleted)
    name = "fit"

    def __init__(self) -> None:
        super().__init__()
        self.epoch_loop: TrainEpochLoop = TrainEpochLoop()

    @property
    def done(self) -> bool:
        trainer = self._trainer
        assert trainer is not None
        state = trainer.state
        strategy = trainer.step_path.strategy
        if strategy is not None:
            # Checked once per epoch on every rank: agree on a stop asked for since the
            # last step (by epoch-end handlers) before any rank starts another epoch.
            strategy.settle_stop(state)
        return (
            state.stop_requested
            or self.progress.total.completed >= trainer.max_epochs
            or state.step >= trainer.max_steps
        )

    async def on_run_start(self, ctx: Scope, train_data: Any, val_data: Any = None) -> None:
        ctx.borrow("train_data", train_data)
        ctx.borrow("val_data", val_data)

    async def on_advance_start(self, ctx: Scope) -> None:
        state = self.trainer.state
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
        trainer = self.trainer
        recorder = trainer.recorder
        if recorder.pending or recorder.inflight:
            await recorder.flush()
        trainer.step_lr_schedulers("epoch")

    async def on_run_end(self, ctx: Scope) -> None:
        trainer = self.trainer
        recorder = trainer.recorder
        if recorder.pending or recorder.inflight:
            await recorder.flush()

    def make_event(self, event_type: type[LoopEvent], ctx: Scope | None, **fields: Any) -> Any:
        if event_type is FitCompleted:
            trainer = self.trainer
            fields["stopped"] = trainer.should_stop
            fields["reason"] = trainer.stop_reason
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


class EvaluationLoop(_DataLoop):
    """A pass over evaluation data without gradients, the module in eval mode
    (restored afterwards, even when a step raises)."""

    def __init__(self, stage: str = "validate") -> None:
        super().__init__()
        if stage not in ("validate", "test"):
            raise ValueError(f"EvaluationLoop stage must be 'validate' or 'test', got {stage!r}.")
        self.stage = stage
        self.name = stage
        self.events = _EVAL_EVENTS[stage]

    def _step_function(self) -> Callable[[Any, Scope], Any]:
        module = self.trainer.module
        assert module is not None
        return module.validation_step if self.stage == "validate" else module.test_step

    @property
    def done(self) -> bool:
        if self.progress.current.ready >= self._limit:
            return True
        trainer = self._trainer
        # A stop request ends a validate/test/predict stage; validation inside fit runs
        # to its end (fit stops after it).
        state = trainer.state  # type: ignore[union-attr]
        if state.stop_requested and state.stage == self.stage:
            return True
        return not self.run_ctx.source.has_next()

    def reset(self) -> None:
        # An evaluation pass always starts from its beginning, also after a resume.
        self.progress.reset_on_restart()
        self.progress.reset()

    async def run(self, *args: Any, parent_ctx: Scope | None = None, **kwargs: Any) -> Any:
        module = self.trainer.module
        assert module is not None
        was_training = module.training
        module.eval()
        try:
            return await super().run(*args, parent_ctx=parent_ctx, **kwargs)
        finally:
            module.train(was_training)

    async def on_run_start(self, ctx: Scope, data: Any) -> None:
        trainer = self.trainer
        option = f"limit_{'val' if self.stage == 'validate' else self.stage}_batches"
        self._limit = _batch_limit(getattr(trainer, option), data, option)
        self._prepare_steps()
        self._start_fetching(ctx, data, iter(data))

    def _prepare_steps(self) -> None:
        path = self.trainer.step_path
        self._step = self._step_function()
        self._move_to = path.move_to
        self._worker = path.worker
        self._boundary = path.boundary

    async def on_advance_start(self, ctx: Scope) -> None:
        self._next_batch(ctx)

    async def advance(self, ctx: Scope) -> None:
        worker = self._worker
        if worker is None:
            output = self.evaluation_step(ctx.batch, ctx)
        else:
            output = await _in_thread(self.evaluation_step, ctx, worker)
        self.keep_output(ctx, output)
        await self._boundary()

    def keep_output(self, ctx: Scope, output: Any) -> None:
        ctx.output = output

    def evaluation_step(self, batch: Any, ctx: Scope) -> Any:
        trainer = self._trainer
        assert trainer is not None
        autocast = trainer.precision.autocast
        with torch.no_grad():
            if autocast is None:
                return self._step(batch, ctx)
            with autocast():
                return self._step(batch, ctx)

    async def on_run_end(self, ctx: Scope) -> Any:
        trainer = self.trainer
        recorder = trainer.recorder
        if recorder.pending or recorder.inflight:
            await recorder.flush()
        return None


class PredictionLoop(EvaluationLoop):
    """``predict``: runs ``predict_step`` over the data and returns the outputs."""

    def __init__(self) -> None:
        _DataLoop.__init__(self)
        self.stage = "predict"
        self.name = "predict"
        self.events = _EVAL_EVENTS["predict"]

    def _step_function(self) -> Callable[[Any, Scope], Any]:
        module = self.trainer.module
        assert module is not None
        return module.predict_step

    async def on_run_start(self, ctx: Scope, data: Any) -> None:
        trainer = self.trainer
        self._limit = _batch_limit(trainer.limit_predict_batches, data, "limit_predict_batches")
        self._prepare_steps()
        ctx.predictions = []
        self._start_fetching(ctx, data, iter(data))

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

    async def on_run_start(self, ctx: Scope, data: Any) -> None:
        limit = _batch_limit(self.trainer.limit_val_batches, data, "limit_val_batches")
        self._limit = min(limit, self.steps)
        self._prepare_steps()
        self._boundary = self._drop_records
        self._start_fetching(ctx, data, iter(data))

    async def _drop_records(self) -> None:
        self.trainer.recorder.discard_pending()
        await checkpoint()

    async def on_run_end(self, ctx: Scope) -> Any:
        self.trainer.recorder.discard_pending()
        return None
