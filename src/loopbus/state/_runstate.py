"""The run's state: one object, one writer.

The trainer owns a :class:`RunState`. Everyone reads it through read-only properties
(``trainer.global_step`` and friends are views of it); the trainer and its loops move
it forward through the methods below, never by assigning its fields. Loading a
checkpoint does not write into loops or the trainer either: it yields a
:class:`ResumePlan`, a value the state holds until the loops take what they need.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Any

__all__ = ["ResumePlan", "RunState"]


@dataclass(frozen=True)
class ResumePlan:
    """What a resumed run must restore where it picks up, as loaded from a checkpoint.

    * ``step`` / ``epoch``: the position the checkpoint was taken at.
    * ``rng``: the global generators' states, applied again exactly where training
      resumes, so that what runs in between (``FitStarted`` handlers) cannot shift them.
    * ``loader_restored``: the training loader is stateful and was repositioned from
      the checkpoint, so the resumed epoch iterates it as it is instead of skipping
      the batches the epoch already consumed.
    * ``sampler_positioned``: the training loader's distributed sampler was set to skip
      the samples the epoch already consumed (its position is kept as a sample count,
      valid at any world size), so the resumed epoch skips no batches either.
    * ``source``: where the checkpoint came from, for messages.
    * ``created``: when the checkpoint was taken (``time.time()``), if it says; what a
      run published later at ``step`` is not part of the resumed history.
    """

    step: int
    epoch: int
    rng: dict[str, Any] | None = None
    loader_restored: bool = False
    sampler_positioned: bool = False
    source: str = ""
    created: float | None = None


class RunState:
    """Step, epoch, stage, stop request and resume plan of a trainer's runs.

    Read-only for users and plugins (use :meth:`Trainer.request_stop` to stop a run);
    the trainer and its loops advance it through its methods. Its stop fields record
    what the run's stop control (``loopbus.distributed._stopping.StopControl``, the
    only caller of the stopping methods below) decided. Stateful: its
    ``state_dict`` (step and epoch) is part of every checkpoint.
    """

    __slots__ = (
        "_collective",
        "_epoch",
        "_pending_stop",
        "_resume",
        "_sanity_checking",
        "_stage",
        "_step",
        "_stop_reason",
        "_stop_requested",
    )

    # Getters in C (attrgetter), so reading the state costs no Python call on the hot path.
    step: int = property(attrgetter("_step"), doc="Optimizer steps completed.")  # type: ignore[assignment]
    epoch: int = property(attrgetter("_epoch"), doc="The current (or last) epoch, 0-based.")  # type: ignore[assignment]
    stage: str | None = property(  # type: ignore[assignment]
        attrgetter("_stage"), doc='The running stage ("fit", "validate", ...), or None.'
    )
    stop_requested: bool = property(  # type: ignore[assignment]
        attrgetter("_stop_requested"),
        doc="Whether the running stage was asked to stop at the next step boundary.",
    )
    stop_reason: str | None = property(  # type: ignore[assignment]
        attrgetter("_stop_reason"), doc="Why the stage was asked to stop, if it was."
    )
    sanity_checking: bool = property(  # type: ignore[assignment]
        attrgetter("_sanity_checking"),
        doc="Whether fit is running its sanity check (``num_sanity_val_steps``).",
    )
    resume: ResumePlan | None = property(  # type: ignore[assignment]
        attrgetter("_resume"), doc="The resume plan not yet consumed by the loops, if any."
    )

    def __init__(self) -> None:
        self._step = 0
        self._epoch = 0
        self._stage: str | None = None
        self._stop_requested = False
        self._stop_reason: str | None = None
        self._resume: ResumePlan | None = None
        # Under DDP a stop request waits here until the ranks agree (see confirm_stop).
        self._collective = False
        self._pending_stop: str | None = None
        self._sanity_checking = False

    def __repr__(self) -> str:
        return (
            f"RunState(stage={self._stage!r}, step={self._step}, epoch={self._epoch}, "
            f"stop_requested={self._stop_requested}, resume={self._resume is not None})"
        )

    # ------------------------------------------------------------ stages
    def begin_stage(self, stage: str) -> None:
        """Mark ``stage`` as running; refuse (changing nothing) if one already runs."""
        if self._stage is not None:
            raise RuntimeError(
                f"this Trainer is already running {self._stage!r}; a Trainer runs one stage "
                "at a time. To train concurrently, create one Trainer per run."
            )
        self._stage = stage
        # Every stage starts without a stop request (a stopped fit must not mark a later
        # validate as "stopped") and without a plan left over from an earlier stage.
        self._stop_requested = False
        self._stop_reason = None
        self._resume = None
        self._pending_stop = None

    def end_stage(self) -> None:
        self._stage = None
        self._sanity_checking = False
        self._resume = None
        self._collective = False
        self._pending_stop = None

    def begin_sanity_check(self) -> None:
        """``fit``'s sanity check (a few validation batches before training) starts."""
        self._sanity_checking = True

    def end_sanity_check(self) -> None:
        self._sanity_checking = False

    # ------------------------------------------------------------ progress
    def step_completed(self) -> None:
        """One optimizer step (or manual-optimization step) is done."""
        self._step += 1

    def epoch_started(self, epoch: int) -> None:
        self._epoch = epoch

    # ------------------------------------------------------------ stopping
    def request_stop(self, reason: str | None = None) -> None:
        """Record a request to stop the running stage at the next step boundary. Safe
        from any task or thread. In a collective stage (DDP, FSDP) the request is pending
        until the stop control has the ranks agree (see :meth:`confirm_stop`)."""
        reason = reason if reason is not None else "stop requested"
        if self._collective:
            if self._pending_stop is None:
                self._pending_stop = reason
            return
        self._stop_reason = reason
        self._stop_requested = True

    def make_stop_collective(self) -> None:
        """For the running stage, hold stop requests as pending until
        :meth:`confirm_stop` (every rank must stop at the same step boundary)."""
        self._collective = True

    @property
    def pending_stop(self) -> str | None:
        """The reason of a stop requested in this process but not yet agreed on."""
        return self._pending_stop

    def confirm_stop(self, reason: str) -> None:
        """The ranks agreed to stop (one of them asked): stop at this boundary."""
        if self._stop_requested:
            return
        self._stop_reason = reason
        self._stop_requested = True
        self._pending_stop = None

    # ------------------------------------------------------------ resuming
    def plan_resume(self, plan: ResumePlan) -> None:
        """Take the position of a loaded checkpoint and hold its plan for the loops."""
        self._step = plan.step
        self._epoch = plan.epoch
        self._resume = plan

    def take_resume_rng(self) -> dict[str, Any] | None:
        """The plan's generator states, once: the first loop to resume applies them."""
        plan = self._resume
        if plan is None or plan.rng is None:
            return None
        self._resume = replace(plan, rng=None)
        return plan.rng

    def finish_resume(self) -> None:
        """The loops have resumed: the plan is spent."""
        self._resume = None

    # ------------------------------------------------------------ Stateful
    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step, "epoch": self._epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        step, epoch = state["step"], state["epoch"]
        for name, value in (("step", step), ("epoch", epoch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"run state {name!r} must be an int >= 0, got {value!r}")
        self._step = step
        self._epoch = epoch
