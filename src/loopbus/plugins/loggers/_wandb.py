"""Weights & Biases logger (the optional extra ``wandb``)."""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio.to_thread

from loopbus import MisconfigurationError, PutRecord, check_choice, check_local_path, on
from loopbus.events import FitStarted, Teardown

from .._checkpoint import CheckpointSaved
from ._base import Logger
from ._tracking import TrackedRun, as_number, run_params

if TYPE_CHECKING:
    from loopbus import TrainerView

__all__ = ["WandbLogger"]

_MODES = {
    "online": "log to the W&B server",
    "offline": "write the run to dir, for `wandb sync` later",
    "disabled": "log nothing",
}
_FAILED = {"failed", "cancelled"}

#: The summary keys under which the newest and the best checkpoint's paths are kept.
LAST_CHECKPOINT_KEY = "loopbus.checkpoint.last"
BEST_CHECKPOINT_KEY = "loopbus.checkpoint.best"


def wandb_key(name: str) -> str:
    """``name`` as a W&B history key: names starting with ``_`` are W&B's own (``_step``,
    ``_runtime``), so a put record's gets the prefix ``put/``."""
    return f"put/{name}" if name.startswith("_") else name


def _value(value: Any) -> Any:
    if type(value) in (int, float, bool):
        return value
    number = as_number(value)
    return str(value) if number is None else number


def _check_options(
    names: Mapping[str, str | None],
    *,
    dir: str | os.PathLike[str] | None,
    mode: str | None,
    tags: Sequence[str] | None,
    init_kwargs: Mapping[str, Any] | None,
) -> None:
    """Refuse what ``wandb.init`` would misread, before any run starts: ``names`` are the
    options that take a non-empty string (``project``, ``name``, ``id``, ``group``)."""
    for option, value in names.items():
        if value is not None and (not isinstance(value, str) or not value):
            raise MisconfigurationError(
                f"WandbLogger({option}=...) must be a non-empty string or None, got {value!r}."
            )
    if dir is not None and not isinstance(dir, (str, os.PathLike)):
        raise MisconfigurationError(
            f"WandbLogger(dir=...) must be a directory path or None, got {dir!r}."
        )
    if mode is not None:
        check_choice("mode", mode, _MODES, owner="WandbLogger")
    if tags is not None and (isinstance(tags, str) or not all(isinstance(t, str) for t in tags)):
        raise MisconfigurationError(
            f"WandbLogger(tags=...) must be a list of strings, got {tags!r}."
        )
    if init_kwargs is not None and not isinstance(init_kwargs, Mapping):
        raise MisconfigurationError(
            f"WandbLogger(init_kwargs=...) must be a mapping of wandb.init arguments, "
            f"got {init_kwargs!r}."
        )
    reserved = {"id", "resume", "reinit", "config"} & set(init_kwargs or {})
    if reserved:
        raise MisconfigurationError(
            f"WandbLogger(init_kwargs=...) cannot set {sorted(reserved)}: the logger "
            "sets them (pass id=... to WandbLogger; the config holds the module's "
            "hparams and the trainer's options)."
        )


