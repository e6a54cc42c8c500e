"""MLflow logger (the optional extra ``mlflow``)."""

from __future__ import annotations

import importlib.util
import re
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

import anyio.to_thread

from loopbus import MisconfigurationError, PutRecord, on
from loopbus.events import FitStarted, Teardown

from .._checkpoint import CheckpointSaved
from ._base import Logger
from ._tracking import TrackedRun, as_number, run_params

if TYPE_CHECKING:
    from loopbus import TrainerView

__all__ = ["MLflowLogger"]

# MLflow's limits (mlflow.utils.validation): entries per log_batch call, and lengths.
_METRICS_PER_BATCH = 1000
_PARAMS_TAGS_PER_BATCH = 100
_KEY_LENGTH = 250
_PARAM_LENGTH = 6000
_TAG_LENGTH = 8000
# MLflow accepts letters, digits, "_", "-", ".", " " and "/" on every platform.
_BAD_CHARS = re.compile(r"[^/\w.\- ]")
_STATUS = {
    "completed": "FINISHED",
    "stopped": "FINISHED",
    "failed": "FAILED",
    "cancelled": "KILLED",
}

#: The tags under which the newest and the best checkpoint's paths are kept.
LAST_CHECKPOINT_TAG = "loopbus.checkpoint.last"
BEST_CHECKPOINT_TAG = "loopbus.checkpoint.best"


def mlflow_key(name: str) -> str:
    """``name`` as an MLflow metric, param or tag key: characters MLflow refuses become
    ``_``, and the key is a normalized path (no empty, ``.`` or ``..`` parts)."""
    parts = [p if p not in (".", "..") else "_" for p in _BAD_CHARS.sub("_", name).split("/")]
    key = "/".join(p for p in parts if p)
    return key[:_KEY_LENGTH] or "_"


def _text(value: Any, limit: int) -> str:
    return str(value)[:limit]


