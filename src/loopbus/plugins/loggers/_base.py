"""The logger base: batches put records and writes them off the event loop.

Every logger is a queued subscriber of the records addressed to ``"loggers"``: the step
only hands a record to the subscription's bounded queue. The logger's handler adds it
to a batch and, when the batch is full or ``flush_interval`` seconds have passed since
the last write, writes the batch in a worker thread (``anyio.to_thread``) while the
queue keeps filling; a timer writes a batch that would otherwise wait for the next
record. Back-pressure is the bus's: while a write runs the queue fills, and then its
``overflow`` policy applies (``"block"``: the step waits, nothing is lost; ``"drop"``:
the record is dropped and counted on the subscription). When the stage ends, however
it ends, one path writes what is left, flushes and closes.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import anyio
import anyio.to_thread

from loopbus import (
    Delivery,
    Plugin,
    PutRecord,
    check_choice,
    check_int,
    check_number,
    on,
)
from loopbus.events import FitStarted

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from loopbus import TrainerView

__all__ = ["Logger"]

_OVERFLOWS = {"block": "the step waits for the logger", "drop": "drop and count"}
_NO_HPARAMS: Mapping[str, Any] = MappingProxyType({})


class Logger(Plugin):
    """Base of loggers: batches put records and writes them off the event loop.

    Subclasses implement :meth:`write` and, as needed, :meth:`open`, :meth:`flush`,
    :meth:`close` and :meth:`write_hparams`. They run in worker threads, one at a time,
    never concurrently with each other, so they may block (a file, a socket, a
    database)::

        class PrintLogger(Logger):
            def write(self, records):
                for r in records:
                    print(f"step {r.step}: {r.name} = {r.value}")

    A batch is written when it holds ``buffer`` records or ``flush_interval`` seconds
    after the previous write, so a record waits about that long at most; ``buffer``
    bounds both the subscription's queue and the batch; ``overflow`` is what a full queue
    does to the step (``"block"`` waits, ``"drop"`` drops and counts). Everything is
    written, flushed and closed when the stage ends, however it ends.

    :meth:`open` is called when the stage starts; for ``fit`` once it is known whether
    the run resumes from a checkpoint, which :attr:`resume_step` then tells (the
    checkpoint's step; None for a fresh start): a logger that continues a history drops
    what it wrote after that step. :meth:`write_hparams` follows with the run's
    configuration (``trainer.run_config``: given with ``Trainer.set_run_config``, or the
    default one of a trainer with a run folder) when there is one, else with the
    module's hyperparameters (:attr:`loopbus.Module.hparams`) when it saved any.
    """

    #: Queued, for the loggers destination, on rank 0 only in a distributed run.
    delivery = Delivery(destination="loggers", mode="queued", ranks="zero")
    #: Left out by ``Trainer(fast_dev_run=...)``, which writes no log files.
    writes_files: ClassVar[bool] = True

    def __init__(
        self,
        *,
        flush_interval: float = 0.5,
        buffer: int = 1024,
        overflow: Literal["block", "drop"] = "block",
    ) -> None:
        name = type(self).__name__
        self.flush_interval = check_number(
            "flush_interval", flush_interval, minimum=0, owner=name, what="a number of seconds"
        )
        self.batch_size = check_int("buffer", buffer, owner=name)
        check_choice("overflow", overflow, _OVERFLOWS, owner=name)
        # This logger's queue: the batch size, and what a full one does.
        self.delivery = type(self).delivery.replace(buffer=self.batch_size, overflow=overflow)
        # Per stage. The batch is filled on the event loop and handed over whole.
        self._batch: list[PutRecord] = []
        self._executor: ThreadPoolExecutor | None = None
        self._in_flight: Future[None] | None = None
        self._due = -math.inf
        self._timer: anyio.CancelScope | None = None
        self._trainer: TrainerView | None = None
        self._stage: str | None = None
        self._hparams: Mapping[str, Any] = _NO_HPARAMS
        self._resume_step: int | None = None
        self._resume_time: float | None = None
        self._is_open = False
        self._error: BaseException | None = None
        self._error_raised = False
        self._error_at_close = False

    @property
    def overflow_policy(self) -> Literal["block", "drop"]:
        """Deprecated: ``delivery.overflow``."""
        warnings.warn(
            "Logger.overflow_policy is deprecated; read logger.delivery.overflow.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.delivery.overflow

    @property
    def resume_step(self) -> int | None:
        """The step of the checkpoint the running ``fit`` resumed from, or None (a fresh
        start, or another stage). Set before :meth:`open` is called."""
        return self._resume_step

    @property
    def resume_time(self) -> float | None:
        """When the checkpoint the running ``fit`` resumed from was taken
        (``time.time()``), if it says: a record of :attr:`resume_step` published later
        (a validation that ran after the checkpoint) is written again by the resumed run.
        """
        return self._resume_time

    # ------------------------------------------------------------ to implement
    def open(self, stage: str) -> None:
        """Prepare the destination (worker thread). For ``fit`` it is called once the
        resume is known: see :attr:`resume_step`."""

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        """Record the run's configuration, or else the module's hyperparameters (worker
        thread, after :meth:`open`; only when there are some: see the class docstring).
        They are plain: dicts with string keys, lists, None, bool, int, float, str."""

    def write(self, records: Sequence[PutRecord]) -> None:
        """Write a batch of records, in the order they were put (worker thread)."""
        raise NotImplementedError(f"{type(self).__name__} must implement write(records).")

    def flush(self) -> None:
        """Push what :meth:`write` buffered to the operating system (worker thread)."""

    def close(self) -> None:
        """Flush and release the destination at the end of the stage (worker thread,
        or the calling thread when a stage is torn down before it could stop)."""

    def write_run_info(self, stage: str, resume_step: int | None) -> None:
        """Record which run the destination's records belong to, when it opens (worker
        thread). The loggers with a ``version_N`` folder write ``run.json`` there;
        others need nothing (a tracker has its own run)."""

    # ------------------------------------------------------------ machinery
    async def start(self, trainer: TrainerView, stage: str, task_group: TaskGroup) -> None:
        self._trainer = trainer
        self._stage = stage
        config = getattr(trainer, "run_config", None)  # the run's, else the module's
        self._hparams = config if config is not None else getattr(trainer.module, "hparams", _NO_HPARAMS)
        self._batch = []
        self._resume_step = self._resume_time = None
        self._error = None
        self._error_raised = False
        self._error_at_close = False
        self._in_flight = None
        self._due = -math.inf
        # One worker thread: writes (and open, close) run off the event loop, one at a
        # time and in the order they were handed over.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"loopbus-{type(self).__name__}")
        if stage != "fit":
            # fit opens at FitStarted, once it is known whether it resumes.
            await self._run(self._open, stage)
        self._timer = anyio.CancelScope()
        task_group.start_soon(self._write_when_due, self._timer)

    async def _run(self, func: Callable[..., Any], *args: Any) -> Any:
        """Run ``func`` in the writer thread after what was handed over before; wait."""
        assert self._executor is not None
        future = self._executor.submit(func, *args)
        await anyio.to_thread.run_sync(wait_futures, [future])
        return future.result()

    @on(FitStarted, mode="inline", priority=1000)
    async def fit_started(self, event: FitStarted) -> None:
        """Open the destination for ``fit``, continuing the history when it resumes."""
        trainer = self._trainer
        if trainer is None or self._executor is None or self._is_open:
            return
        plan = trainer.state.resume
        if plan is not None:
            self._resume_step, self._resume_time = plan.step, plan.created
        await self._run(self._open, "fit")

    def _open(self, stage: str) -> None:
        self.open(stage)
        self._is_open = True
        self.write_run_info(stage, self._resume_step)
        if self._hparams:
            self.write_hparams(self._hparams)

    @on(PutRecord)
    async def receive(self, record: PutRecord) -> None:
        """Add ``record`` to the batch; hand the batch to the writer thread when it is
        full or due."""
        batch = self._batch
        batch.append(record)
        if len(batch) >= self.batch_size or time.monotonic() >= self._due:
            await self._hand_over()

    async def _hand_over(self) -> None:
        if not self._is_open:
            return  # fit before FitStarted: kept until the destination is open
        in_flight = self._in_flight
        if in_flight is not None and not in_flight.done():
            if len(self._batch) < self.batch_size:
                return  # the writer is busy: the batch grows meanwhile
            # Full while the writer is busy: wait for it. The queue fills meanwhile, and
            # its overflow policy applies.
            await anyio.to_thread.run_sync(wait_futures, [in_flight])
        self._raise_if_failed()
        self._submit()

    def _submit(self) -> None:
        assert self._executor is not None
        batch, self._batch = self._batch, []
        self._in_flight = self._executor.submit(self._write_flushed, batch)
        self._due = time.monotonic() + self.flush_interval

    def _write_flushed(self, batch: list[PutRecord]) -> None:
        """The writer thread: write and flush one batch; keep a failure for the event
        loop to raise (at the next hand-over, or when the stage stops)."""
        if self._error is not None:
            return
        try:
            self.write(batch)
            self.flush()
        except Exception as exc:
            self._error = exc

    def _raise_if_failed(self) -> None:
        error = self._error
        if error is not None and not self._error_raised:
            self._error_raised = True
            message = _failure(type(self).__name__, error, self._error_at_close)
            raise RuntimeError(message) from error

    async def _write_when_due(self, scope: anyio.CancelScope) -> None:
        """Hand over a batch that no further record comes to hand over: checked every
        ``flush_interval`` seconds (every 10 ms at most). Ends when the stage stops."""
        period = max(self.flush_interval, 0.01)
        with scope:
            while True:
                await anyio.sleep(period)
                if scope.cancel_called:
                    # stop() ran between the sleep's end and this task's turn: it hands
                    # what is left to the writer itself, and the executor may be gone.
                    return
                in_flight = self._in_flight
                if (
                    self._batch
                    and self._is_open
                    and (in_flight is None or in_flight.done())
                    and self._error is None
                ):
                    self._submit()

    async def stop(self, trainer: TrainerView, stage: str) -> None:
        # The bus drained the queue: every record it accepted is in a batch or written.
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        executor, self._executor = self._executor, None
        if executor is None:
            return
        future = executor.submit(self._finish)
        executor.shutdown(wait=False)
        await anyio.to_thread.run_sync(wait_futures, [future])
        future.result()
        self._raise_if_failed()

    def teardown(self, trainer: TrainerView, stage: str) -> None:
        # After stop() this finds nothing left to do; if the stage ended before stop()
        # could run, the same path finishes here.
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self._finish()
        self._trainer = None
        self._stage = None

    def _finish(self) -> None:
        """The one shutdown path: write what is left, flush, close. Idempotent."""
        batch, self._batch = self._batch, []
        try:
            if batch and self._error is None:
                if not self._is_open and self._stage is not None:
                    self._open(self._stage)
                self._write_flushed(batch)
        except Exception as exc:
            self._error = exc
        finally:
            if self._is_open:
                self._is_open = False
                try:
                    self.close()
                except Exception as exc:  # raised by stop(), naming the logger
                    if self._error is None:
                        self._error, self._error_at_close = exc, True


def _failure(name: str, error: BaseException, at_close: bool) -> str:
    """Why a logger failed, for the error the run raises: the file and the cause when
    the file system said (a full disk), else the logger's own exception."""
    what = "finish writing" if at_close else "write"
    if isinstance(error, OSError) and error.filename is not None:
        text = f"{name} could not {what} {error.filename}: {error.strerror or error}"
    else:
        text = f"{name} could not {what}: {error}"
    if at_close:
        text += (
            " (when it closed its file at the end of the stage: the records it still held "
            "are missing; what it wrote before is intact)"
        )
    return text
