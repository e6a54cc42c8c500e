"""``Checkpoint``: when to save the run (every N steps, every N epochs and/or on the best
value of a monitored record; on preemption; when ``fit`` ends) and which checkpoints to
keep (the last K and the best K). How a checkpoint is written (a name that replaces
none, the write itself, in the background if asked, the removal of the checkpoints no
longer kept, the ``last.json`` pointer) is ``_checkpoint_files``'s concern.

Written against the public API only, like a user's plugin.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from loopbus import (
    Delivery,
    Event,
    MisconfigurationError,
    Plugin,
    RemotePath,
    check_choice,
    check_int,
    on,
)
from loopbus.events import (
    EpochCompleted,
    FitCompleted,
    FitStarted,
    PreemptionRequested,
    PutRecord,
    Subscription,
    TrainBatchCompleted,
    ValidationCompleted,
)

from ._checkpoint_files import (
    CheckpointFiles,
    callable_path,
    check_filename,
    in_run_folder,
    latest_in,
    open_folder,
)

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from loopbus import StoreDeadlines, TrainerView

__all__ = ["Checkpoint", "CheckpointSaved"]


_MODES = {"min": "lower is better", "max": "higher is better"}
_OFF = "None turns it off"
_UPLOAD_ERRORS = {
    "warn": "report the failure in a UserWarning and go on",
    "raise": "stop the run with a CheckpointError",
}
_ALL = "None keeps them all"

#: The deprecated property names that warned already in this process: each warns once.
_WARNED: set[str] = set()


def _renamed(old: str, new: str) -> None:
    """Warn, once per process, that ``Checkpoint.<old>`` is a deprecated alias of
    ``Checkpoint.<new>`` (pointing at the caller of the property)."""
    if old in _WARNED:
        return
    _WARNED.add(old)
    warnings.warn(
        f"Checkpoint.{old} (Lightning's name) is deprecated: read checkpoint.{new}, which "
        "holds the same value.",
        DeprecationWarning,
        stacklevel=3,
    )


def _schedule(
    every_n_steps: int | None, every_n_epochs: int | None, monitor: str | None
) -> tuple[int | None, int | None]:
    """The periodic saves, checked (and ``monitor``); none and no monitor: each epoch."""
    steps = _optional_count("every_n_steps", every_n_steps, _OFF)
    epochs = _optional_count("every_n_epochs", every_n_epochs, _OFF)
    _check_monitor(monitor)
    if monitor is None and steps is None and epochs is None:
        epochs = 1
    return steps, epochs


def _files(
    dirpath: str | os.PathLike[str] | None,
    storage_options: Mapping[str, Any] | None,
    upload_retries: int,
    upload_errors: str,
    store_deadlines: StoreDeadlines | Mapping[str, float] | None = None,
) -> CheckpointFiles:
    """How the checkpoints are written (see ``_checkpoint_files``); when is decided by
    the plugin."""
    return CheckpointFiles(
        None if dirpath is None else open_folder(dirpath, storage_options, store_deadlines),
        retries=check_int("upload_retries", upload_retries, minimum=0, owner="Checkpoint"),
        on_error=check_choice("upload_errors", upload_errors, _UPLOAD_ERRORS, owner="Checkpoint"),
    )


def _optional_count(option: str, value: int | None, hint: str) -> int | None:
    """A count option that None may turn off (``hint`` says what None does)."""
    return check_int(option, value, allow_none=True, owner="Checkpoint", hint=hint)


def _check_monitor(monitor: str | None) -> None:
    if monitor is not None and (not isinstance(monitor, str) or not monitor):
        raise MisconfigurationError(
            f"Checkpoint(monitor=...) must be the name of a put record such as 'val/acc', "
            f"got {monitor!r}."
        )


def _agreed(trainer: TrainerView, best: float | None) -> float | None:
    """Under DDP, rank 0's decision on every rank: the ranks save together, since saving
    gathers every rank's generators. Called at boundaries every rank reaches."""
    if trainer.world_size == 1:
        return best
    agreed: float | None = trainer.strategy.broadcast_object(best)
    return agreed


