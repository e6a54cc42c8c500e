"""How the ``Checkpoint`` plugin writes: a name that never replaces a checkpoint, the
write itself (in place, in the background, or sharded over the ranks), the removal of
the checkpoints no longer kept, and the directory's ``last.json`` pointer (which every
write updates). When to save, and which checkpoints are kept, is the plugin's concern.

Written against the public API only, like a user's plugin.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.to_thread
from torch.autograd.profiler import record_function

from loopbus import (
    CheckpointError,
    Event,
    MisconfigurationError,
    RemotePath,
    is_sharded_checkpoint,
    latest_checkpoint,
    profiling_ranges,
    remove_checkpoint,
    remove_incomplete_checkpoints,
    write_checkpoint,
)
from loopbus.storage import (
    FolderLease,
    Storage,
    StoreDeadlines,
    folder_lease,
    open_location,
    store_for,
)

from ._checkpoint_uploads import Uploads

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from loopbus import ShardedCheckpointWriter, ShardedSave, TrainerView

__all__ = [
    "CheckpointFiles",
    "callable_path",
    "check_filename",
    "in_run_folder",
    "latest_in",
    "open_folder",
    "ranged",
]

#: The names of checkpoint files (others count when they have a completeness marker).
_SUFFIXES = (".ckpt", ".pt", ".pth")
_MARKER = ".complete"
_POINTER = "last.json"


def in_run_folder(files: CheckpointFiles, trainer: TrainerView) -> CheckpointFiles:
    """``files``; given no ``dirpath``, writing into the ``checkpoints/`` folder of
    ``trainer``'s run folder (``trainer.run_dir``) from now on: an error without one."""
    if files.dirpath is None:
        run_dir = trainer.run_dir
        if run_dir is None:
            raise MisconfigurationError(
                "Checkpoint() was given no dirpath and the trainer has no run folder to "
                "write into: pass Checkpoint(dirpath='checkpoints'), or give the trainer one "
                "with Trainer(root_dir='runs') (checkpoints then go to "
                "runs/<name>/version_N/checkpoints)."
            )
        files.dirpath = Path(os.fspath(run_dir)) / "checkpoints"
    return files


def latest_in(files: CheckpointFiles) -> Path | RemotePath | None:
    """The newest checkpoint in ``files.dirpath``, looked up now (None before the folder
    is known); ``files.last`` says it from now on."""
    files.last = None if files.dirpath is None else latest_checkpoint(files.dirpath)
    return files.last


def check_filename(filename: str) -> None:
    """``filename`` must be a template of a plain file name, with the fields ``{epoch}``
    and ``{step}`` at most."""
    try:
        example = filename.format(epoch=0, step=0)
    except (KeyError, IndexError, ValueError, AttributeError) as exc:
        raise MisconfigurationError(
            f"Checkpoint(filename={filename!r}) is not a valid template: {exc!r}; use the "
            "fields {epoch} and {step}, for example 'epoch={epoch}-step={step}'."
        ) from None
    if not example or "/" in example or os.sep in example or example.startswith("."):
        raise MisconfigurationError(
            f"Checkpoint(filename={filename!r}) must make a plain file name (no "
            "directory separators, not starting with a dot)."
        )


def ranged(name: str) -> contextlib.AbstractContextManager[object]:
    """The profiler range ``name`` while the engine's ranges are on
    (``loopbus.profiling_ranges``), else nothing."""
    return record_function(name) if profiling_ranges() else contextlib.nullcontext()