class WandbLogger(TrackedRun, Logger):
    """Logs a run to Weights & Biases: each put record into the run's history at its
    step (``run.log({name: value}, step=record.step)``), the module's hyperparameters
    (``module.hparams``) and the trainer's main options (``trainer/...``) into the run's
    config, and the checkpoints the :class:`Checkpoint` plugin writes into its summary
    (``loopbus.checkpoint.last`` and ``loopbus.checkpoint.best``; the files as a
    ``model`` artifact with ``log_checkpoints=True``)::

        trainer = Trainer(plugins=[ProgressBar(), Checkpoint("ckpt"),
                                   WandbLogger(project="mnist")])

    * ``project``, ``name``, ``group``, ``tags``: the run's project, display name, group
      and tags (None: W&B's defaults and environment variables).
    * ``id``: the run's id (None: W&B makes one); ``dir``: where W&B writes its files.
    * ``mode``: ``"online"``, ``"offline"`` (no network; ``wandb sync`` uploads later) or
      ``"disabled"``; None leaves it to W&B (``WANDB_MODE``).
    * ``log_params``: put the hyperparameters and trainer options into the config.
    * ``log_checkpoints``: also log the checkpoint files as artifacts (a file the
      :class:`Checkpoint` plugin has already removed again, as ``keep_last`` asks, is
      skipped; the newest is always logged).
    * ``init_kwargs``: any other argument of ``wandb.init`` (``entity``, ``settings``, ...).

    Resuming (``fit(..., ckpt_path=...)``) continues the same run: its id is part of every
    checkpoint (this plugin's state) and the run is reopened with ``resume="allow"``.
    The steps after the checkpoint's are logged again as the resumed run reaches them;
    W&B keeps a step once, so resume from the newest checkpoint.

    W&B keeps one history row per step: records put at the same step share it, and a
    name put twice at one step keeps its last value there. Names starting with ``_``
    (W&B's own) are logged as ``put/<name>``. Every call to W&B runs in a worker thread,
    never on the event loop, and acts on rank 0 only. The run is finished with each stage
    (exit code 1 when the stage failed or was cancelled); a later stage of the same
    logger (``test`` after ``fit``) resumes it. Needs the ``wandb`` extra:
    ``pip install 'loopbus[wandb]'``.
    """

    def __init__(
        self,
        *,
        project: str | None = None,
        name: str | None = None,
        id: str | None = None,
        dir: str | os.PathLike[str] | None = None,
        mode: Literal["online", "offline", "disabled"] | None = None,
        group: str | None = None,
        tags: Sequence[str] | None = None,
        log_params: bool = True,
        log_checkpoints: bool = False,
        init_kwargs: Mapping[str, Any] | None = None,
        flush_interval: float = 0.5,
        buffer: int = 1024,
        overflow: Literal["block", "drop"] = "block",
    ) -> None:
        if importlib.util.find_spec("wandb") is None:
            raise ModuleNotFoundError(
                "WandbLogger needs the wandb package, which is not installed. "
                "Install it with: pip install 'loopbus[wandb]'"
            )
        super().__init__(flush_interval=flush_interval, buffer=buffer, overflow=overflow)
        _check_options(
            {"project": project, "name": name, "id": id, "group": group},
            dir=dir,
            mode=mode,
            tags=tags,
            init_kwargs=init_kwargs,
        )
        self.project = project
        self.name = name
        self.dir = None if dir is None else Path(check_local_path("dir", dir, owner="WandbLogger"))
        self.mode = mode
        self.group = group
        self.tags = None if tags is None else list(tags)
        self.log_params = bool(log_params)
        self.log_checkpoints = bool(log_checkpoints)
        self.init_kwargs = dict(init_kwargs or {})
        self._run_id: str | None = id
        self._fixed_run = id is not None
        self._wandb_run: Any = None
        self._params: dict[str, Any] = {}
        self._failed = False
        # One W&B call at a time: the writer thread and the checkpoint handler's.
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"WandbLogger(project={self.project!r}, id={self._run_id!r})"

    # ------------------------------------------------------------ state
    def _leave_run(self) -> None:
        if self._wandb_run is not None:
            self._finish_run()

    # ------------------------------------------------------------ lifecycle
    def setup(self, trainer: TrainerView, stage: str) -> None:
        self._params = run_params(trainer) if self.log_params else {}
        self._failed = False

    def open(self, stage: str) -> None:
        if stage != "fit":
            self._start_run()
        # fit: at FitStarted, once a checkpoint being resumed has given its run id.

    @on(FitStarted, mode="inline")
    async def _on_fit_started(self, event: FitStarted) -> None:
        await anyio.to_thread.run_sync(self._start_run)

    @on(Teardown)
    def _on_teardown(self, event: Teardown) -> None:
        self._failed = event.reason in _FAILED

    def close(self) -> None:
        with self._lock:
            if self._wandb_run is not None:
                self._finish_run()

    # ------------------------------------------------------------ W&B calls (threads)
    def _start_run(self) -> None:
        with self._lock:
            self._ensure_run()

    def _ensure_run(self) -> None:
        """Start or resume the run (with the lock held)."""
        if self._wandb_run is not None:
            return
        import wandb

        kwargs: dict[str, Any] = {
            "project": self.project,
            "name": self.name,
            "group": self.group,
            "tags": self.tags,
            "dir": None if self.dir is None else str(self.dir),
            "mode": self.mode,
            **self.init_kwargs,
        }
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
        run: Any = wandb.init(
            id=self._run_id,
            resume="allow",
            # Its own run object, not the process-wide ``wandb.run``: several loggers (or
            # trainers) in one process keep their runs apart.
            reinit="create_new",
            **{k: v for k, v in kwargs.items() if v is not None},
        )
        self._wandb_run = run
        self._run_id = run.id
        if self._params:
            run.config.update(self._params, allow_val_change=True)

    def _finish_run(self) -> None:
        run, self._wandb_run = self._wandb_run, None
        run.finish(exit_code=1 if self._failed else 0)

    def write(self, records: Sequence[PutRecord]) -> None:
        rows: list[tuple[int, dict[str, Any]]] = []
        row: dict[str, Any] = {}
        step = -1
        for record in records:
            if record.step != step and row:
                rows.append((step, row))
                row = {}
            step = record.step
            row[wandb_key(record.name)] = _value(record.value)
        if row:
            rows.append((step, row))
        with self._lock:
            self._ensure_run()
            log = self._wandb_run.log
            for step, data in rows:
                log(data, step=step)

    @on(CheckpointSaved)
    async def _on_checkpoint(self, event: CheckpointSaved) -> None:
        await anyio.to_thread.run_sync(self._log_checkpoint, event)

    def _log_checkpoint(self, event: CheckpointSaved) -> None:
        with self._lock:
            self._ensure_run()
            run = self._wandb_run
            run.summary[LAST_CHECKPOINT_KEY] = event.path
            if event.best:
                run.summary[BEST_CHECKPOINT_KEY] = event.path
            if self.log_checkpoints:
                import wandb

                artifact = wandb.Artifact(f"checkpoints-{run.id}", type="model")
                try:
                    artifact.add_file(event.path)
                except (FileNotFoundError, ValueError):
                    # Already replaced by a newer one (keep_last): it is not kept, so it
                    # is not logged either.
                    return
                run.log_artifact(artifact, aliases=[f"step-{event.step}"])
