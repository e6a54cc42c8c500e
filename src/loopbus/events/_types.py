"""The event and record types: frozen, keyword-only msgspec Structs.

The hierarchy lets a subscriber choose how wide to listen: ``AdvanceCompleted`` hears the
end of every iteration of every loop, ``TrainBatchCompleted`` only the training batches.

Fields named ``ctx`` carry the scope the hook ran with. A scope is only valid while the
event is being delivered inline; a queued subscriber sees it already dropped (empty).
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

__all__ = [
    "AdvanceCompleted",
    "AdvanceStarted",
    "AfterBackward",
    "BeforeOptimizerStep",
    "CustomEvent",
    "EpochCompleted",
    "EpochStarted",
    "Event",
    "ExceptionRaised",
    "FitCompleted",
    "FitStarted",
    "LoopEvent",
    "PredictBatchCompleted",
    "PredictBatchStarted",
    "PredictCompleted",
    "PredictStarted",
    "PreemptionRequested",
    "PutRecord",
    "ReplicaHealed",
    "ReplicaLost",
    "RunCompleted",
    "RunSkipped",
    "RunStarted",
    "StepAborted",
    "Teardown",
    "TestBatchCompleted",
    "TestBatchStarted",
    "TestCompleted",
    "TestStarted",
    "TrainBatchCompleted",
    "TrainBatchStarted",
    "TrainEpochCompleted",
    "TrainEpochStarted",
    "ValidationBatchCompleted",
    "ValidationBatchStarted",
    "ValidationCompleted",
    "ValidationStarted",
]


class Event(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every event. Subclass it for custom events; no registration needed.

    ``inside_step = True`` on a class marks an event published from inside the
    (synchronous) training step: its inline handlers must be plain ``def`` functions.
    """

    inside_step: ClassVar[bool] = False


class CustomEvent(Event, frozen=True, kw_only=True):
    """A base for custom events that carry the run's position.

    ``step`` (optimizer steps completed) and ``epoch`` (0-based) are filled in by
    ``trainer.publish`` with the trainer's ``global_step`` and ``current_epoch`` at the
    moment of the call, when left at -1 (the default); set them to publish another
    position. Subclass it as you would :class:`Event`::

        class Spike(CustomEvent, frozen=True, kw_only=True):
            loss: float

        self.trainer.publish(Spike(loss=loss.item()))  # step and epoch filled in
    """

    step: int = -1
    epoch: int = -1


# ---------------------------------------------------------------- generic loop events


class LoopEvent(Event, frozen=True, kw_only=True):
    """An event published by a :class:`~loopbus.Loop` hook.

    ``loop`` is the loop's name, ``iteration`` the loop's count of completed iterations
    when the event was built (the index of the current iteration in advance events).
    ``step`` (optimizer steps completed) and ``epoch`` (0-based) come from the trainer the
    loop is attached to; they are 0 for a loop running on its own.
    """

    loop: str
    iteration: int = 0
    step: int = 0
    epoch: int = 0
    ctx: Any = None


class RunStarted(LoopEvent, frozen=True, kw_only=True):
    """After ``on_run_start``."""


class AdvanceStarted(LoopEvent, frozen=True, kw_only=True):
    """After ``on_advance_start``."""


class AdvanceCompleted(LoopEvent, frozen=True, kw_only=True):
    """After ``on_advance_end`` (the iteration's progress already counts as completed)."""


class RunCompleted(LoopEvent, frozen=True, kw_only=True):
    """After ``on_run_end``; ``output`` is what ``run`` returns."""

    output: Any = None


class RunSkipped(LoopEvent, frozen=True, kw_only=True):
    """After ``on_skip``, when ``skip`` was true and the run did not start."""

    output: Any = None


# ---------------------------------------------------------------- trainer events


class FitStarted(RunStarted, frozen=True, kw_only=True):
    """``fit`` began: module attached, optimizers configured, plugins subscribed."""


class FitCompleted(RunCompleted, frozen=True, kw_only=True):
    """``fit`` ran to its end; ``stopped`` says whether a stop request ended it early."""

    stopped: bool = False
    reason: str | None = None


class EpochStarted(AdvanceStarted, frozen=True, kw_only=True):
    """An epoch of ``fit`` begins (before its training pass)."""


class EpochCompleted(AdvanceCompleted, frozen=True, kw_only=True):
    """An epoch of ``fit`` ended (training pass, validation and epoch schedulers done)."""


class TrainEpochStarted(RunStarted, frozen=True, kw_only=True):
    """The training pass over the data of one epoch begins."""


class TrainEpochCompleted(RunCompleted, frozen=True, kw_only=True):
    """The training pass over the data of one epoch ended."""


class TrainBatchStarted(AdvanceStarted, frozen=True, kw_only=True):
    """A training batch was fetched; its step is about to run. ``ctx.batch`` is set."""

    batch_idx: int = 0


class TrainBatchCompleted(AdvanceCompleted, frozen=True, kw_only=True):
    """A training batch was processed (and validation, if due after it, has run).
    ``ctx.output`` holds what ``training_step`` returned."""

    batch_idx: int = 0


class AfterBackward(LoopEvent, frozen=True, kw_only=True):
    """Gradients of this batch were accumulated. Published inside the step."""

    inside_step: ClassVar[bool] = True
    batch_idx: int = 0


