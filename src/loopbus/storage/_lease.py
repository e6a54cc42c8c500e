"""One writer per checkpoint folder: a lease that a run takes on its folder before it
writes there and holds until it ends, so that a second run writing into the same folder
at the same time (a second launch, an orphaned worker of a killed launcher) is refused
instead of mixing its checkpoints and ``last.json`` with the first's.

Two kinds behind one interface, :class:`FolderLease`, made by :func:`folder_lease`:

* a local folder: an OS lock (``flock``) on the file ``.loopbus-lease`` in it, which
  also holds the holder's host, process id and start time. The system releases the lock
  when the process ends, however it ends: a lock never goes stale.
* an object store (a URL): the object ``.loopbus-lease``, created only if there is none
  (S3's conditional write, ``If-None-Match: *``) and renewed by a heartbeat thread
  every quarter of its time to live (``If-Match`` its last version); a lease not renewed
  for its time to live (its run died) is taken over, with a warning naming the old
  holder.

Imports the base layer, the standard library and :mod:`._store`.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .._exceptions import CheckpointError, MisconfigurationError
from ._advice import fix_for, missing_bucket, not_retried
from ._store import RemotePath, Store

try:
    import fcntl
except ImportError:  # no flock (Windows): a local folder is not locked
    fcntl = None  # type: ignore[assignment]

__all__ = ["LEASE_NAME", "LEASE_TTL_S", "FolderLease", "folder_lease"]

#: The lease's file (local) or object (a URL) in the folder it locks.
LEASE_NAME = ".loopbus-lease"
#: How long an object-store lease lives without renewal, in seconds; renewed every
#: quarter of it.
LEASE_TTL_S = 60.0


def _holder(ttl_s: float | None) -> dict[str, Any]:
    """What a lease says about its holder: this process, now."""
    now = time.time()
    record: dict[str, Any] = {
        "host": socket.gethostname() or "localhost",
        "pid": os.getpid(),
        "started": datetime.fromtimestamp(now, UTC).isoformat(timespec="seconds"),
        "token": uuid.uuid4().hex,
    }
    if ttl_s is not None:
        record |= {"pid_namespace": _pid_namespace(), "ttl_s": ttl_s, "renewed": now}
    return record


def _pid_namespace() -> str:
    """Which processes this one's pid is counted among ("" where unknown): containers
    that share a host name (host networking) have namespaces of their own."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _parse(data: bytes) -> dict[str, Any] | None:
    try:
        record = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _who(record: dict[str, Any] | None) -> str:
    """The holder in words: ``process 4242 on host gpu-7, started 2026-...``."""
    if record is None:
        return "a process that has not written its details yet (or not in loopbus's format)"
    same = record.get("pid") == os.getpid() and record.get("host") == socket.gethostname()
    return (
        f"process {record.get('pid')!r} on host {record.get('host')!r}, started "
        f"{record.get('started')!r}" + (" (this process: another trainer in it)" if same else "")
    )


class FolderLease:
    """The lease on one checkpoint folder: :meth:`acquire` takes it (or raises
    :class:`~loopbus.MisconfigurationError` naming the run that holds it and what to
    do), :meth:`check` raises :class:`~loopbus.CheckpointError` if it was lost since,
    :meth:`release` gives it up (and never raises). Acquiring a lease held already is a
    no-op; it can be acquired again after a release."""

    def __init__(self, directory: Path | RemotePath, *, owner: str = "") -> None:
        self.directory = directory
        #: The folder as messages show it (a URL without a user name or password).
        self.where = directory.public_url if isinstance(directory, RemotePath) else str(directory)
        self.owner = owner or f"the checkpoint folder {self.where!r}"

    @property
    def held(self) -> bool:
        """Whether this process holds the lease through this object."""
        raise NotImplementedError

    def acquire(self) -> None:
        raise NotImplementedError

    def check(self) -> None:
        """Raise :class:`~loopbus.CheckpointError` if the lease, held, was lost since."""

    def release(self) -> None:
        raise NotImplementedError

    def _refused(self, holder: dict[str, Any] | None, remedy: str) -> MisconfigurationError:
        d = self.where
        return MisconfigurationError(
            f"{self.owner} will not start: another run is writing checkpoints into {d} "
            f"now: {_who(holder)}; it holds the folder's lease ({LEASE_NAME}). Two runs in "
            f"one folder would mix their checkpoints and last.json. Wait for it to end, stop "
            f"it (an orphaned torchrun worker goes on after its launcher is killed), or "
            f"choose another folder (fault-tolerant replica groups each need a folder of "
            f"their own). {remedy}"
        )


