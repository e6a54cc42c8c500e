"""Timer: measure the time of each stage and stop ``fit`` after a wall-clock budget."""

from __future__ import annotations

import math
import re
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal

import anyio

from loopbus import MisconfigurationError, Plugin, check_choice, on
from loopbus.events import EpochCompleted

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from loopbus import TrainerView

__all__ = ["Timer"]

_STAGES = ("fit", "validate", "test", "predict")
_INTERVALS = {"step": "stop at the next step boundary", "epoch": "stop at the end of the epoch"}
_DDHHMMSS = re.compile(r"^(\d+):(\d{1,2}):(\d{1,2}):(\d{1,2})$")


def _parse_duration(duration: Any) -> float | None:
    if duration is None:
        return None
    seconds: float
    if isinstance(duration, timedelta):
        seconds = duration.total_seconds()
    elif isinstance(duration, dict):
        try:
            seconds = timedelta(**duration).total_seconds()
        except TypeError as exc:
            raise MisconfigurationError(
                f"Timer(duration={duration!r}): a dict takes timedelta's keys (days, hours, "
                f"minutes, seconds, ...): {exc}."
            ) from None
    elif isinstance(duration, str):
        match = _DDHHMMSS.match(duration.strip())
        if match is None:
            raise MisconfigurationError(
                f"Timer(duration={duration!r}): a string must be 'DD:HH:MM:SS', for example "
                "'00:12:00:00' for twelve hours."
            )
        days, hours, minutes, secs = (int(g) for g in match.groups())
        seconds = timedelta(days=days, hours=hours, minutes=minutes, seconds=secs).total_seconds()
    elif isinstance(duration, (int, float)) and not isinstance(duration, bool):
        seconds = float(duration)
    else:
        raise MisconfigurationError(
            f"Timer(duration={duration!r}) must be seconds, a timedelta, a dict such as "
            "{'hours': 12}, or 'DD:HH:MM:SS'."
        )
    if not seconds > 0 or not math.isfinite(seconds):
        raise MisconfigurationError(
            f"Timer(duration={duration!r}) must be a positive, finite duration."
        )
    return seconds


class Timer(Plugin):
    """Measures each stage's wall-clock time and stops ``fit`` when ``duration`` has run
    out, like Lightning's ``max_time``.

    ``duration`` is seconds, a ``timedelta``, a dict of its keys (``{"hours": 12}``) or
    ``"DD:HH:MM:SS"``; None only measures. With ``interval="step"`` the run stops at the
    step boundary after the budget ran out (a task of its own sleeps until then, so it
    costs nothing per step); with ``"epoch"`` at the end of that epoch::

        trainer = Trainer(plugins=[ProgressBar(), Timer(duration={"hours": 12})])

    It is resume-aware: the time already spent is its state, so a resumed run gets the
    rest of the budget, not a fresh one.
    """

    def __init__(
        self,
        duration: float | timedelta | dict[str, float] | str | None = None,
        *,
        interval: Literal["step", "epoch"] = "step",
    ) -> None:
        check_choice("interval", interval, _INTERVALS, owner="Timer")
        self.duration = _parse_duration(duration)
        self.interval = interval
        self._elapsed: dict[str, float] = dict.fromkeys(_STAGES, 0.0)
        self._started: dict[str, float] = {}
        self._alarm: anyio.CancelScope | None = None
        self._changed: anyio.Event | None = None
        self._trainer: TrainerView | None = None

    def __repr__(self) -> str:
        return f"Timer(duration={self.duration!r}, interval={self.interval!r})"

    # ------------------------------------------------------------ readings
    def time_elapsed(self, stage: str = "fit") -> float:
        """Seconds spent in ``stage``, over all runs (including resumed ones)."""
        start = self._started.get(stage)
        running = time.monotonic() - start if start is not None else 0.0
        return self._elapsed.get(stage, 0.0) + running

    def time_remaining(self, stage: str = "fit") -> float | None:
        """Seconds left of the budget (never negative), or None without a duration."""
        if self.duration is None:
            return None
        return max(0.0, self.duration - self.time_elapsed(stage))

    @property
    def expired(self) -> bool:
        """Whether ``fit`` has used up the budget."""
        remaining = self.time_remaining("fit")
        return remaining is not None and remaining <= 0

    def _reason(self) -> str:
        assert self.duration is not None
        return (
            f"Timer: the time budget of {timedelta(seconds=round(self.duration))} ran out "
            f"({timedelta(seconds=round(self.time_elapsed('fit')))} spent in fit)"
        )

    # ------------------------------------------------------------ stage
    def setup(self, trainer: TrainerView, stage: str) -> None:
        self._trainer = trainer
        self._started[stage] = time.monotonic()
        self._elapsed.setdefault(stage, 0.0)

    async def start(self, trainer: TrainerView, stage: str, task_group: TaskGroup) -> None:
        if stage != "fit" or self.duration is None:
            return
        if self.expired:
            trainer.request_stop(self._reason())
            return
        if self.interval == "step":
            scope = self._alarm = anyio.CancelScope()
            task_group.start_soon(self._sleep_then_stop, scope, trainer, name="Timer alarm")

    async def _sleep_then_stop(self, scope: anyio.CancelScope, trainer: TrainerView) -> None:
        with scope:
            while True:
                remaining = self.time_remaining("fit")
                if remaining is None or remaining <= 0:
                    break
                # load_state_dict() (a resume) sets the event: sleep again from there.
                self._changed = anyio.Event()
                with anyio.move_on_after(remaining):
                    await self._changed.wait()
            trainer.request_stop(self._reason())

    @on(EpochCompleted)
    def _epoch_completed(self, event: EpochCompleted) -> None:
        if self.interval == "epoch" and self._trainer is not None and self.expired:
            self._trainer.request_stop(self._reason())

    async def stop(self, trainer: TrainerView, stage: str) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
            self._alarm = None
        self._changed = None

    def teardown(self, trainer: TrainerView, stage: str) -> None:
        if self._alarm is not None:
            self._alarm.cancel()
            self._alarm = None
        self._changed = None
        start = self._started.pop(stage, None)
        if start is not None:
            self._elapsed[stage] = self._elapsed.get(stage, 0.0) + time.monotonic() - start
        self._trainer = None

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {"time_elapsed": {stage: self.time_elapsed(stage) for stage in self._elapsed}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        elapsed = state_dict["time_elapsed"]
        for stage, seconds in elapsed.items():
            self._elapsed[str(stage)] = float(seconds)
            if stage in self._started:  # loaded while the stage runs: count from now
                self._started[stage] = time.monotonic()
        # Loaded while fit runs (fit(ckpt_path=...) resumes after plugins started).
        if "fit" in self._started and self._trainer is not None and self.duration is not None:
            if self.expired:
                self._trainer.request_stop(self._reason())
            elif self._changed is not None:
                self._changed.set()