class MLflowLogger(TrackedRun, Logger):
    """Logs a run to MLflow: each put record as a metric (key = record name, step =
    ``record.step``, timestamp = ``record.time``), the module's hyperparameters
    (``module.hparams``) and the trainer's main options (``trainer/...``) as params, and
    the checkpoints the :class:`Checkpoint` plugin writes as tags (``loopbus.checkpoint.last``
    and ``loopbus.checkpoint.best``; the files themselves as artifacts under
    ``checkpoints/`` with ``log_checkpoints=True``)::

        trainer = Trainer(plugins=[ProgressBar(), Checkpoint("ckpt"),
                                   MLflowLogger(tracking_uri="sqlite:///mlflow.db")])

    * ``tracking_uri``: where runs are kept (``"sqlite:///mlflow.db"``, ``"http://host:5000"``,
      ...); None uses MLflow's own default (``MLFLOW_TRACKING_URI``).
    * ``experiment_name``: the experiment the run belongs to (created if missing, with
      ``artifact_location`` when given).
    * ``run_name``, ``tags``: the new run's name and tags.
    * ``run_id``: log into this existing run instead of creating one.
    * ``log_params``: log the hyperparameters and trainer options.
    * ``log_checkpoints``: also upload the checkpoint files as artifacts (uploaded in the
      background: a file the :class:`Checkpoint` plugin has already removed again, as
      ``keep_last`` asks, is skipped; the newest is always uploaded).

    Resuming (``fit(..., ckpt_path=...)``) continues the same run: its id is part of every
    checkpoint (this plugin's state) and the run is reopened. The steps after the
    checkpoint's are logged again as the resumed run reaches them, so resume from the
    newest checkpoint to keep each step once (MLflow cannot remove metric values).

    Values that are not numbers are logged as tags (their text), never dropped silently;
    booleans as 0 and 1 (MLflow's SQL stores keep NaN, and store an infinity as the
    largest finite float); names are made valid MLflow keys (other characters become
    ``_``). Every call to MLflow runs in a worker thread, never on the event loop, and
    acts on rank 0 only. The run ends (``FINISHED``, ``FAILED`` or ``KILLED``) with each
    stage; a later stage of the same logger (``test`` after ``fit``) logs into it again.
    Needs the ``mlflow`` extra: ``pip install 'loopbus[mlflow]'``.
    """

    def __init__(
        self,
        *,
        tracking_uri: str | None = None,
        experiment_name: str = "loopbus",
        run_name: str | None = None,
        run_id: str | None = None,
        tags: Mapping[str, Any] | None = None,
        artifact_location: str | None = None,
        log_params: bool = True,
        log_checkpoints: bool = False,
        flush_interval: float = 0.5,
        buffer: int = 1024,
        overflow: Literal["block", "drop"] = "block",
    ) -> None:
        if importlib.util.find_spec("mlflow") is None:
            raise ModuleNotFoundError(
                "MLflowLogger needs the mlflow package, which is not installed. "
                "Install it with: pip install 'loopbus[mlflow]'"
            )
        super().__init__(flush_interval=flush_interval, buffer=buffer, overflow=overflow)
        for option, value, allow_none in (
            ("tracking_uri", tracking_uri, True),
            ("experiment_name", experiment_name, False),
            ("run_name", run_name, True),
            ("run_id", run_id, True),
            ("artifact_location", artifact_location, True),
        ):
            if (value is None and not allow_none) or (
                value is not None and (not isinstance(value, str) or not value)
            ):
                raise MisconfigurationError(
                    f"MLflowLogger({option}=...) must be a non-empty string"
                    + (" or None" if allow_none else "")
                    + f", got {value!r}."
                )
        if tags is not None and not isinstance(tags, Mapping):
            raise MisconfigurationError(
                f"MLflowLogger(tags=...) must be a mapping of tag names to values, got {tags!r}."
            )
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        self.run_name = run_name
        self.tags = {str(k): _text(v, _TAG_LENGTH) for k, v in (tags or {}).items()}
        self.artifact_location = artifact_location
        self.log_params = bool(log_params)
        self.log_checkpoints = bool(log_checkpoints)
        self._run_id: str | None = run_id
        self._fixed_run = run_id is not None
        self._client: Any = None
        self._active = False  # the run is open (status RUNNING) in this stage
        self._params: dict[str, Any] = {}
        self._status = "FINISHED"
        self._keys: dict[str, str] = {}
        # One MLflow call at a time: the writer thread and the checkpoint handler's.
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"MLflowLogger(experiment_name={self.experiment_name!r}, run_id={self._run_id!r})"

    # ------------------------------------------------------------ state
    def _leave_run(self) -> None:
        if self._active:
            self._end_run("FINISHED")

    # ------------------------------------------------------------ lifecycle
    def setup(self, trainer: TrainerView, stage: str) -> None:
        self._params = run_params(trainer) if self.log_params else {}
        self._status = "FINISHED"

    def open(self, stage: str) -> None:
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        if stage != "fit":
            self._open_run()
        # fit: at FitStarted, once a checkpoint being resumed has given its run id.

    @on(FitStarted, mode="inline")
    async def _on_fit_started(self, event: FitStarted) -> None:
        await anyio.to_thread.run_sync(self._open_run)

    @on(Teardown)
    def _on_teardown(self, event: Teardown) -> None:
        self._status = _STATUS.get(event.reason, "FINISHED")

    def close(self) -> None:
        with self._lock:
            if self._active:
                self._end_run(self._status)
        self._client = None

    # ------------------------------------------------------------ MLflow calls (threads)
    def _open_run(self) -> None:
        with self._lock:
            self._ensure_run()

    def _ensure_run(self) -> None:
        """Create or reopen the run (with the lock held)."""
        if self._active:
            return
        from mlflow.entities import Param

        client = self._client
        logged: Mapping[str, str] = {}
        if self._run_id is not None:
            try:
                run = client.get_run(self._run_id)
            except Exception as exc:
                raise RuntimeError(
                    f"MLflowLogger cannot reopen the MLflow run {self._run_id!r} at "
                    f"{client.tracking_uri!r}: {exc}. Point tracking_uri at the store that "
                    "holds it, or start a new run (no run_id, and no checkpoint that names "
                    "one)."
                ) from exc
            if run.info.status != "RUNNING":
                client.update_run(self._run_id, status="RUNNING")
            logged = run.data.params
        else:
            experiment = client.get_experiment_by_name(self.experiment_name)
            if experiment is None:
                experiment_id = client.create_experiment(
                    self.experiment_name, artifact_location=self.artifact_location
                )
            else:
                experiment_id = experiment.experiment_id
            run = client.create_run(experiment_id, tags=self.tags, run_name=self.run_name)
            self._run_id = run.info.run_id
        self._active = True
        # Params cannot change once logged: a resumed run logs only the new ones.
        params = [
            Param(key, _text(value, _PARAM_LENGTH))
            for key, value in ((mlflow_key(k), v) for k, v in self._params.items())
            if key not in logged
        ]
        for i in range(0, len(params), _PARAMS_TAGS_PER_BATCH):
            client.log_batch(
                self._run_id, params=params[i : i + _PARAMS_TAGS_PER_BATCH], synchronous=True
            )

    def _end_run(self, status: str) -> None:
        self._client.set_terminated(self._run_id, status=status)
        self._active = False

    def _key(self, name: str) -> str:
        key = self._keys.get(name)
        if key is None:
            key = self._keys[name] = mlflow_key(name)
        return key

    def write(self, records: Sequence[PutRecord]) -> None:
        from mlflow.entities import Metric, RunTag

        metrics: list[Any] = []
        tags: dict[str, Any] = {}
        for record in records:
            key = self._key(record.name)
            value = as_number(record.value)
            if value is None:
                tags[key] = RunTag(key, _text(record.value, _TAG_LENGTH))
            else:
                metrics.append(Metric(key, value, int(record.time * 1000), record.step))
        with self._lock:
            self._ensure_run()
            client, run_id = self._client, self._run_id
            for i in range(0, len(metrics), _METRICS_PER_BATCH):
                client.log_batch(
                    run_id, metrics=metrics[i : i + _METRICS_PER_BATCH], synchronous=True
                )
            if tags:
                values = list(tags.values())
                for i in range(0, len(values), _PARAMS_TAGS_PER_BATCH):
                    client.log_batch(
                        run_id, tags=values[i : i + _PARAMS_TAGS_PER_BATCH], synchronous=True
                    )

    @on(CheckpointSaved)
    async def _on_checkpoint(self, event: CheckpointSaved) -> None:
        await anyio.to_thread.run_sync(self._log_checkpoint, event)

    def _log_checkpoint(self, event: CheckpointSaved) -> None:
        from mlflow.entities import RunTag

        tags = [RunTag(LAST_CHECKPOINT_TAG, event.path)]
        if event.best:
            tags.append(RunTag(BEST_CHECKPOINT_TAG, event.path))
        with self._lock:
            if self._client is None:
                return  # the stage already ended
            self._ensure_run()
            self._client.log_batch(self._run_id, tags=tags, synchronous=True)
            if self.log_checkpoints:
                try:
                    self._client.log_artifact(self._run_id, event.path, artifact_path="checkpoints")
                except FileNotFoundError:
                    # Already replaced by a newer one (keep_last): it is not kept, so it
                    # is not uploaded either.
                    pass