class LocalLease(FolderLease):
    """The lease on a local folder: an exclusive ``flock`` on its ``.loopbus-lease``
    file, which holds the holder's details while it is held and is deleted when it is
    released. The system drops the lock when the process ends."""

    def __init__(self, directory: Path, *, owner: str = "") -> None:
        super().__init__(directory, owner=owner)
        self.path = directory / LEASE_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        if self._fd is not None or fcntl is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"{self.owner} cannot create {self.path.parent}: {exc}") from exc
        for _ in range(20):  # the file was deleted by a holder releasing it: again
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise CheckpointError(f"{self.owner} cannot open {self.path}: {exc}") from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _read_locked(fd)
                os.close(fd)
                raise self._refused(
                    holder, "The lock goes with its process: there is nothing to delete by hand."
                ) from None
            if _same_file(fd, self.path):
                record = json.dumps(_holder(None)).encode()
                os.ftruncate(fd, 0)
                os.pwrite(fd, record, 0)
                self._fd = fd
                return
            os.close(fd)
        raise CheckpointError(f"{self.owner} could not lock {self.path}: it kept being replaced.")

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        with contextlib.suppress(OSError):
            if _same_file(fd, self.path):
                self.path.unlink()  # under the lock: a waiting opener sees it gone
        os.close(fd)


def _same_file(fd: int, path: Path) -> bool:
    """Whether the open ``fd`` is still the file at ``path`` (not one deleted since)."""
    try:
        here, there = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def _read_locked(fd: int) -> dict[str, Any] | None:
    """The details in a lease file another process holds (it writes them just after it
    locks: looked at a few times)."""
    for _ in range(10):
        with contextlib.suppress(OSError):
            record = _parse(os.pread(fd, 4096, 0))
            if record is not None:
                return record
        time.sleep(0.02)
    return None


