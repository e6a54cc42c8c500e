"""What a trainer shows of its run: read-only views of the run's state, the strategy's
ranks and the latest records, as the attributes Lightning users know
(``trainer.global_step``, ``trainer.is_global_zero``, ``trainer.latest`` ...).

Each view reads the part that owns the value; none of them writes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loopbus.distributed._strategy import Strategy
    from loopbus.events import PutRecord
    from loopbus.records._recorder import Recorder
    from loopbus.state._runstate import RunState

__all__ = ["RunViews"]


class RunViews:
    """The trainer's read-only views of its run (a base of :class:`Trainer`)."""

    state: RunState
    strategy: Strategy
    recorder: Recorder

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