class CheckpointFiles:
    """The checkpoint files of one ``Checkpoint`` plugin, in ``dirpath``.

    At most one save is in flight: :meth:`save` is called only after :meth:`wait_idle`,
    which raises the failure of a background save. The event that announces a save
    (``CheckpointSaved``) is published once its file is durable: at once for a save the
    step waited for; for a background save from the run's own path, by
    :meth:`announce`, since a background task must not publish."""

    def __init__(
        self, dirpath: Path | RemotePath | None, *, retries: int = 3, on_error: str = "warn"
    ) -> None:
        self.dirpath = dirpath  # None: the run folder's (in_run_folder)
        #: A URL's saves: each upload tried ``retries`` more times; a failed one warned
        #: about (``on_error="warn"``) or raised (``"raise"``).
        self.retries = retries
        self.on_error = on_error
        #: Checkpoints no longer kept whose removal has not happened yet (the save that
        #: evicted them is in flight or failed, or their removal did): removed after the
        #: next save, or when a resumed run takes the folder. Part of the plugin's state.
        self._unremoved: list[str] = []
        #: The newest checkpoint known complete: the last this plugin saved, or the one
        #: a fit resumed from (None: none yet).
        self.last: Path | RemotePath | None = None
        self._uploads: Uploads | None = None  #: a URL's, in this fit
        #: A URL's names in use (objects and prefixes), listed once a fit, then kept up
        #: to date by this plugin's own saves (None: not listed yet).
        self._names: set[str] | None = None
        #: The sharded writer, made at the first sharded save (its module loads then).
        self._writer: ShardedCheckpointWriter | None = None
        self._lease: FolderLease | None = None  #: rank 0's on ``dirpath``, while a fit writes
        self._stored: tuple[object, Storage] | None = None  #: ``dirpath`` and its store
        # Per stage: the background save in flight, its failure, and its announcement.
        self._idle: anyio.Event | None = None
        self._error: BaseException | None = None
        self.unannounced: Event | None = None

    def reset(self) -> None:
        """Forget the previous stage's saves."""
        self._error = None
        self._idle = None
        self.unannounced = None
        self._names = None
        # A store that uploads (no rename) has its saves retried and waited for.
        self._uploads = Uploads(self.dirpath, self.retries) if self.remote else None  # type: ignore[arg-type]

    def _store(self) -> Storage:
        """The store of ``dirpath`` (made again when ``dirpath`` changes)."""
        if self._stored is None or self._stored[0] is not self.dirpath:
            assert self.dirpath is not None
            self._stored = (self.dirpath, store_for(self.dirpath))
        return self._stored[1]

    @property
    def unremoved(self) -> list[str]:
        """The checkpoints no longer kept that are not removed yet (their names)."""
        return list(self._unremoved)

    def remove_later(self, names: list[str], *, keep: set[str] | None = None) -> None:
        """Remove the checkpoints ``names`` but those to ``keep`` (no longer kept; recorded
        in a checkpoint this run resumes from) when a resumed fit takes the folder, or
        after the next save."""
        later = [str(name) for name in names if name not in (keep or set())]
        self._unremoved = list(dict.fromkeys([*self._unremoved, *later]))

    @property
    def remote(self) -> bool:
        """Whether ``dirpath``'s store writes its entries in place, whole only once
        their marker is written (a URL: an object store), rather than renaming them into
        place: its saves are uploads, retried and waited for."""
        return self.dirpath is not None and not self._store().whole_without_marker()

    def _taken(self) -> set[str]:
        """The names in use in the remote ``dirpath``: listed at the fit's first look
        (its claim of the folder, on rank 0), then those this plugin saved added. None
        is listed while the store cannot be reached (the upload's retries deal with it;
        it is listed again at the next save, and a name this plugin recorded is never
        reused)."""
        if self._names is None:
            try:
                objects, prefixes = self._contents()
            except Exception:
                return set()
            self._names = set(objects) | prefixes
        return self._names

    def _contents(self) -> tuple[dict[str, int], set[str]]:
        """``dirpath``'s entries (name -> size) and subdirectories (sharded checkpoints
        are subdirectories, prefixes in an object store)."""
        return self._store().contents()

    def prepare(self) -> None:
        """Create the directory and remove the temporaries that dead writers left in it.
        Rank 0 alone writes, so it alone calls this; a temporary written on another host
        (a shared directory) is left alone, its writer's pid means nothing here."""
        store = self._store()
        try:
            store.make_directory()  # an object store needs none
        except OSError as exc:
            raise CheckpointError(
                f"Checkpoint cannot create its directory {self.dirpath}: {exc}"
            ) from exc
        store.remove_stale_temporaries()  # an object store has none
        if self.remote:  # the names in use are listed now, off the training step
            self._names = None
            self._taken()

    def remove_stale(self) -> None:
        """Remove the temporaries that dead writers left in ``dirpath``, if it exists (a
        stage's start, on rank 0, before anything is decided about the folder: they were
        never checkpoints)."""
        if self.dirpath is not None:
            self._store().remove_stale_temporaries()  # none in a missing directory

    def claim(self, trainer: TrainerView, *, resumes_here: bool, exist_ok: bool) -> None:
        """Before this plugin first writes into ``dirpath``: take its lease (held until
        :meth:`release`); refuse (``MisconfigurationError``, nothing written) when another
        run holds it, or holds checkpoints there, unless the run resumes from them or
        ``exist_ok``; then :meth:`prepare`. Rank 0 looks; every rank raises the same."""
        refusal: str | None = None
        if trainer.is_global_zero:  # rank 0 alone holds the lease: its job's one writer
            self._lease, refusal = _leased(self.dirpath, self._store().shown, self.retries)
            if refusal is None and not (resumes_here or exist_ok):
                refusal = self._refusal()  # a refused fit releases the lease as it ends
        if trainer.world_size > 1:
            refusal = trainer.strategy.broadcast_object(refusal)
        if refusal is not None:
            raise MisconfigurationError(refusal)
        if trainer.is_global_zero:  # rank 0 alone writes
            if resumes_here and self.remote:
                # The run that wrote here is over (this one resumes it): what its
                # writers left incomplete goes, so that no orphaned objects stay.
                try:
                    remove_incomplete_checkpoints(self.dirpath, retries=self.retries)
                except Exception as exc:  # harmless leftovers: said, and the run goes on
                    warnings.warn(
                        f"could not remove the incomplete checkpoints in {self.dirpath}: "
                        f"{type(exc).__name__}: {exc}",
                        UserWarning,
                        stacklevel=2,
                    )
            self.prepare()
            if resumes_here:  # what the run resumed evicted, its removal cut short by a kill
                self._evict(None, [])
        if not resumes_here:
            self._unremoved = []  # recorded of another folder

    def release(self) -> None:
        """Give up the lease on ``dirpath``, if held (when the fit ends, however)."""
        if self._lease is not None:
            self._lease.release()

    def holds(self, path: str | os.PathLike[str]) -> bool:
        """Whether ``path`` (a checkpoint file or sharded directory) is in ``dirpath``."""
        return self._store().holds(path)

    def has(self, names: set[str]) -> bool:
        """Whether ``dirpath`` holds a checkpoint of one of these ``names``."""
        objects, prefixes = self._contents()
        return bool(names & (set(objects) | prefixes))

    def found(self) -> list[Path]:
        """The checkpoints (files, sharded directories, ``last.json``) in ``dirpath``."""
        store = self._store()
        try:
            objects, prefixes = store.contents()
        except OSError as exc:
            raise CheckpointError(f"Checkpoint cannot list {self.dirpath}: {exc}") from exc
        return [
            Path(name)  # a name, for the message
            for name in sorted(set(objects) | prefixes)
            if not name.startswith(".") and _is_checkpoint(store, name, objects, prefixes)
        ]

    def _mtime(self, name: str) -> float:
        """When the entry ``name`` was last modified, where the store says so cheaply."""
        try:
            return self._store().modified(name) or 0.0
        except OSError:
            return 0.0

    def _refusal(self) -> str | None:
        found = self.found()
        if not found:
            return None
        checkpoints = [p for p in found if p.name != _POINTER] or found
        newest = max(checkpoints, key=lambda p: (self._mtime(p.name), str(p))).name
        d = str(self.dirpath)
        return (
            f"Checkpoint({d!r}) will not start: {d} already holds {len(checkpoints)} "
            f"checkpoint(s) of another run (newest: {newest}), which this run's would be "
            "mixed with (and its last.json replaced). Resume that run: "
            "trainer.fit(..., ckpt_path='last'); or add this run's checkpoints to the "
            f"folder: Checkpoint({d!r}, exist_ok=True); or choose another folder."
        )

    def free_name(self, trainer: TrainerView, stem: str, known: set[str]) -> str:
        """``<stem>.ckpt``, or ``<stem>-v<N>.ckpt`` with the smallest N whose name is free:
        a save never replaces a checkpoint (in ``dirpath``, or one of the ``known`` names
        the plugin recorded). Rank 0 looks (the previous save is complete there); every
        rank takes its answer, or raises the ``CheckpointError`` of a lease lost since."""
        name: str | None = None
        lost = _lost(self._lease) if trainer.is_global_zero else None
        if trainer.is_global_zero:
            # An object store's names are listed once a fit (each call costs); a
            # directory's are looked at each time.
            taken = self._taken() if self.remote else None
            exists = taken.__contains__ if taken is not None else self._store().exists
            name = f"{stem}.ckpt"
            version = 0
            while name in known or exists(name):
                version += 1
                name = f"{stem}-v{version}.ckpt"
            if self._names is not None:
                self._names.add(name)
        if trainer.world_size > 1:
            name, lost = trainer.strategy.broadcast_object((name, lost))
        if lost is not None:
            raise CheckpointError(lost)
        assert name is not None
        return name

    async def ready(self, trainer: TrainerView, *, final: bool = False) -> bool:
        """Whether the save now due may start: not where another job of the run writes
        it (``strategy.writes_checkpoints()``: a fault-tolerant replica group's peer);
        see ``Uploads.ready`` (a URL's save in flight is waited for at most
        ``save_wait_s``, not at all while the store fails; whole before the ``final``
        save). A local save in flight is waited for by :meth:`wait_idle`."""
        if not trainer.strategy.writes_checkpoints():
            return False
        uploads = self._uploads
        return True if uploads is None else await uploads.ready(trainer, self._idle, final=final)

    def ending(self) -> None:
        """The fit ends: if the store is in an outage now, the upload in flight stops
        retrying (``fit`` does not wait through the tries of a store that is down; the
        outage's warning says the last save was lost)."""
        health = None if self.dirpath is None else self._store().health
        if health is not None:
            health.give_up()

    async def wait_idle(self) -> None:
        """Wait for the save in flight; raise its failure, if it failed."""
        idle = self._idle
        if idle is not None:
            await idle.wait()
            self._idle = None
        error, self._error = self._error, None
        uploads = self._uploads
        if uploads is not None and idle is not None and error is None:
            uploads.succeeded()
        if error is not None and uploads is not None and self.on_error == "warn":
            uploads.failed(error)  # said once an outage, with its cause and length
        elif error is not None:
            raise CheckpointError(
                f"a background checkpoint save into {self.dirpath} failed: "
                f"{type(error).__name__}: {error}"
            ) from error

    async def announce(self, trainer: TrainerView | None) -> None:
        """Publish the announcement of the last background save, once."""
        saved, self.unannounced = self.unannounced, None
        if saved is not None and trainer is not None:
            await trainer.publish(saved)

    async def save(
        self,
        trainer: TrainerView,
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
        self.remove_later([old for old in evicted if old != name])  # in the state taken
        if sharded:
            await self._save_sharded(trainer, name, evicted, saved, background, task_group)
            return
        # Every rank takes the state (under DDP that gathers every rank's generators);
        # rank 0 alone writes it.
        if background and task_group is not None:
            state = trainer.state_dict(to_host=True)
            if not trainer.is_global_zero:
                self.last = self.dirpath / name  # rank 0 writes it
                return
            self._idle = anyio.Event()
            if self._uploads is not None:
                self._uploads.began()
            task_group.start_soon(
                self._write_in_background, state, name, evicted, self._idle, saved
            )
        else:
            # The step waits, but the event loop stays free for other tasks meanwhile.
            state = trainer.state_dict()
            if not trainer.is_global_zero:
                self.last = self.dirpath / name  # rank 0 writes it
                return
            await anyio.to_thread.run_sync(self._write, state, name, evicted)
            self.last = self.dirpath / name
            await trainer.publish(saved)

    async def _save_sharded(
        self,
        trainer: TrainerView,
        name: str,
        evicted: list[str],
        saved: Event,
        background: bool,
        task_group: TaskGroup | None,
    ) -> None:
        """Every rank writes its shards; rank 0 completes the checkpoint once all have.
        In the background the step waits only for the staging to host memory."""
        if self._writer is None:
            from loopbus import ShardedCheckpointWriter  # (its module loads on first use)

            self._writer = ShardedCheckpointWriter()
        pending = self._writer.save(
            trainer,
            self.dirpath / name,
            asynchronous=background,
            update_last=True,
            fresh=True,  # free_name chose it
            retries=self.retries,
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
            self.last = pending.path
            if pending.writer_rank:
                await anyio.to_thread.run_sync(self._evict, pending.path.name, evicted)
                self.unannounced = saved  # published from the run's own path (announce)
        except Exception as exc:  # raised at the next save, or when fit ends
            self._error = exc
        finally:
            if done is not None:
                done.set()

    def _evict(self, name: str | None, evicted: list[str]) -> None:
        """After the save of ``name`` (None: when a resumed run takes the folder): remove
        the checkpoints no longer kept (``evicted`` and those a kill, a failed save or
        removal left for later); what cannot be removed now is removed later."""
        pending = [o for o in dict.fromkeys(self._unremoved + evicted) if o != name]
        self._unremoved = []
        with ranged("loopbus.checkpoint.evict"):
            for old in pending:
                try:
                    remove_checkpoint(self.dirpath / old, retries=self.retries)
                except Exception:
                    if not self.remote:
                        raise
                    self._unremoved.append(old)

    def _write(self, state: dict[str, Any], name: str, evicted: list[str]) -> None:
        """Write ``name`` (local: ``loopbus.checkpoint.write``; a URL's: serialised, then
        uploaded: ``loopbus.checkpoint.upload``), then remove what is no longer kept.
        A failed save removes nothing: that is left for the next one."""
        with ranged("loopbus.checkpoint.write" if not self.remote else "loopbus.checkpoint.upload"):
            write_checkpoint(state, self.dirpath / name, update_last=True, retries=self.retries)
        self._evict(name, evicted)

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
            self.last = self.dirpath / name
            self.unannounced = saved  # published from the run's own path (announce)
        except Exception as exc:  # raised at the next save, or when fit ends
            self._error = exc
        finally:
            done.set()


def _leased(dirpath: Path | RemotePath, shown: str, retries: int) -> tuple[FolderLease, str | None]:
    """The lease on ``dirpath`` (shown as ``shown``; see ``loopbus.storage.folder_lease``),
    taken, and None; or, when another run holds it, the refusal that names that run."""
    lease = folder_lease(dirpath, owner=f"Checkpoint({shown!r})", retries=retries)
    try:
        lease.acquire()
    except MisconfigurationError as exc:
        return lease, str(exc)
    return lease, None


def _lost(lease: FolderLease | None) -> str | None:
    """Why the ``lease`` this run held was lost since (a ``CheckpointError``'s message),
    or None."""
    try:
        if lease is not None:
            lease.check()
    except CheckpointError as exc:
        return str(exc)
    return None


def open_folder(
    dirpath: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None,
    store_deadlines: StoreDeadlines | Mapping[str, float] | None = None,
) -> Path | RemotePath:
    """The plugin's ``dirpath``, checked: a URL (s3://bucket/run, any fsspec URL) with its
    storage options, deadlines and a health of its own, or a local path; the storage
    package tells the one from the other."""
    return open_location(
        dirpath,
        storage_options=storage_options,
        store_deadlines=store_deadlines,
        owner="Checkpoint",
    )


def _is_checkpoint(store: Storage, name: str, objects: dict[str, int], prefixes: set[str]) -> bool:
    """Whether the entry ``name`` of ``store`` (of these ``objects`` and ``prefixes``) is a
    checkpoint: a file of a checkpoint's name, the pointer, or one with its completeness
    marker; a directory that a rename published (it is there whole) and that holds a
    sharded checkpoint (in an object store, a prefix needs its marker)."""
    if name.endswith(_MARKER):
        return False
    if name in prefixes and store.whole_without_marker():
        return is_sharded_checkpoint(store.path(name))
    return name == _POINTER or name.endswith(_SUFFIXES) or name + _MARKER in objects


class _CallablePath(type(Path())):  # type: ignore[misc]
    """A path that can still be called as ``last_checkpoint_path()`` was (deprecated)."""

    def __call__(self) -> Path:
        warnings.warn(
            "Checkpoint.last_checkpoint_path is a property now, like best_checkpoint_path: "
            "write checkpoint.last_checkpoint_path without the call.",
            DeprecationWarning,
            stacklevel=2,
        )
        return Path(self)


def callable_path(path: Path | RemotePath | None) -> Path | RemotePath | None:
    """``path``, a local one callable as ``last_checkpoint_path()`` was (deprecated)."""
    return _CallablePath(path) if isinstance(path, Path) else path
