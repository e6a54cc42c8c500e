"""One writer per checkpoint folder on object storage, against a running S3 server
(moto's, see conftest.py): the lease object is created with a conditional write, so a
second writer is refused naming the first; a lease not renewed for its time to live is
taken over with a warning naming its old holder; the heartbeat keeps a live one from
expiring; a run that lost its lease stops writing."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

import loopbus
from loopbus import (
    CheckpointError,
    HandlerError,
    MisconfigurationError,
    Plugin,
    RemotePath,
    Trainer,
    on,
)
from loopbus.events import TrainBatchCompleted
from loopbus.plugins import Checkpoint
from loopbus.storage import LEASE_NAME, Store, folder_lease
from tests.helpers import TinyModule, make_loader

from .conftest import S3


def _where(s3: S3) -> RemotePath:
    return RemotePath(s3.url, s3.options)


async def _fit(s3: S3, epochs: int = 1, **fit: Any) -> Trainer:
    loopbus.seed_everything(0)
    checkpoint = Checkpoint(s3.url, storage_options=s3.options, background=False)
    trainer = Trainer(max_epochs=epochs, plugins=[checkpoint], device="cpu")
    await trainer.fit(TinyModule(), make_loader(32, 16), **fit)
    return trainer


def _stale(s3: S3, **holder: Any) -> None:
    """Write the lease of a run that died long ago on another host."""
    record = {"host": "elsewhere", "pid": 4242, "started": "2026-01-01T00:00:00+00:00"}
    record |= {"token": "x", "ttl_s": 1.0, "renewed": time.time() - 100, **holder}
    Store(_where(s3)).write(LEASE_NAME, json.dumps(record).encode())


async def test_a_second_writer_is_refused_naming_the_first(s3: S3) -> None:
    first = folder_lease(_where(s3), ttl_s=30)
    first.acquire()
    try:
        holder = json.loads(Store(_where(s3)).read_small(LEASE_NAME))
        with pytest.raises(HandlerError) as info:
            await _fit(s3)
        assert isinstance(info.value.original, MisconfigurationError)
        message = str(info.value.original)
        for part in (
            f"process {os.getpid()} on host {socket.gethostname()!r}",
            holder["started"],
            "expires in",
            "another folder",
        ):
            assert part in message
        assert s3.keys() == [LEASE_NAME]  # nothing of the second run written
    finally:
        first.release()
    assert s3.keys() == []
    await _fit(s3)  # free now; and released at the fit's end
    assert LEASE_NAME not in s3.keys()
    await _fit(s3, epochs=2, ckpt_path="last")  # a resume writes the folder again
    assert LEASE_NAME not in s3.keys()


def test_only_one_of_writers_starting_at_once_gets_the_lease(s3: S3) -> None:
    leases = [folder_lease(_where(s3), ttl_s=30) for _ in range(4)]
    outcomes: list[str] = []
    barrier = threading.Barrier(len(leases))

    def take(lease: Any) -> None:
        barrier.wait()
        try:
            lease.acquire()
            outcomes.append("held")
        except MisconfigurationError:
            outcomes.append("refused")

    threads = [threading.Thread(target=take, args=(lease,)) for lease in leases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert sorted(outcomes) == ["held", "refused", "refused", "refused"]
    finally:
        for lease in leases:
            lease.release()


async def test_an_expired_lease_is_taken_over_with_a_warning(s3: S3) -> None:
    _stale(s3)
    with pytest.warns(
        UserWarning,
        match=r"took over the expired lease.*process 4242 on host 'elsewhere'.*not renewed for 10\d s",
    ):
        await _fit(s3)
    assert loopbus.latest_checkpoint(_where(s3)) == _where(s3) / "epoch=0-step=2.ckpt"
    assert LEASE_NAME not in s3.keys()


@pytest.mark.external
def test_a_live_lease_of_a_process_gone_from_this_host_is_taken_at_once(s3: S3) -> None:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    here = {"host": socket.gethostname(), "pid": int(gone.stdout), "ttl_s": 60.0}
    namespace = os.readlink("/proc/self/ns/pid") if os.path.exists("/proc/self/ns/pid") else ""
    # The same host name in another container (host networking): its pids are not ours.
    _stale(s3, **here, pid_namespace="pid:[1]", renewed=time.time())
    with pytest.raises(MisconfigurationError, match=rf"process {int(gone.stdout)} on host"):
        folder_lease(_where(s3), ttl_s=30).acquire()
    _stale(s3, **here, pid_namespace=namespace, renewed=time.time())
    lease = folder_lease(_where(s3), ttl_s=30)
    lease.acquire()  # no warning: its holder is known to be dead
    lease.release()


def test_a_lease_that_is_not_json_is_taken_over(s3: S3) -> None:
    Store(_where(s3)).write(LEASE_NAME, b"\x00garbage")
    lease = folder_lease(_where(s3), ttl_s=30)
    with pytest.warns(UserWarning, match=r"not in loopbus's format"):
        lease.acquire()
    lease.release()


def test_the_heartbeat_keeps_a_live_lease_from_expiring(s3: S3) -> None:
    first = folder_lease(_where(s3), ttl_s=1.2)
    first.acquire()
    try:
        before = Store(_where(s3)).read_tagged(LEASE_NAME)[1]
        time.sleep(3.0)  # over twice its time to live
        assert Store(_where(s3)).read_tagged(LEASE_NAME)[1] != before  # renewed
        with pytest.raises(MisconfigurationError, match=rf"process {os.getpid()}"):
            folder_lease(_where(s3), ttl_s=1.2).acquire()
        first.check()
    finally:
        first.release()
    assert s3.keys() == []


def test_a_lease_taken_over_is_lost_and_said_so(s3: S3) -> None:
    first = folder_lease(_where(s3), owner="Checkpoint('run')", ttl_s=0.4)
    first.acquire()
    _stale(s3, renewed=time.time())  # as if another run had taken it over
    deadline = time.monotonic() + 20
    with pytest.raises(CheckpointError, match=r"lost its lease.*taken over by process 4242"):
        while time.monotonic() < deadline:
            first.check()
            time.sleep(0.05)
    first.release()
    assert s3.keys() == [LEASE_NAME]  # the other run's, left alone


class _TakeOver(Plugin):
    """At the first training batch, before the Checkpoint plugin's save: another run
    takes the folder's lease over (and this run's heartbeat finds out)."""

    def __init__(self, s3: S3) -> None:
        self.s3 = s3

    @on(TrainBatchCompleted)
    def _take_over(self, event: TrainBatchCompleted) -> None:
        def beating() -> bool:  # the heartbeat, a thread named after the folder
            return any(t.name == f"loopbus-lease {self.s3.url}" for t in threading.enumerate())

        assert beating()
        _stale(self.s3, renewed=time.time())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and beating():  # it ends once it finds out
            time.sleep(0.05)


async def test_a_run_that_lost_its_lease_stops_writing(
    s3: S3, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loopbus.plugins import _checkpoint_files

    monkeypatch.setattr(
        _checkpoint_files, "folder_lease", functools.partial(folder_lease, ttl_s=0.4)
    )
    checkpoint = Checkpoint(s3.url, storage_options=s3.options, every_n_steps=1)
    trainer = Trainer(max_epochs=1, plugins=[_TakeOver(s3), checkpoint], device="cpu")
    with pytest.raises(HandlerError) as info:
        await trainer.fit(TinyModule(), make_loader(32, 16))
    assert isinstance(info.value.original, CheckpointError)
    assert "taken over by process 4242 on host 'elsewhere'" in str(info.value.original)
    assert s3.keys() == [LEASE_NAME]  # nothing written; the other run's lease left alone