def _shards(trainer: TrainerView, sharded: bool | None) -> bool:
    """Whether this fit's checkpoints are sharded: as asked, else when the strategy shards
    the model's state (whose checkpoints cannot be anything else)."""
    if sharded is None:
        shards: bool = trainer.strategy.sharded_state
        return shards
    if trainer.strategy.sharded_state and not sharded:
        raise MisconfigurationError(
            f"Checkpoint(sharded=False) under strategy {trainer.strategy.name!r}, which "
            "shards the model's state over the ranks: its checkpoints are sharded "
            "directories. Leave sharded unset (or True)."
        )
    return sharded


class _Kept:
    """The checkpoints a ``Checkpoint`` plugin keeps, by name: the ``keep_last`` most
    recent periodic ones, the ``keep_best`` best by the monitored value (best first),
    and the last one saved, which ``last.json`` names. Part of the plugin's state."""

    def __init__(self) -> None:
        self.recent: list[str] = []
        self.best: list[tuple[float, str]] = []
        self.last: str | None = None

    def names(self) -> set[str]:
        kept = set(self.recent) | {n for _, n in self.best}
        if self.last is not None:
            kept.add(self.last)
        return kept

    def earns_place(self, value: float, keep_best: int | None, mode: str) -> bool:
        """Whether a checkpoint of the monitored ``value`` enters the best."""
        if keep_best is None or len(self.best) < keep_best:
            return True
        worst = self.best[-1][0]
        return value < worst if mode == "min" else value > worst

    def register(
        self,
        name: str,
        *,
        periodic: bool,
        best: float | None,
        keep_last: int | None,
        keep_best: int | None,
        mode: str,
    ) -> list[str]:
        """Record a save of ``name``; return the checkpoints no longer kept."""
        before = self.names()
        if periodic:
            self.recent = [n for n in self.recent if n != name] + [name]
            if keep_last is not None:
                self.recent = self.recent[-keep_last:]
        if best is not None:
            ranked = [(v, n) for v, n in self.best if n != name] + [(best, name)]
            ranked.sort(key=lambda item: item[0], reverse=mode == "max")
            self.best = ranked if keep_best is None else ranked[:keep_best]
        self.last = name
        kept = set(self.recent) | {n for _, n in self.best} | {name}
        return sorted(before - kept)

    def state_dict(self) -> dict[str, Any]:
        return {
            "recent": list(self.recent),
            "best": [[value, name] for value, name in self.best],
            "last": self.last,
        }

    def load_state_dict(self, state_dict: dict[str, Any], *, best: bool) -> None:
        """Load ``state_dict``, its best checkpoints only if ``best`` (they were ranked
        by the same monitored record, in the same order)."""
        self.best = [(float(v), str(n)) for v, n in state_dict.get("best", [])] if best else []
        self.recent = [str(n) for n in state_dict.get("recent", [])]
        last = state_dict.get("last")
        self.last = None if last is None else str(last)


class CheckpointSaved(Event, frozen=True, kw_only=True):
    """Published by :class:`Checkpoint` (on the rank that writes) once a checkpoint file
    is durable: ``path`` is the file, ``step`` and ``epoch`` the run's position when it
    was taken, ``best`` whether it entered the ``keep_best`` best (with a monitor), and
    ``removed`` the files of older checkpoints deleted because they are no longer kept.
    A background save is announced before the next save starts, or when ``fit``
    completes; a ``fit`` that fails or is cancelled does not announce its last one."""

    path: str
    step: int
    epoch: int
    best: bool = False
    removed: tuple[str, ...] = ()


class _DeprecatedNames:
    """``Checkpoint``'s deprecated names (Lightning's), each reading its new one."""

    @property
    def last_model_path(self: Any) -> Path | None:
        """Deprecated: Lightning's name of :attr:`last_checkpoint_path` (as a plain path)."""
        _renamed("last_model_path", "last_checkpoint_path")
        path = self.last_checkpoint_path
        return None if path is None else Path(path)

    @property
    def best_model_path(self: Any) -> Path | None:
        """Deprecated: Lightning's name of :attr:`best_checkpoint_path`."""
        _renamed("best_model_path", "best_checkpoint_path")
        path: Path | None = self.best_checkpoint_path
        return path

    @property
    def best_model_score(self: Any) -> float | None:
        """Deprecated: Lightning's name of :attr:`best_value`."""
        _renamed("best_model_score", "best_value")
        value: float | None = self.best_value
        return value

    @property
    def monitor_mode(self: Any) -> Literal["min", "max"]:
        """Deprecated: :attr:`mode`."""
        warnings.warn(
            "Checkpoint.monitor_mode is deprecated; read checkpoint.mode.",
            DeprecationWarning,
            stacklevel=2,
        )
        mode: Literal["min", "max"] = self.mode
        return mode


