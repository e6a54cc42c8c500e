"""``loopbus watch`` follows a trainer's job from stage to stage, as a subprocess."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import anyio
import msgspec

from loopbus import PutRecord, Trainer
from loopbus.plugins import StreamServer
from tests.helpers import TinyModule, make_loader
from tests.plugins.stream_helpers import Gate

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
