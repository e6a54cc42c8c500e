"""What the experiment-tracker loggers (MLflow, W&B) share: the run's parameters and how a
record's value reaches a tracker that stores numbers."""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from loopbus import TrainerView

__all__ = ["as_number", "flatten", "run_params"]

# Trainer options worth seeing next to a run's metrics (attribute names of Trainer).
_TRAINER_OPTIONS = (
    "max_epochs",
    "max_steps",
    "accumulate_grad_batches",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "val_check_interval",
    "check_val_every_n_epoch",
    "limit_train_batches",
    "limit_val_batches",
    "executor",
    "prefetch",
)


class TrackedRun:
    """What the tracker loggers share about their run: its id, kept in every checkpoint
    so that a resumed ``fit`` continues the same run. The logger sets ``_run_id``,
    ``_fixed_run`` (an id given by the user wins over a checkpoint's) and ``_lock`` (one
    tracker call at a time), and says how to leave a run opened before the resume."""

    _run_id: str | None
    _fixed_run: bool
    _lock: threading.Lock

    @property
    def run_id(self) -> str | None:
        """The tracker's run id: None until the first stage opens the run (unless one
        was given)."""
        return self._run_id

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self._run_id}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        run_id = state_dict.get("run_id")
        if self._fixed_run or not isinstance(run_id, str) or run_id == self._run_id:
            return
        with self._lock:
            self._leave_run()  # opened before the resume: leave it as it was
            self._run_id = run_id

    def _leave_run(self) -> None:
        """Close the run if one is open (called with ``_lock`` held)."""
        raise NotImplementedError


def flatten(mapping: Mapping[Any, Any], prefix: str = "", sep: str = "/") -> dict[str, Any]:
    """``{"opt": {"lr": 0.1}}`` -> ``{"opt/lr": 0.1}``; other values are kept as they are."""
    out: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{name}{sep}", sep))
        else:
            out[name] = value
    return out


def run_params(trainer: TrainerView) -> dict[str, Any]:
    """The module's hyperparameters (``module.hparams``, if it has that mapping) and the
    trainer's main options (under ``trainer/``), as a flat dict of plain values."""
    params: dict[str, Any] = {}
    hparams = getattr(trainer.module, "hparams", None)
    if isinstance(hparams, Mapping):
        params.update(flatten(hparams))
    for option in _TRAINER_OPTIONS:
        value = getattr(trainer, option, None)
        if isinstance(value, float) and math.isinf(value):
            value = None  # max_epochs / max_steps without a limit
        params[f"trainer/{option}"] = value
    params["trainer/precision"] = str(getattr(trainer, "precision", None))
    params["trainer/device"] = str(getattr(trainer, "device", None))
    params["trainer/world_size"] = trainer.world_size
    return params


def as_number(value: object) -> float | None:
    """A record's value as a float for a tracker's metric (bools as 0 and 1), or None when
    it is not a number (it is then logged as text)."""
    if not hasattr(type(value), "__float__"):  # str, None, ...: not a number
        return None
    try:  # int, float, bool (as 0 and 1), a 0-d tensor or numpy scalar
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, OverflowError):  # an int too large for a float
        return None