class BeforeOptimizerStep(LoopEvent, frozen=True, kw_only=True):
    """Gradients are final (unscaled, clipped); ``optimizer.step()`` comes next.
    Published inside the step."""

    inside_step: ClassVar[bool] = True
    batch_idx: int = 0
    optimizer: Any = None


class StepAborted(LoopEvent, frozen=True, kw_only=True):
    """A fault-tolerant step did not commit (a replica group was lost during it, or too
    few took part): its optimizer step, scheduler step, counters and records are
    dropped, and its samples are planned again by the next quorum. ``dropped_records``
    is the number of records it had put; ``participants`` the replica groups it ran
    with. Published inside the step."""

    inside_step: ClassVar[bool] = True
    batch_idx: int = 0
    participants: int = 0
    dropped_records: int = 0


class ReplicaLost(LoopEvent, frozen=True, kw_only=True):
    """Fewer replica groups than in the last quorum take part in the step: ``lost`` of
    them left, ``participants`` remain. Published inside the step."""

    inside_step: ClassVar[bool] = True
    batch_idx: int = 0
    lost: int = 0
    participants: int = 0


class ReplicaHealed(LoopEvent, frozen=True, kw_only=True):
    """This replica group caught up from a live peer: it loaded the peer's state of
    ``healed_step`` committed steps (its weights, optimizer and scheduler state, run
    counters and sample cursor) from ``sources`` (replica group ids). Published inside
    the step."""

    inside_step: ClassVar[bool] = True
    batch_idx: int = 0
    healed_step: int = 0
    sources: tuple[str, ...] = ()


class ValidationStarted(RunStarted, frozen=True, kw_only=True):
    """A validation run begins (from ``fit`` or ``validate``)."""


class ValidationBatchStarted(AdvanceStarted, frozen=True, kw_only=True):
    batch_idx: int = 0


class ValidationBatchCompleted(AdvanceCompleted, frozen=True, kw_only=True):
    batch_idx: int = 0


class ValidationCompleted(RunCompleted, frozen=True, kw_only=True):
    """A validation run ended; put your epoch-level metric ``compute()`` here."""


class TestStarted(RunStarted, frozen=True, kw_only=True):
    __test__ = False


class TestBatchStarted(AdvanceStarted, frozen=True, kw_only=True):
    __test__ = False
    batch_idx: int = 0


class TestBatchCompleted(AdvanceCompleted, frozen=True, kw_only=True):
    __test__ = False
    batch_idx: int = 0


class TestCompleted(RunCompleted, frozen=True, kw_only=True):
    __test__ = False


class PredictStarted(RunStarted, frozen=True, kw_only=True):
    pass


class PredictBatchStarted(AdvanceStarted, frozen=True, kw_only=True):
    batch_idx: int = 0


class PredictBatchCompleted(AdvanceCompleted, frozen=True, kw_only=True):
    batch_idx: int = 0


class PredictCompleted(RunCompleted, frozen=True, kw_only=True):
    pass


class ExceptionRaised(Event, frozen=True, kw_only=True):
    """A stage (``fit``, ``validate``, ...) is ending because of an exception."""

    stage: str
    error: Any = None


class PreemptionRequested(Event, frozen=True, kw_only=True):
    """The process was asked to go away (SIGTERM, or SLURM's early SIGUSR1) while a stage
    ran, and the stage stops here: published once, on every rank, at the step boundary
    where the stop took effect (the same on every rank), after that batch's events and
    before the epoch's closing ones (or between epochs, when the signal came during the
    epoch's end). The run's position is still the one a checkpoint resumes from exactly:
    the ``Checkpoint`` plugin saves here; a tracker can flush, or mark its run as
    interrupted rather than finished.

    ``signal`` is the signal's name (``"SIGTERM"``), ``signum`` its number, ``rank`` the
    rank that received it first, ``deadline`` the wall-clock time (``time.time()``) at
    which the process ends regardless (``Trainer(preemption_grace_s=...)``; None: no
    deadline of loopbus's own, the platform's SIGKILL is the limit), ``step`` and
    ``epoch`` the run's position.
    """

    stage: str
    signal: str
    signum: int
    rank: int = 0
    deadline: float | None = None
    step: int = 0
    epoch: int = 0


class Teardown(Event, frozen=True, kw_only=True):
    """The last event of every stage, however it ended.

    ``reason`` is ``"completed"``, ``"stopped"`` (a stop request), ``"cancelled"`` (the
    awaiting task was cancelled) or ``"failed"`` (an exception).
    """

    stage: str
    reason: str
    step: int = 0
    epoch: int = 0


# ---------------------------------------------------------------- records


class PutRecord(Event, frozen=True, kw_only=True, tag=True):
    """One ``put(name, value)`` call, as delivered to its destinations.

    ``value`` is a Python number (a tensor is converted off the step's critical path);
    ``step`` is the number of optimizer steps completed when it was published, ``epoch``
    the current epoch, ``time`` the wall-clock time (``time.time()``) of publication,
    ``source`` who called ``put`` and ``destinations`` where it is routed.
    """

    name: str
    value: float | int | bool
    step: int = 0
    epoch: int = 0
    time: float = 0.0
    source: str = ""
    destinations: tuple[str, ...] = ()
