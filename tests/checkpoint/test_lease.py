"""One writer per checkpoint folder, locally: a run holds the folder's lease (an OS lock
on ``.loopbus-lease``) while it writes; a second run writing into the folder at the same
time is refused, naming the first's host, process and start; sequential runs and a
resume write the folder again; a lease whose process was killed, or whose run raised,
does not block."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

import loopbus
from loopbus import CheckpointError, HandlerError, MisconfigurationError, Plugin, Trainer, on
from loopbus.events import TrainBatchCompleted
from loopbus.plugins import Checkpoint
from loopbus.storage import LEASE_NAME, folder_lease
from tests.helpers import ROOT, TinyModule, make_loader


async def _fit(directory: Path, *plugins: Plugin, epochs: int = 1, **fit: Any) -> Trainer:
    loopbus.seed_everything(0)
    trainer = Trainer(max_epochs=epochs, plugins=[Checkpoint(directory), *plugins], device="cpu")
    await trainer.fit(TinyModule(), make_loader(32, 16), **fit)
    return trainer


async def _refused(directory: Path) -> str:
    """Run a fit into ``directory``; the message of the MisconfigurationError it was
    refused with (raised by the plugin's FitStarted handler, so wrapped)."""
    with pytest.raises(HandlerError) as info:
        await _fit(directory)
    assert isinstance(info.value.original, MisconfigurationError)
    return str(info.value.original)


class _Hold(Plugin):
    """Holds its fit at the first training batch (the folder claimed) until ``go``."""

    def __init__(self) -> None:
        self.holding = anyio.Event()
        self.go = anyio.Event()

    @on(TrainBatchCompleted)
    async def _hold(self, event: TrainBatchCompleted) -> None:
        if not self.holding.is_set():
            self.holding.set()
            await self.go.wait()


async def test_a_second_concurrent_writer_is_refused_naming_the_first(tmp_path: Path) -> None:
    hold = _Hold()
    message = ""

    async def second() -> None:
        nonlocal message
        await hold.holding.wait()
        holder = json.loads((tmp_path / LEASE_NAME).read_text())
        try:
            message = await _refused(tmp_path)
        finally:
            hold.go.set()
        assert holder["started"] in message

    async with anyio.create_task_group() as tg:
        tg.start_soon(second)
        await _fit(tmp_path, hold, epochs=2)
    for part in (f"process {os.getpid()}", repr(socket.gethostname()), "started", LEASE_NAME):
        assert part in message
    for remedy in ("Wait for it to end", "stop it", "another folder"):
        assert remedy in message
    # The first run's checkpoints alone, last.json naming its last one; the lease gone.
    assert [n for n in os.listdir(tmp_path) if n.endswith(".ckpt")] == ["epoch=1-step=4.ckpt"]
    assert loopbus.latest_checkpoint(tmp_path) == tmp_path / "epoch=1-step=4.ckpt"
    assert not (tmp_path / LEASE_NAME).exists()


async def test_sequential_runs_and_a_resume_write_the_same_folder(tmp_path: Path) -> None:
    trainer = await _fit(tmp_path)
    assert not (tmp_path / LEASE_NAME).exists()
    resumed = await _fit(tmp_path, epochs=2, ckpt_path="last")
    assert resumed.global_step == 4
    assert not (tmp_path / LEASE_NAME).exists()
    # The same trainer fits again into its own folder.
    await trainer.fit(TinyModule(), make_loader(32, 16))
    assert not (tmp_path / LEASE_NAME).exists()


class _Boom(TinyModule):
    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error = error

    def training_step(self, batch: Any, ctx: Any) -> Any:
        if self.trainer.global_step == 1:
            raise self.error
        return super().training_step(batch, ctx)


@pytest.mark.parametrize(
    "error", [RuntimeError("boom"), KeyboardInterrupt()], ids=["error", "interrupt"]
)
async def test_the_lease_is_released_when_the_run_raises(
    tmp_path: Path, error: BaseException
) -> None:
    trainer = Trainer(max_epochs=1, plugins=[Checkpoint(tmp_path, every_n_steps=1)], device="cpu")
    with pytest.raises(type(error)):
        await trainer.fit(_Boom(error), make_loader(32, 16))
    assert (tmp_path / "epoch=0-step=1.ckpt").exists()
    assert not (tmp_path / LEASE_NAME).exists()
    lease = folder_lease(tmp_path)  # the folder is free
    lease.acquire()
    lease.release()
    with pytest.warns(UserWarning, match=r"resuming mid-epoch"):
        await _fit(tmp_path, epochs=1, ckpt_path="last")


def test_a_lease_is_taken_once_and_can_be_taken_again(tmp_path: Path) -> None:
    lease = folder_lease(tmp_path / "run", owner="Checkpoint('run')")
    lease.acquire()
    lease.acquire()  # held already: nothing happens
    assert lease.held
    holder = json.loads((tmp_path / "run" / LEASE_NAME).read_text())
    assert (holder["pid"], holder["host"]) == (os.getpid(), socket.gethostname())
    other = folder_lease(tmp_path / "run")
    with pytest.raises(MisconfigurationError, match=r"this process: another trainer"):
        other.acquire()
    lease.check()  # a local lock cannot be lost
    lease.release()
    assert not lease.held
    assert not (tmp_path / "run" / LEASE_NAME).exists()
    other.acquire()
    other.release()
    lease.release()  # released already: nothing happens


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from loopbus.storage import folder_lease
    folder_lease(Path(sys.argv[1])).acquire()
    print("held", flush=True)
    time.sleep(120)
    """
)


def _holder(directory: Path) -> subprocess.Popen[str]:
    """A process that takes the lease on ``directory`` and holds it (until killed)."""
    return subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(directory)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )


@pytest.mark.external
async def test_a_lease_of_a_killed_process_does_not_block(tmp_path: Path) -> None:
    child = _holder(tmp_path)
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "held"
        message = await _refused(tmp_path)
        assert f"process {child.pid} on host {socket.gethostname()!r}" in message
        assert "this process" not in message
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
        if child.stdout is not None:
            child.stdout.close()
    assert (tmp_path / LEASE_NAME).exists()  # left behind, but no longer locked
    await _fit(tmp_path)
    assert loopbus.latest_checkpoint(tmp_path) == tmp_path / "epoch=0-step=2.ckpt"
    assert not (tmp_path / LEASE_NAME).exists()


def test_a_folder_that_cannot_be_created_is_a_checkpoint_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointError, match=r"cannot create"):
        folder_lease(tmp_path / "file" / "run").acquire()


def test_the_refusal_waits_for_the_holders_details(tmp_path: Path) -> None:
    """A holder that locked but has not written its details yet is still refused."""
    import fcntl

    tmp_path.mkdir(exist_ok=True)
    fd = os.open(tmp_path / LEASE_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        start = time.monotonic()
        with pytest.raises(MisconfigurationError, match=r"not written its details"):
            folder_lease(tmp_path).acquire()
        assert time.monotonic() - start < 30
    finally:
        os.close(fd)
