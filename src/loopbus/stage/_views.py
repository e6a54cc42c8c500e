"""What a trainer shows of its run: read-only views of the run's state, the strategy's
ranks and the latest records, as the attributes Lightning users know
(``trainer.global_step``, ``trainer.is_global_zero``, ``trainer.latest`` ...); and the
run's folder and configuration (``trainer.run_dir``, ``trainer.run_config``,
``trainer.set_run_config``).

Each view reads the part that owns the value; none of them writes. The run folder
(:class:`~loopbus.state._run_folder.RunFolder`) writes its own files, when a stage
starts.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.to_thread

from loopbus.state._run_config import check_run_config, default_config
from loopbus.state._run_folder import RunFolder, choose_run_folder

from ..events import FitStarted, PredictStarted, Teardown, TestStarted, ValidationStarted

if TYPE_CHECKING:
    from loopbus.distributed._strategy import Strategy
    from loopbus.events import EventBus, PutRecord
    from loopbus.records._recorder import Recorder
    from loopbus.state._runstate import RunState

    from ._options import TrainerOptions

__all__ = ["RunViews"]

#: The event that starts each stage's root loop: when the run folder records a start.
_STARTS = {
    "fit": FitStarted,
    "validate": ValidationStarted,
    "test": TestStarted,
    "predict": PredictStarted,
}


class RunViews:
    """The trainer's read-only views of its run (a base of :class:`Trainer`)."""

    state: RunState
    strategy: Strategy
    recorder: Recorder
    options: TrainerOptions
    bus: EventBus
    module: Any
    _run_folder: RunFolder

    @property
    def global_step(self) -> int:
        """Optimizer steps completed (read-only; ``trainer.state.step``)."""
        return self.state.step

    @property
    def current_epoch(self) -> int:
        """The current (or last) epoch, 0-based (read-only; ``trainer.state.epoch``)."""
        return self.state.epoch

    @property
    def stage(self) -> str | None:
        """The running stage ("fit", "validate", "test", "predict"), or None."""
        return self.state.stage

    @property
    def world_size(self) -> int:
        """The number of processes of the run (1 unless launched for DDP)."""
        return self.strategy.world_size

    @property
    def global_rank(self) -> int:
        """This process's rank among all processes of the run (0 in a single process)."""
        return self.strategy.global_rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine (0 in a single process)."""
        return self.strategy.local_rank

    @property
    def is_global_zero(self) -> bool:
        """Whether this is rank 0 (always, in a single process): the process that
        writes logs and checkpoints."""
        return self.strategy.is_global_zero

    @property
    def sanity_checking(self) -> bool:
        """Whether ``fit`` is running its sanity check (see ``num_sanity_val_steps``)."""
        return self.state.sanity_checking

    @property
    def should_stop(self) -> bool:
        """Whether the running stage was asked to stop (see :meth:`request_stop`)."""
        return self.state.stop_requested

    @property
    def stop_reason(self) -> str | None:
        """Why the running (or last) stage was asked to stop, if it was."""
        return self.state.stop_reason

    @property
    def latest(self) -> dict[str, PutRecord]:
        """The last record of each name put so far, in any stage of this trainer.

        A stage keeps the records of earlier ones until it puts a record of the same
        name: after ``fit`` then ``test``, both stages' names are here (``test``'s
        value wherever both put one). Records are here once flushed: at every step
        boundary, and between two handlers of one event when the first put something
        (so a handler sees what an earlier handler of the same event put)."""
        return self.recorder.latest_records()

    @property
    def stage_latest(self) -> dict[str, PutRecord]:
        """The last record of each name put during the running (or last) stage only
        (what ``validate`` and ``test`` return, and the results table shows)."""
        return self.recorder.stage_records()

    # ------------------------------------------------------------ the run folder
    @property
    def run_dir(self) -> Path | None:
        """The run's folder, ``root_dir/name/version_N`` (the same on every rank), or
        None without ``root_dir`` (and under ``fast_dev_run``). Chosen when the trainer is
        built; it holds ``config.yaml``, ``run.json``, ``checkpoints/`` and the output of
        the file loggers given no folder of their own."""
        return self._run_folder.path

    @property
    def run_config(self) -> Mapping[str, Any] | None:
        """The run's configuration, as plain data: what :meth:`set_run_config` gave; else,
        with a run folder, ``{"trainer": <the options as given>, "model": {"class_path":
        ..., "init_args": <the module's hparams>}}``; else None. It is written to
        ``config.yaml``, carried by every checkpoint (``checkpoint_info(path)["config"]``)
        and given to the loggers as hyperparameters (None: they get the module's)."""
        folder = self._run_folder
        if folder.config is not None:
            return folder.config
        if folder.path is None:
            return None
        return default_config(self.options.given, self.module)

    def set_run_config(self, config: Mapping[str, Any]) -> None:
        """Record ``config`` (a mapping: the resolved configuration the run was made
        from, such as LightningCLI's ``{"seed_everything": ..., "trainer": {...},
        "model": {"class_path": ..., "init_args": {...}}, "data": {...}}``) as the run's
        :attr:`run_config`, from the next stage on. Values YAML and JSON cannot hold are
        kept as strings (an object as ``"module.Class"``)."""
        self._run_folder.config = check_run_config(config)

    def _init_run_folder(self) -> None:
        """Choose the run folder (rank 0 creates it; the others are told which) and,
        with one, record each stage's start in it."""
        options, strategy = self.options, self.strategy
        self._run_folder = choose_run_folder(
            None if options.fast_dev_run else options.root_dir,
            options.name,
            options.version,
            writes=strategy.is_global_zero,
            broadcast=strategy.broadcast_object if strategy.distributed else None,
        )
        if self._run_folder.writes:
            for event_type in _STARTS.values():
                self.bus.subscribe(
                    event_type, self._record_start, priority=3000, owner="Trainer.run_dir"
                )
            self.bus.subscribe(Teardown, self._record_end, priority=-3000, owner="Trainer.run_dir")

    def _record_end(self, event: Teardown) -> None:
        """A stage ended: say how in ``run.json``, when that stage's start is the one
        it describes (a small write, inline: a cancelled stage still records it)."""
        self._run_folder.record_end(
            stage=event.stage, outcome=event.reason, step=event.step, epoch=event.epoch
        )

    async def _record_start(self, event: Any) -> None:
        """A stage's root loop started: write ``run.json`` and the configuration (for
        ``fit`` once its resume is known)."""
        stage = self.state.stage
        if stage is None or type(event) is not _STARTS.get(stage):
            return  # the validation inside fit
        plan = self.state.resume if stage == "fit" else None
        step = None if plan is None else plan.step
        folder = self._run_folder
        if folder.due(step):
            record = functools.partial(
                folder.record_start,
                stage=stage,
                config=self.run_config,
                resume_step=step,
                world_size=self.strategy.world_size,
            )
            await anyio.to_thread.run_sync(record)
