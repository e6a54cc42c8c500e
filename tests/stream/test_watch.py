"""``loopbus watch`` follows a trainer's job from stage to stage, as a subprocess."""

from __future__ import annotations

import signal
import subprocess
import sys
from typing import Any

import anyio
import msgspec
import pytest

from loopbus import PutRecord, Trainer
from loopbus.plugins import StreamServer
from loopbus.stream import Server, StageEnded, StageStarted
from tests.helpers import TinyModule, make_loader
from tests.plugins.stream_helpers import Gate

pytestmark = pytest.mark.external

WATCH = [sys.executable, "-m", "loopbus", "watch"]


async def test_watch_follows_fit_then_test_and_ends_when_the_server_closes() -> None:
    server = StreamServer(announce=False)
    gate = Gate()
    trainer = Trainer(plugins=[server, gate], max_epochs=1)
    captured: list[PutRecord] = []
    trainer.subscribe(PutRecord, captured.append, destination="external")
    module = TinyModule()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer.fit, module, make_loader(64))
            with anyio.fail_after(30):
                await gate.started.wait()
            async with await anyio.open_process(
                [*WATCH, "--jsonl", "--events", gate.address],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            ) as process:
                with anyio.fail_after(60):
                    while server.subscribers < 1:  # noqa: ASYNC110 - a counter
                        await anyio.sleep(0.02)
                gate.go.set()
                with anyio.fail_after(120):
                    while trainer.stage is not None:  # noqa: ASYNC110 - the run's state
                        await anyio.sleep(0.02)
                    await trainer.test(module, make_loader(32))
                    server.close()
                    assert process.stdout is not None
                    assert process.stderr is not None
                    output = b"".join([chunk async for chunk in process.stdout])
                    errors = b"".join([chunk async for chunk in process.stderr])
                    code = await process.wait()
    finally:
        server.close()
    assert code == 0, errors.decode()
    lines: list[dict[str, Any]] = [msgspec.json.decode(line) for line in output.splitlines()]
    assert [line["seq"] for line in lines] == list(range(len(lines)))
    kinds = [line["type"] if line["type"] != "PutRecord" else line["name"] for line in lines]
    assert kinds == (
        ["train/loss"] * 4
        + ["EpochEnded", "StageEnded", "StageStarted"]
        + ["test/loss"] * 2
        + ["StageEnded"]
    )
    assert (lines[5]["stage"], lines[5]["reason"]) == ("fit", "completed")
    assert (lines[6]["stage"], lines[6]["step"]) == ("test", 4)
    records = [msgspec.convert(line, PutRecord) for line in lines if line["type"] == "PutRecord"]
    assert [r.value for r in records] == [r.value for r in captured]


def _record(step: int) -> PutRecord:
    return PutRecord(name=f"m/{step % 7}", value=step * 0.5, step=step, time=0.0, source="test")


async def _subscribed(server: Server, accepted: int) -> None:
    """Until the server accepted ``accepted`` clients in all and has one subscriber."""
    with anyio.fail_after(60):
        while server.accepted < accepted or server.subscribers != 1:  # noqa: ASYNC110
            await anyio.sleep(0.01)


async def _watch_killed_then_to_the_end() -> tuple[int, bytes, list[int], list[int]]:
    """One server: a watcher connects and is SIGKILLed (stopped first, with records unread
    in its socket, so that the server's side of it is reset); a second watcher connects
    and watches until the server closes. The second's status, stderr, the steps it
    printed and those published while it watched."""
    step = 0
    async with Server(flush_interval=0.0) as server:
        assert server.address is not None
        server.publish_event(StageStarted(stage="fit", step=0, epoch=0, time=0.0))
        async with await anyio.open_process(
            [*WATCH, "--jsonl", server.address],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        ) as killed:
            await _subscribed(server, 1)
            killed.send_signal(signal.SIGSTOP)
            for step in range(2000):
                server.publish_record(_record(step))
            await anyio.sleep(0.05)  # into its socket, unread
            killed.kill()
            await killed.wait()
        with anyio.fail_after(60):
            while server.connected:  # noqa: ASYNC110 - until the server saw it go
                await anyio.sleep(0.01)
        async with await anyio.open_process(
            [*WATCH, "--jsonl", server.address], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        ) as watcher:
            await _subscribed(server, 2)
            published = list(range(2000, 2500))
            for step in published:
                server.publish_record(_record(step))
            server.publish_event(
                StageEnded(stage="fit", reason="completed", step=step, epoch=0, time=0.0)
            )
            server.close("the job ended")
            assert watcher.stdout is not None
            assert watcher.stderr is not None
            with anyio.fail_after(60):
                output = b"".join([chunk async for chunk in watcher.stdout])
                errors = b"".join([chunk async for chunk in watcher.stderr])
                code = await watcher.wait()
    printed = [msgspec.json.decode(line)["step"] for line in output.splitlines()]
    return code, errors, printed, published


async def test_a_watcher_after_a_killed_one_ends_with_the_servers_bye() -> None:
    for _ in range(3):
        code, errors, printed, published = await _watch_killed_then_to_the_end()
        assert code == 0, errors.decode()
        assert b"without a bye" not in errors
        assert errors == b""
        assert printed == published