class RemoteLease(FolderLease):
    """The lease on a folder of an object store: the object ``.loopbus-lease``, renewed
    by a daemon thread every ``ttl_s / 4`` seconds. Another run takes it over once it
    has not been renewed for ``ttl_s`` seconds (by the clock of the host that looks: the
    hosts' clocks should agree to well within ``ttl_s``)."""

    def __init__(
        self,
        directory: RemotePath,
        *,
        owner: str = "",
        ttl_s: float = LEASE_TTL_S,
        retries: int = 0,
    ) -> None:
        super().__init__(directory, owner=owner)
        if not ttl_s > 0:
            raise MisconfigurationError(f"a lease's ttl_s must be > 0 seconds, got {ttl_s!r}.")
        self.ttl_s = float(ttl_s)
        self.retries = retries
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: Store | None = None
        # Shared with the heartbeat (under _lock): the lease's version and details, and
        # what took it.
        self._tag: str | None = None
        self._record: dict[str, Any] = {}
        self._lost: str | None = None

    @property
    def held(self) -> bool:
        return self._thread is not None

    def acquire(self) -> None:
        if self._thread is not None:
            return
        self._store = store = Store(self.directory, retries=self.retries)  # type: ignore[arg-type]
        record = _holder(self.ttl_s)
        tag = self._take(store, record)
        with self._lock:
            self._tag, self._record = tag, record
            self._lost = None
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._beat, name=f"loopbus-lease {self.where}", daemon=True
        )
        self._thread.start()

    def _take(self, store: Store, record: dict[str, Any]) -> str:
        """Create the lease object, or take over an expired one; the new version's tag.
        A store out of reach is tried again ``retries`` times."""
        data = json.dumps(record).encode()
        failures = 0
        for _ in range(3 + self.retries):
            try:
                taken = self._attempt(store, data)
            except MisconfigurationError:
                raise
            except FileNotFoundError as exc:  # its creation: the bucket is not there
                raise CheckpointError(
                    f"{self.owner} cannot write into {self.where}: {missing_bucket(self.where)}."
                ) from exc
            except Exception as exc:
                failures += 1
                if failures > self.retries or not_retried(exc):
                    raise CheckpointError(
                        f"{self.owner} could not take the lease on {self.where}: "
                        f"{type(exc).__name__}: {' '.join(str(exc).split())}; "
                        f"{fix_for(exc, self.where)}."
                    ) from exc
                continue
            if taken is not None:
                return taken
        raise CheckpointError(
            f"{self.owner} could not take the lease on {self.where}: it kept changing "
            "while this run tried (several runs starting at once?). Start this run again."
        )

    def _attempt(self, store: Store, data: bytes) -> str | None:
        """One try of :meth:`_take`: the tag, or None when the lease changed meanwhile."""
        try:
            return store.write_if(LEASE_NAME, data, tag=None)
        except FileExistsError:
            pass
        try:
            current, tag = store.read_tagged(LEASE_NAME)
        except FileNotFoundError:
            return None  # released meanwhile: create it again
        holder = _parse(current)
        left = _left_s(holder)
        if left > 0 and not _gone(holder):
            raise self._refused(
                holder,
                f"Its lease expires in {left:.0f} s unless renewed (its run renews it while "
                "it lives); the lease of a run that died is taken over once it expires (at "
                "once from the same host).",
            )
        try:
            taken = store.write_if(LEASE_NAME, data, tag=tag)
        except (FileExistsError, FileNotFoundError):
            return None  # another run moved first: look again
        if left <= 0:  # its run is presumed dead; one gone from this host is known to be
            warnings.warn(
                f"{self.owner}: took over the expired lease on {self.where} of "
                f"{_who(holder)}, not renewed for {_ttl(holder) - left:.0f} s: its run is "
                "taken to have died.",
                UserWarning,
                stacklevel=5,
            )
        return taken

    def _beat(self) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            if not self._renew():
                return

    def _renew(self) -> bool:
        """Renew the lease once (the heartbeat); False when it was lost (renewing is
        over)."""
        store = self._store
        assert store is not None
        with self._lock:
            tag, record = self._tag, dict(self._record, renewed=time.time())
        try:
            new = store.write_if(LEASE_NAME, json.dumps(record).encode(), tag=tag)
        except (FileExistsError, FileNotFoundError):
            holder: dict[str, Any] | None = None
            with contextlib.suppress(Exception):
                holder = _parse(store.read_tagged(LEASE_NAME)[0])
            with self._lock:
                self._lost = (
                    "it was removed" if holder is None else f"it was taken over by {_who(holder)}"
                )
            return False
        except Exception:  # the store is out of reach: tried again at the next beat
            return True
        with self._lock:
            self._tag, self._record = new, record
        return True

    def check(self) -> None:
        """Raise :class:`~loopbus.CheckpointError` if the heartbeat found the lease taken
        over (or removed). It does not wait on the store: while the store is out of
        reach the lease counts as held (the writes fail by themselves), and a takeover is
        known at the first renewal after it."""
        if self._thread is None:
            return
        with self._lock:
            lost = self._lost
        if lost is not None:
            raise CheckpointError(
                f"{self.owner} lost its lease on {self.where}: {lost}. This run stops "
                "writing there, so that two runs' checkpoints are not mixed; resume it "
                "(ckpt_path='last') once the other run is over, or in another folder."
            )

    def release(self) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._stop.set()
        thread.join(timeout=30)
        store = self._store
        with self._lock:
            tag, lost = self._tag, self._lost
        if store is None or lost is not None:
            return
        # One that cannot be removed now (the store is out of reach) expires by itself.
        with contextlib.suppress(Exception):
            if store.read_tagged(LEASE_NAME)[1] == tag:
                store.remove(LEASE_NAME)


def _gone(holder: dict[str, Any] | None) -> bool:
    """Whether the holder ran on this host, among this process's pids (not in another
    container), in another process that no longer runs (a run killed on this host: its
    lease need not expire first)."""
    if holder is None or os.name != "posix" or holder.get("host") != socket.gethostname():
        return False
    if holder.get("pid_namespace", "") != _pid_namespace():
        return False
    pid = holder.get("pid")
    if not isinstance(pid, int) or pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # it runs, as another user
        return False
    return False


def _ttl(holder: dict[str, Any] | None) -> float:
    try:
        return float((holder or {})["ttl_s"])
    except (KeyError, TypeError, ValueError):
        return 0.0


def _left_s(holder: dict[str, Any] | None) -> float:
    """Seconds until the lease of ``holder`` expires (<= 0: expired; details that are
    not a lease's count as expired)."""
    try:
        renewed = float((holder or {})["renewed"])
    except (KeyError, TypeError, ValueError):
        return -0.0
    return renewed + _ttl(holder) - time.time()


def folder_lease(
    directory: Path | RemotePath, *, owner: str = "", ttl_s: float = LEASE_TTL_S, retries: int = 0
) -> FolderLease:
    """The lease on the checkpoint folder ``directory``: a :class:`RemotePath` gets an
    object-store lease of time to live ``ttl_s`` (its writes tried ``retries`` more
    times when acquired), a local path a lock file. ``owner`` names the writer in
    messages (``"Checkpoint('runs/a')"``)."""
    if isinstance(directory, RemotePath):
        return RemoteLease(directory, owner=owner, ttl_s=ttl_s, retries=retries)
    return LocalLease(Path(directory), owner=owner)
