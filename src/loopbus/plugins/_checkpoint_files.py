"""How the ``Checkpoint`` plugin writes: a name that never replaces a checkpoint, the
write itself (in place, in the background, or sharded over the ranks), the removal of
the checkpoints no longer kept, and the directory's ``last.json`` pointer (which every
write updates). When to save, and which checkpoints are kept, is the plugin's concern.

Written against the public API only, like a user's plugin.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread

from loopbus import (
    CheckpointError,
    Event,
    ShardedCheckpointWriter,
    ShardedSave,
    remove_checkpoint,
    remove_stale_temporaries,
    write_checkpoint,
)

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from loopbus import Trainer

__all__ = ["CheckpointFiles"]


class CheckpointFiles:
    """The checkpoint files of one ``Checkpoint`` plugin, in ``dirpath``.

    At most one save is in flight: :meth:`save` is called only after :meth:`wait_idle`,
    which raises the failure of a background save. The event that announces a save
    (``CheckpointSaved``) is published once its file is durable: at once for a save the
    step waited for; for a background save from the run's own path, by
    :meth:`announce`, since a background task must not publish."""

    def __init__(self, dirpath: Path) -> None:
        self.dirpath = dirpath
        self._writer = ShardedCheckpointWriter()
        # Per stage: the background save in flight, its failure, and its announcement.
        self._idle: anyio.Event | None = None
        self._error: BaseException | None = None
        self.unannounced: Event | None = None

    def reset(self) -> None:
        """Forget the previous stage's saves."""
        self._error = None
        self._idle = None
        self.unannounced = None

    def prepare(self) -> None:
        """Create the directory and remove the temporaries that dead writers left in it.
        Rank 0 alone writes, so it alone calls this; a temporary written on another host
        (a shared directory) is left alone, its writer's pid means nothing here."""
        try:
            self.dirpath.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(
                f"Checkpoint cannot create its directory {self.dirpath}: {exc}"
            ) from exc
        remove_stale_temporaries(self.dirpath)

    def free_name(self, trainer: Trainer, stem: str, known: set[str]) -> str:
        """``<stem>.ckpt``, or ``<stem>-v<N>.ckpt`` with the smallest N whose name is free:
        a save never replaces a checkpoint (in ``dirpath``, or one of the ``known`` names
        the plugin recorded). Rank 0 looks (the previous save is complete there); every
        rank takes its answer."""
        name: str | None = None
        if trainer.is_global_zero:
            name = f"{stem}.ckpt"
            version = 0
            while name in known or os.path.lexists(self.dirpath / name):
                version += 1
                name = f"{stem}-v{version}.ckpt"
        if trainer.world_size > 1:
            name = trainer.strategy.broadcast_object(name)
        assert name is not None
        return name

    async def wait_idle(self) -> None:
        """Wait for the save in flight; raise its failure, if it failed."""
        idle = self._idle
        if idle is not None:
            await idle.wait()
            self._idle = None
        error, self._error = self._error, None
        if error is not None:
            raise CheckpointError(
                f"a background checkpoint save into {self.dirpath} failed: "
                f"{type(error).__name__}: {error}"
            ) from error

    async def announce(self, trainer: Trainer | None) -> None:
        """Publish the announcement of the last background save, once."""
        saved, self.unannounced = self.unannounced, None
        if saved is not None and trainer is not None:
            await trainer.publish(saved)

    async def save(
        self,
        trainer: Trainer,
        name: str,
        evicted: list[str],
        saved: Event,
        *,
        background: bool,
        sharded: bool,
        task_group: TaskGroup | None,
    ) -> None:
        """Save the run as ``name``, then remove the ``evicted`` checkpoints and publish
        ``saved``. Called on every rank, at the same boundary."""
        if sharded:
            await self._save_sharded(trainer, name, evicted, saved, background, task_group)
            return
        # Every rank takes the state (under DDP that gathers every rank's generators);
        # rank 0 alone writes it.
        if background and task_group is not None:
            state = trainer.state_dict(to_host=True)
            if not trainer.is_global_zero:
                return
            self._idle = anyio.Event()
            task_group.start_soon(
                self._write_in_background, state, name, evicted, self._idle, saved
            )
        else:
            # The step waits, but the event loop stays free for other tasks meanwhile.
            state = trainer.state_dict()
            if not trainer.is_global_zero:
                return
            await anyio.to_thread.run_sync(self._write, state, name, evicted)
            await trainer.publish(saved)

    async def _save_sharded(
        self,
        trainer: Trainer,
        name: str,
        evicted: list[str],
        saved: Event,
        background: bool,
        task_group: TaskGroup | None,
    ) -> None:
        """Every rank writes its shards; rank 0 completes the checkpoint once all have.
        In the background the step waits only for the staging to host memory."""
        pending = self._writer.save(
            trainer, self.dirpath / name, asynchronous=background, update_last=True
        )
        if background and task_group is not None:
            self._idle = anyio.Event()
            task_group.start_soon(self._finish_sharded, pending, evicted, self._idle, saved)
            return
        await self._finish_sharded(pending, evicted, None, saved)
        if self._error is not None:
            await self.wait_idle()  # raises it
        await self.announce(trainer)

    async def _finish_sharded(
        self,
        pending: ShardedSave,
        evicted: list[str],
        done: anyio.Event | None,
        saved: Event,
    ) -> None:
        try:
            await anyio.to_thread.run_sync(pending.wait)
            if pending.writer_rank:
                for old in evicted:
                    if old != pending.path.name:
                        remove_checkpoint(self.dirpath / old)
                self.unannounced = saved  # published from the run's own path (announce)
        except Exception as exc:  # raised at the next save, or when fit ends
            self._error = exc
        finally:
            if done is not None:
                done.set()

    def _write(self, state: dict[str, Any], name: str, evicted: list[str]) -> None:
        write_checkpoint(state, self.dirpath / name, update_last=True)
        for old in evicted:
            if old != name:
                remove_checkpoint(self.dirpath / old)

    async def _write_in_background(
        self,
        state: dict[str, Any],
        name: str,
        evicted: list[str],
        done: anyio.Event,
        saved: Event,
    ) -> None:
        try:
            await anyio.to_thread.run_sync(self._write, state, name, evicted)
            self.unannounced = saved  # published from the run's own path (announce)
        except Exception as exc:  # raised at the next save, or when fit ends
            self._error = exc
        finally:
            done.set()
