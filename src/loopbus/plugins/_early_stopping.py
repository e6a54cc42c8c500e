"""Early stopping on a monitored put record."""

from __future__ import annotations

import math
import warnings
from typing import TYPE_CHECKING, Any, Literal

from loopbus import (
    MisconfigurationError,
    Plugin,
    PutRecord,
    check_choice,
    check_int,
    check_number,
    on,
)
from loopbus.events import EpochCompleted, FitCompleted, ValidationCompleted

if TYPE_CHECKING:
    from loopbus import TrainerView

__all__ = ["EarlyStopping"]

_MODES = {"min": "lower is better", "max": "higher is better"}
_PATIENCE = "it counts checks in a row without improvement (0: stop at the first)"
_MIN_DELTA = "a change must exceed it to count as an improvement"


class EarlyStopping(Plugin):
    """Stop ``fit`` when the record ``monitor`` stops improving.

    Every record named ``monitor`` that reaches the ``"callbacks"`` destination is one
    check: it improves when it is lower (``mode="min"``) or higher (``mode="max"``) than
    the best so far by more than ``min_delta``; after ``patience`` checks in a row without
    improvement the plugin asks the trainer to stop, and ``fit`` ends at the next step
    boundary, or after the validation pass that put the record. The reason is in
    ``trainer.stop_reason``, in ``FitCompleted.reason`` and in the progress output.

    So put the monitored value once per check, typically the epoch's validation metric
    from torchmetrics::

        class Net(loopbus.Module):
            ...
            @loopbus.on(ValidationCompleted)
            def epoch_metrics(self, event):
                self.put("val/loss", self.val_loss.compute())
                self.val_loss.reset()

        trainer = Trainer(plugins=[ProgressBar(), EarlyStopping("val/loss", patience=5)])

    It also stops when the value is not finite (``check_finite``), reaches
    ``stopping_threshold`` or goes beyond ``divergence_threshold``. With ``strict`` (the
    default) a fit in which the record is never put raises instead of training on: at the
    end of the first epoch with a validation pass, or at the end of ``fit``.

    The counters (checks without improvement, best value and its step) are its state and
    survive a checkpoint round trip, so a resumed run stops where it would have.
    """

    def __init__(
        self,
        monitor: str,
        *,
        mode: Literal["min", "max"] = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        check_finite: bool = True,
        stopping_threshold: float | None = None,
        divergence_threshold: float | None = None,
        strict: bool = True,
    ) -> None:
        if not isinstance(monitor, str) or not monitor:
            raise MisconfigurationError(
                f"EarlyStopping(monitor=...) must be the name of a put record such as "
                f"'val/loss', got {monitor!r}."
            )
        check_choice("mode", mode, _MODES, owner="EarlyStopping")
        self.monitor = monitor
        #: ``"min"`` or ``"max"``: whether lower or higher values are better.
        self.mode: Literal["min", "max"] = mode
        self.patience = check_int(
            "patience", patience, minimum=0, owner="EarlyStopping", hint=_PATIENCE
        )
        self.min_delta = check_number(
            "min_delta", min_delta, minimum=0, owner="EarlyStopping", hint=_MIN_DELTA
        )
        self.check_finite = check_finite
        self.stopping_threshold = stopping_threshold
        self.divergence_threshold = divergence_threshold
        self.strict = strict
        #: Checks in a row without improvement.
        self.wait_count = 0
        #: The best value so far (inf or -inf before the first check).
        self.best_score = math.inf if mode == "min" else -math.inf
        #: The step of the best value (-1 before the first check).
        self.best_step = -1
        #: The step at which this plugin stopped the run (-1 if it has not).
        self.stopped_step = -1
        #: Records of ``monitor`` checked so far.
        self.checks = 0
        self._trainer: TrainerView | None = None
        self._fitting = False
        self._validated = False

    def __repr__(self) -> str:
        return (
            f"EarlyStopping({self.monitor!r}, mode={self.mode!r}, patience={self.patience}, "
            f"min_delta={self.min_delta})"
        )

    @property
    def state_key(self) -> str:
        """Includes the monitor and mode, so several early stoppings can be checkpointed."""
        return f"EarlyStopping{{'monitor': {self.monitor!r}, 'mode': {self.mode!r}}}"

    def setup(self, trainer: TrainerView, stage: str) -> None:
        self._trainer = trainer
        self._fitting = stage == "fit"
        self._validated = False

    def teardown(self, trainer: TrainerView, stage: str) -> None:
        self._trainer = None
        self._fitting = False

    def _improves(self, value: float, reference: float) -> bool:
        if self.mode == "min":
            return value < reference - self.min_delta
        return value > reference + self.min_delta

    @on(PutRecord)
    def check(self, record: PutRecord) -> None:
        """Count ``record`` as a check if it is the monitored one (during ``fit``)."""
        if record.name != self.monitor or not self._fitting:
            return
        value = float(record.value)
        self.checks += 1
        reason = None
        better = "below" if self.mode == "min" else "above"
        worse = "above" if self.mode == "min" else "below"
        if self.check_finite and not math.isfinite(value):
            reason = f"{self.monitor} = {value} is not finite"
        elif self.stopping_threshold is not None and (
            value <= self.stopping_threshold
            if self.mode == "min"
            else value >= self.stopping_threshold
        ):
            reason = (
                f"{self.monitor} = {value:.6g} reached the stopping threshold "
                f"({better} or at {self.stopping_threshold})"
            )
        elif self.divergence_threshold is not None and (
            value > self.divergence_threshold
            if self.mode == "min"
            else value < self.divergence_threshold
        ):
            reason = (
                f"{self.monitor} = {value:.6g} diverged ({worse} the divergence threshold "
                f"{self.divergence_threshold})"
            )
        if self._improves(value, self.best_score):
            self.best_score = value
            self.best_step = record.step
            self.wait_count = 0
        else:
            self.wait_count += 1
            if reason is None and self.wait_count >= self.patience:
                reason = (
                    f"{self.monitor} did not improve by more than {self.min_delta:g} for "
                    f"{self.wait_count} checks in a row (best {self.best_score:.6g} at step "
                    f"{self.best_step})"
                )
        if reason is not None and self._trainer is not None:
            self.stopped_step = record.step
            self._trainer.request_stop(f"EarlyStopping: {reason}")

    @on(ValidationCompleted)
    def _validation_completed(self, event: ValidationCompleted) -> None:
        self._validated = True

    @on(EpochCompleted)
    def _epoch_completed(self, event: EpochCompleted) -> None:
        if self._validated:
            self._require_seen(f"by the end of epoch {event.epoch} (which ran validation)")

    @on(FitCompleted)
    def _fit_completed(self, event: FitCompleted) -> None:
        self._require_seen("during fit")

    def _require_seen(self, when: str) -> None:
        if not self.strict or self.checks or not self._fitting:
            return
        names = sorted(self._trainer.latest) if self._trainer is not None else []
        raise MisconfigurationError(
            f"EarlyStopping monitors {self.monitor!r}, but no record of that name reached the "
            f"'callbacks' destination {when}. Records put so far: {names}. Put it (with "
            "destinations including 'callbacks'), fix the name, or pass strict=False."
        )

    @property
    def monitor_mode(self) -> Literal["min", "max"]:
        """Deprecated: :attr:`mode`."""
        warnings.warn(
            "EarlyStopping.monitor_mode is deprecated; read earlystopping.mode.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.mode

    def state_dict(self) -> dict[str, Any]:
        return {
            "monitor": self.monitor,
            "mode": self.mode,
            "wait_count": self.wait_count,
            "best_score": self.best_score,
            "best_step": self.best_step,
            "stopped_step": self.stopped_step,
            "checks": self.checks,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = (state_dict.get("monitor"), state_dict.get("mode"))
        if saved != (self.monitor, self.mode):
            raise ValueError(
                f"this EarlyStopping state was saved for monitor={saved[0]!r}, mode={saved[1]!r}, "
                f"but this plugin monitors {self.monitor!r} in mode {self.mode!r}; give the "
                "restored plugin the same monitor and mode, or start its state afresh."
            )
        self.wait_count = int(state_dict["wait_count"])
        self.best_score = float(state_dict["best_score"])
        self.best_step = int(state_dict["best_step"])
        self.stopped_step = int(state_dict["stopped_step"])
        self.checks = int(state_dict["checks"])
