"""The run's state: one object, one writer.

The trainer owns a :class:`RunState`. Everyone reads it through read-only properties
(``trainer.global_step`` and friends are views of it); the trainer and its loops move
it forward through the methods below, never by assigning its fields. Loading a
checkpoint does not write into loops or the trainer either: it yields a
:class:`ResumePlan`, a value the state holds until the loops take what they need.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

__all__ = ["ResumePlan", "RunState"]

_assign = object.__setattr__  # how RunState writes its own fields


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

    # The fields are slots readers reach without a Python call (a plain attribute read,
    # the cheapest on the hot path); writing one from outside raises (``__setattr__``).
    # The methods below write them with ``_assign`` (and the step with ``_set_step``).
    __slots__ = {
        "_collective": "Under DDP a stop request waits until the ranks agree (confirm_stop).",
        "_pending_stop": "A stop requested in this process, not yet agreed on.",
        "epoch": "The current (or last) epoch, 0-based.",
        "resume": "The resume plan not yet consumed by the loops, if any.",
        "sanity_checking": "Whether fit is running its sanity check (``num_sanity_val_steps``).",
        "stage": 'The running stage ("fit", "validate", ...), or None.',
        "step": "Optimizer steps completed.",
        "stop_reason": "Why the stage was asked to stop, if it was.",
        "stop_requested": "Whether the running stage was asked to stop at the next step boundary.",
    }
    step: int
    epoch: int
    stage: str | None
    stop_requested: bool
    stop_reason: str | None
    sanity_checking: bool
    resume: ResumePlan | None
    _collective: bool
    _pending_stop: str | None

    def __init__(self) -> None:
        _assign(self, "step", 0)
        _assign(self, "epoch", 0)
        _assign(self, "stage", None)
        _assign(self, "stop_requested", False)
        _assign(self, "stop_reason", None)
        _assign(self, "resume", None)
        _assign(self, "_collective", False)
        _assign(self, "_pending_stop", None)
        _assign(self, "sanity_checking", False)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(
            f"RunState.{name} is read-only: the trainer and its loops move the run state "
            "through its methods; to stop a run, call Trainer.request_stop()."
        )

    def __repr__(self) -> str:
        return (
            f"RunState(stage={self.stage!r}, step={self.step}, epoch={self.epoch}, "
            f"stop_requested={self.stop_requested}, resume={self.resume is not None})"
        )

    # ------------------------------------------------------------ stages
    def begin_stage(self, stage: str) -> None:
        """Mark ``stage`` as running; refuse (changing nothing) if one already runs."""
        if self.stage is not None:
            raise RuntimeError(
                f"this Trainer is already running {self.stage!r}; a Trainer runs one stage "
                "at a time. To train concurrently, create one Trainer per run."
            )
        _assign(self, "stage", stage)
        # Every stage starts without a stop request (a stopped fit must not mark a later
        # validate as "stopped") and without a plan left over from an earlier stage.
        _assign(self, "stop_requested", False)
        _assign(self, "stop_reason", None)
        _assign(self, "resume", None)
        _assign(self, "_pending_stop", None)

    def end_stage(self) -> None:
        _assign(self, "stage", None)
        _assign(self, "sanity_checking", False)
        _assign(self, "resume", None)
        _assign(self, "_collective", False)
        _assign(self, "_pending_stop", None)

    def begin_sanity_check(self) -> None:
        """``fit``'s sanity check (a few validation batches before training) starts."""
        _assign(self, "sanity_checking", True)

    def end_sanity_check(self) -> None:
        _assign(self, "sanity_checking", False)

    # ------------------------------------------------------------ progress
    def step_completed(self) -> None:
        """One optimizer step (or manual-optimization step) is done."""
        _set_step(self, self.step + 1)

    def epoch_started(self, epoch: int) -> None:
        _assign(self, "epoch", epoch)

    # ------------------------------------------------------------ stopping
    def request_stop(self, reason: str | None = None) -> None:
        """Record a request to stop the running stage at the next step boundary. Safe
        from any task or thread. In a collective stage (DDP, FSDP) the request is pending
        until the stop control has the ranks agree (see :meth:`confirm_stop`)."""
        reason = reason if reason is not None else "stop requested"
        if self._collective:
            if self._pending_stop is None:
                _assign(self, "_pending_stop", reason)
            return
        _assign(self, "stop_reason", reason)
        _assign(self, "stop_requested", True)

    def make_stop_collective(self) -> None:
        """For the running stage, hold stop requests as pending until
        :meth:`confirm_stop` (every rank must stop at the same step boundary)."""
        _assign(self, "_collective", True)

    @property
    def pending_stop(self) -> str | None:
        """The reason of a stop requested in this process but not yet agreed on."""
        return self._pending_stop

    def confirm_stop(self, reason: str) -> None:
        """The ranks agreed to stop (one of them asked): stop at this boundary."""
        if self.stop_requested:
            return
        _assign(self, "stop_reason", reason)
        _assign(self, "stop_requested", True)
        _assign(self, "_pending_stop", None)

    # ------------------------------------------------------------ resuming
    def plan_resume(self, plan: ResumePlan) -> None:
        """Take the position of a loaded checkpoint and hold its plan for the loops."""
        _assign(self, "step", plan.step)
        _assign(self, "epoch", plan.epoch)
        _assign(self, "resume", plan)

    def take_resume_rng(self) -> dict[str, Any] | None:
        """The plan's generator states, once: the first loop to resume applies them."""
        plan = self.resume
        if plan is None or plan.rng is None:
            return None
        _assign(self, "resume", replace(plan, rng=None))
        return plan.rng

    def finish_resume(self) -> None:
        """The loops have resumed: the plan is spent."""
        _assign(self, "resume", None)

    # ------------------------------------------------------------ Stateful
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        step, epoch = state["step"], state["epoch"]
        for name, value in (("step", step), ("epoch", epoch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"run state {name!r} must be an int >= 0, got {value!r}")
        _assign(self, "step", step)
        _assign(self, "epoch", epoch)


# The step's own setter: a slot write without the name lookup of ``_assign`` (per step).
_set_step = RunState.__dict__["step"].__set__