class Checkpoint(_DeprecatedNames, Plugin):
    """Saves checkpoints of a ``fit`` into ``dirpath``.

    When (any combination; with none of them, every epoch):

    * ``every_n_steps=N``: after every N-th optimizer step (at ``TrainBatchCompleted``);
    * ``every_n_epochs=N``: at the end of every N-th epoch (``EpochCompleted``, after the
      epoch's validation and schedulers);
    * ``monitor="val/acc", mode="max"``: when the monitored put record reaches one of the
      ``keep_best`` best values. The value is checked after each validation, and the save
      happens at the next consistent boundary: the ``TrainBatchCompleted`` of the batch
      the validation ran after (``val_check_interval``), or ``EpochCompleted`` (validation
      at epoch end). A checkpoint taken in the middle of a batch could not be resumed
      exactly, so none is.
    * ``save_on_end``: once more when ``fit`` completes or is stopped, unless nothing
      happened since the last save (a failed or cancelled ``fit`` saves nothing, so the
      last checkpoint stays the last good state).
    * on preemption (SIGTERM, SIGUSR1, while this plugin is active): at
      ``PreemptionRequested``, a checkpoint that resumes exactly at the step boundary
      where the stop took effect, unless the last save was taken there; nothing after it
      in that ``fit``. See ``docs/checkpointing.md``, "Preemption".

    What is kept: the ``keep_last`` most recent periodic checkpoints (None: all), the
    ``keep_best`` best ones (None: all), and always the newest, which the directory's
    ``last.json`` pointer names: ``trainer.fit(..., ckpt_path="last")`` resumes from it.

    ``background=True``: the step pays only for copying the state to host memory; the
    file is written in a worker thread. At most one save is in flight (a save waits for
    the previous one; to a URL at most ``store_deadlines``' ``save_wait_s``, then the due
    save is skipped with a warning), and ``fit`` returns only once the last one is
    durable. A failed background write is raised at the next save or when ``fit`` ends.

    ``sharded=True`` (the default under a strategy that shards the model's state, such as
    FSDP; an option otherwise): every rank writes its own shards through
    ``torch.distributed.checkpoint`` into a checkpoint *directory* that every rank sees,
    which resumes at any world size; ``background`` then defaults to True
    (``dcp.async_save``). A sharded checkpoint is complete (rank 0 writes its marker
    once every rank has written) or ignored. See ``docs/checkpointing.md``.

    File names come from ``filename`` (fields ``{epoch}`` and ``{step}``) plus ``.ckpt``.
    A save never replaces a checkpoint: when that name is taken (two saves at the same
    epoch and step, such as an epoch-end save after the step's periodic one, or a
    checkpoint a previous run left in ``dirpath``), the save is named ``<name>-v1.ckpt``
    (``-v2``, ... if that is taken too), as Lightning's ``ModelCheckpoint`` does.

    ``dirpath`` is this run's: ``fit`` takes the folder's lease, held until it ends (a run
    writing there now is refused: docs/checkpointing.md, "One writer per folder"), and
    refuses a folder holding checkpoints (or a ``last.json``) this plugin did not write,
    before anything is written, unless the run resumes from one in it (``ckpt_path="last"``
    or a path inside it) or ``exist_ok=True`` adds this run's ones (``-v1`` names above).

    Under DDP the plugin runs on every rank (its saves gather every rank's random
    generators, so all ranks decide to save at the same boundaries; a monitored value
    is rank 0's), and rank 0 alone writes the files.
    """

    #: After the other callbacks of the same event, so that their state is saved updated.
    delivery = Delivery(priority=-100)
    #: Left out by ``Trainer(fast_dev_run=...)``, which writes no checkpoint files.
    writes_files: ClassVar[bool] = True
    #: Saves at ``PreemptionRequested``: ``Trainer(preemption="auto")`` handles the signals.
    handles_preemption: ClassVar[bool] = True

    def __init__(
        self,
        dirpath: str | os.PathLike[str] | None = None,
        *,
        every_n_steps: int | None = None,
        every_n_epochs: int | None = None,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        keep_last: int | None = 1,
        keep_best: int | None = 1,
        filename: str = "epoch={epoch}-step={step}",
        background: bool | None = None,
        save_on_end: bool = True,
        sharded: bool | None = None,
        exist_ok: bool = False,
        storage_options: Mapping[str, Any] | None = None,
        upload_retries: int = 3,
        upload_errors: Literal["warn", "raise"] = "warn",
        store_deadlines: StoreDeadlines | Mapping[str, float] | None = None,
    ) -> None:
        self._files = _files(
            dirpath, storage_options, upload_retries, upload_errors, store_deadlines
        )
        self.every_n_steps, self.every_n_epochs = _schedule(every_n_steps, every_n_epochs, monitor)
        check_choice("mode", mode, _MODES, owner="Checkpoint")
        self.monitor = monitor
        self.mode: Literal["min", "max"] = mode
        self.keep_last = _optional_count("keep_last", keep_last, _ALL)
        self.keep_best = _optional_count("keep_best", keep_best, _ALL)
        check_filename(filename)
        self.filename = filename
        self.sharded = None if sharded is None else bool(sharded)
        self._background = background
        self.save_on_end = bool(save_on_end)
        self.exist_ok = bool(exist_ok)
        self._sharded_now = False
        # The folder this plugin has claimed (see _claim), and whether a resume loaded
        # this plugin's state in the running fit.
        self._claimed: Path | None = None
        self._loaded = False

        # Checkpointed state (see state_dict).
        self._kept = _Kept()
        self._last_saved: tuple[int, str] | None = None
        self._monitor_value: float | None = None
        self._monitor_fresh = False
        self._validated = False

        # Per stage.
        self._trainer: TrainerView | None = None
        self._task_group: TaskGroup | None = None
        self._record_sub: Subscription | None = None
        self._saw_validation = False
        self._preempted = False
        # Training batches completed in this stage, and how many when the last save was
        # taken: a preemption at the boundary of the last save has nothing more to save.
        self._batches = 0
        self._saved_after: int | None = None
        self._ready = False

    def __repr__(self) -> str:
        return f"Checkpoint(dirpath={str(self.dirpath)!r})"

    @property
    def dirpath(self) -> Path:
        """The directory the checkpoints go into: a URL is a ``RemotePath`` (with the
        ``storage_options`` and ``store_deadlines``; docs/checkpointing.md)."""
        return self._files.dirpath  # type: ignore[return-value]

    @dirpath.setter
    def dirpath(self, dirpath: Path | RemotePath) -> None:
        self._files.dirpath = dirpath

    @property
    def background(self) -> bool:
        """Whether saves are written in the background: as given, else for sharded ones."""
        if self._background is not None:
            return bool(self._background)
        return self._sharded_now or self._files.remote

    @property
    def state_key(self) -> str:
        """``"Checkpoint"``, or ``"Checkpoint[<monitor>]"`` with a monitor (several apart)."""
        return "Checkpoint" if self.monitor is None else f"Checkpoint[{self.monitor}]"

    # ------------------------------------------------------------ public API
    @property
    def last_checkpoint_path(self) -> Path | None:
        """The newest complete checkpoint the plugin knows in ``dirpath`` (the last it saved,
        the one a fit resumed from, what :meth:`latest_checkpoint` found), or None; no I/O.
        Called as the method it was (``last_checkpoint_path()``), it still gives the path
        with a ``DeprecationWarning`` (None cannot be called: ``TypeError``)."""
        return callable_path(self._files.last)  # type: ignore[return-value]

    def latest_checkpoint(self) -> Path | RemotePath | None:
        """The newest checkpoint in ``dirpath`` (``ckpt_path="last"``'s), looked up now."""
        return latest_in(self._files)

    @property
    def best_checkpoint_path(self) -> Path | RemotePath | None:
        """The checkpoint with the best monitored value so far, or None: the file that
        ``trainer.test(..., ckpt_path="best")`` (and ``validate``, ``predict``) loads."""
        best = self._kept.best
        return self.dirpath / best[0][1] if best else None

    @property
    def best_value(self) -> float | None:
        """The best monitored value so far, or None."""
        best = self._kept.best
        return best[0][0] if best else None

    # ------------------------------------------------------------ lifecycle
    def setup(self, trainer: TrainerView, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        self._sharded_now = _shards(trainer, self.sharded)
        in_run_folder(self._files, trainer).reset()
        self._saw_validation = False
        self._preempted = False
        self._batches = 0
        self._saved_after = None
        self._loaded = self._ready = False  # the folder is claimed at FitStarted
        if trainer.is_global_zero:  # rank 0 alone writes, and cleans up dead writers
            self._files.remove_stale()
        if self.monitor is not None:
            self._record_sub = trainer.subscribe(
                PutRecord,
                self._on_record,
                destination="callbacks",
                owner=f"{type(self).__name__}._on_record",
            )

    async def start(self, trainer: TrainerView, stage: str, task_group: TaskGroup) -> None:
        self._task_group = task_group

    async def stop(self, trainer: TrainerView, stage: str) -> None:
        await self._files.wait_idle()
        self._files.unannounced = None  # the bus has stopped delivering

    def teardown(self, trainer: TrainerView, stage: str) -> None:
        if self._record_sub is not None:
            self._record_sub.unsubscribe()
            self._record_sub = None
        self._files.release()  # the folder's lease: the fit is over, however it ended
        self._trainer = None
        self._task_group = None

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            **self._kept.state_dict(),
            "last_saved": list(self._last_saved) if self._last_saved is not None else None,
            "monitor": self.monitor,
            "mode": self.mode,
            "monitor_value": self._monitor_value,
            "monitor_fresh": self._monitor_fresh,
            "validated": self._validated,
            "unremoved": self._files.unremoved,  # evicted, not removed yet (see _claim)
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = True
        same = state_dict.get("monitor") == self.monitor and state_dict.get("mode") == self.mode
        # Best values of another metric (or order) mean nothing here: start afresh.
        self._kept.load_state_dict(state_dict, best=same)
        value = state_dict.get("monitor_value") if same else None
        self._monitor_value = None if value is None else float(value)
        self._monitor_fresh = same and bool(state_dict.get("monitor_fresh", False))
        last_saved = state_dict.get("last_saved")
        self._last_saved = None if last_saved is None else (int(last_saved[0]), str(last_saved[1]))
        self._validated = bool(state_dict.get("validated", False))
        self._files.remove_later(state_dict.get("unremoved", []), keep=self._kept.names())

    # ------------------------------------------------------------ events
    @on(FitStarted, mode="inline", priority=2000)
    def _claim(self, event: FitStarted | None = None) -> None:
        """Before the first write (and before the loggers open): refuse a folder holding
        another run's checkpoints, unless the run resumes from them or ``exist_ok``."""
        trainer = self._trainer
        if trainer is None or self._ready:
            return
        plan = trainer.state.resume
        # Resumed from this folder: the checkpoint is in it, or (with several Checkpoint
        # plugins, "last" is the newest of theirs) the state it loaded names ones in it.
        files, kept = self._files, self._kept.names()
        here = plan is not None and (files.holds(plan.source) or (self._loaded and files.has(kept)))
        own = self.exist_ok or self._claimed == self.dirpath
        files.claim(trainer, resumes_here=here, exist_ok=own)
        self._claimed, self._ready = self.dirpath, True
        if plan is not None and files.holds(plan.source):  # the newest known: resumed
            files.last = self.dirpath / os.path.basename(os.fspath(plan.source).rstrip("/"))

    def _on_record(self, record: PutRecord) -> None:
        if record.name == self.monitor:
            self._monitor_value = float(record.value)
            self._monitor_fresh = True

    @on(ValidationCompleted)
    def _on_validation(self, event: ValidationCompleted) -> None:
        if self._trainer is not None and self.monitor is not None:
            # Deferred to the next batch or epoch boundary (see the class docstring).
            self._validated = True
            self._saw_validation = True

    @on(TrainBatchCompleted)
    async def _on_batch(self, event: TrainBatchCompleted) -> None:
        trainer = self._trainer
        if trainer is None:
            return
        self._batches += 1
        step = trainer.global_step
        periodic = (
            self.every_n_steps is not None
            and step > 0
            and step % self.every_n_steps == 0
            # With gradient accumulation several batches end at the same step: save once.
            and not (self._last_saved is not None and self._last_saved[0] == step)
        )
        best = _agreed(trainer, self._monitor_check()) if self._validated else None
        if periodic or best is not None:
            await self._save("batch", periodic=periodic, best=best)

    @on(EpochCompleted)
    async def _on_epoch(self, event: EpochCompleted) -> None:
        trainer = self._trainer
        if trainer is None or self._preempted:
            return
        periodic = self.every_n_epochs is not None and (event.epoch + 1) % self.every_n_epochs == 0
        best = None
        if self.monitor is not None:
            if self._monitor_value is None and self._saw_validation:
                raise MisconfigurationError(
                    f"Checkpoint(monitor={self.monitor!r}) found no record named "
                    f"{self.monitor!r} by the end of an epoch with validation; the records "
                    f"put so far are {sorted(trainer.latest)}. Put it "
                    f"(self.put({self.monitor!r}, value)) from validation_step or a handler, "
                    "or fix the name."
                )
            if self._validated or self._monitor_fresh:
                best = self._monitor_check()
            if trainer.world_size > 1:
                best = _agreed(trainer, best)
        if periodic or best is not None:
            await self._save("epoch", periodic=periodic, best=best)

    @on(PreemptionRequested)
    async def _on_preemption(self, event: PreemptionRequested) -> None:
        if self._trainer is None or self._preempted:
            return
        # The stop took effect right where the last save was taken (a periodic save at
        # the window's end, an epoch-end save): that checkpoint resumes exactly here.
        if self._saved_after != self._batches:
            await self._save("preempted", periodic=True, best=None)
        self._preempted = True  # what a later save would record is the epoch cut short

    @on(FitCompleted)
    async def _on_end(self, event: FitCompleted) -> None:
        self._files.ending()  # a store that is down is not waited for any more
        await self._save_on_end()
        # The last background save is announced while the bus still delivers.
        await self._files.wait_idle()
        await self._files.announce(self._trainer)

    async def _save_on_end(self) -> None:
        trainer = self._trainer
        if trainer is None or self._preempted:
            return
        if self.monitor is not None and self._monitor_value is None:
            warnings.warn(
                f"Checkpoint(monitor={self.monitor!r}) never saw a record named "
                f"{self.monitor!r} during fit, so it saved no best checkpoint; the records "
                f"put were {sorted(trainer.latest)}.",
                UserWarning,
                stacklevel=2,
            )
        if not self.save_on_end:
            return
        if (
            self._last_saved is not None
            and self._last_saved[0] == trainer.global_step
            and (self._last_saved[1] in ("epoch", "end"))
        ):
            return  # nothing changed since the epoch-end save
        if trainer.global_step == 0 and self._last_saved is None:
            return  # nothing was trained
        await self._save("end", periodic=True, best=None)

    # ------------------------------------------------------------ saving
    def _monitor_check(self) -> float | None:
        """The monitored value if it earns a place among the best, else None."""
        self._validated = False
        fresh, self._monitor_fresh = self._monitor_fresh, False
        value = self._monitor_value
        if value is None or not fresh or math.isnan(value):
            return None
        return value if self._kept.earns_place(value, self.keep_best, self.mode) else None

    async def _save(self, kind: str, *, periodic: bool, best: float | None) -> None:
        trainer = self._trainer
        assert trainer is not None
        self._claim()  # a save before FitStarted (a preemption)
        files = self._files
        if not await files.ready(trainer, final=kind == "end"):
            return  # another job of the run saves it, or the previous upload is in flight
        await files.wait_idle()
        await files.announce(trainer)
        step, epoch = trainer.global_step, trainer.current_epoch
        stem = self.filename.format(epoch=epoch, step=step)
        kept = self._kept
        name = files.free_name(trainer, stem, kept.names())
        evicted = kept.register(
            name,
            periodic=periodic,
            best=best,
            keep_last=self.keep_last,
            keep_best=self.keep_best,
            mode=self.mode,
        )
        self._last_saved = (step, kind)
        self._saved_after = self._batches
        saved = CheckpointSaved(
            path=str(self.dirpath / name),
            step=step,
            epoch=epoch,
            best=best is not None and any(n == name for _, n in kept.best),
            removed=tuple(str(self.dirpath / old) for old in evicted if old != name),
        )
        await files.save(
            trainer,
            name,
            evicted,
            saved,
            background=self.background,
            sharded=self._sharded_now,
            task_group=self._task_group,
        )
