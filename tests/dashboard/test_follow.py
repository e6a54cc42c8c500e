"""The dashboard following real runs (a StreamServer in this process, on a Unix socket so
that every stage serves the same address): every record in order, epoch and stage
boundaries, a stage change, a run that ends, a new run on the same address, a refusal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import msgspec

from loopbus import Plugin, PutRecord, Trainer, on
from loopbus.dashboard import Hub, RunFeed, follow
from loopbus.events import FitStarted, TestStarted
from loopbus.plugins import StreamServer
from tests.helpers import TinyModule, make_loader


class WaitForClient(Plugin):
    """Holds each stage at its start until a client subscribed (nothing is replayed)."""

    def __init__(self, server: StreamServer) -> None:
        self.server = server

    @on(FitStarted)
    @on(TestStarted)
    async def hold(self, event: Any) -> None:
        with anyio.fail_after(30):
            while self.server.subscribers < 1:  # noqa: ASYNC110 - a counter, no event
                await anyio.sleep(0.01)


async def _job(path: Path, epochs: int, captured: list[PutRecord], **server: Any) -> None:
    stream = StreamServer(host=None, path=path, announce=False, **server)
    trainer = Trainer(max_epochs=epochs, plugins=[stream, WaitForClient(stream)], device="cpu")
    trainer.subscribe(PutRecord, captured.append, destination="external")
    module = TinyModule()
    try:
        await trainer.fit(module, make_loader(64), make_loader(32, seed=1))
        await trainer.test(module, make_loader(32, seed=2))
    finally:
        stream.close()  # the job ends: its server (serving the trainer's lifetime) closes


async def _until(predicate: Any, what: str, within: float = 30.0) -> None:
    with anyio.fail_after(within):
        while not predicate():  # noqa: ASYNC110 - polling the hub's state, no event
            await anyio.sleep(0.01)


def _collected(hub: Hub, run: int) -> tuple[list[tuple[str, int, Any]], list[dict[str, Any]]]:
    """(records as (name, step, value) in message order per name, markers) of ``run``."""
    records: list[tuple[str, int, Any]] = []
    markers: list[dict[str, Any]] = []
    for message in hub.read(0)[1]:
        for part in msgspec.json.decode(message)["parts"]:
            if part["run"] != run:
                continue
            for name, (steps, values) in part["records"].items():
                records += [(name, s, v) for s, v in zip(steps, values, strict=True)]
            markers += part["markers"]
    return records, markers


async def test_a_job_through_fit_and_test_until_it_ends(tmp_path: Path) -> None:
    path = tmp_path / "job.sock"
    hub = Hub(interval=0.02)
    feed = hub.add_run("job", f"unix://{path}")
    captured: list[PutRecord] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(hub.run)
        tg.start_soon(lambda: follow(feed, f"unix://{path}", retry=0.02, patience=0.3))
        await _job(path, 3, captured)
        await _until(lambda: feed.state == "ended", "the run to be shown as ended")
        hub.flush()
        tg.cancel_scope.cancel()

    assert feed.detail == "test completed; not serving any more"
    assert (feed.stage, feed.epoch, feed.gaps) == ("test", 2, 0)
    records, markers = _collected(hub, 0)
    expected = [(r.name, r.step, r.value) for r in captured]
    for name in ("train/loss", "val/loss", "test/loss"):  # every record, in order, per name
        assert [r for r in records if r[0] == name] == [r for r in expected if r[0] == name]
        assert any(r[0] == name for r in records)
    assert feed.records == len(captured) == len(records)
    steps_per_epoch = 4
    assert markers == [
        {"kind": "epoch", "step": steps_per_epoch, "label": "epoch 0"},
        {"kind": "epoch", "step": 2 * steps_per_epoch, "label": "epoch 1"},
        {"kind": "epoch", "step": 3 * steps_per_epoch, "label": "epoch 2"},
        {"kind": "stage", "step": 3 * steps_per_epoch, "label": "fit completed"},
        {"kind": "stage", "step": 3 * steps_per_epoch, "label": "test completed"},
    ]


async def test_a_new_job_on_the_same_address_is_a_new_series(tmp_path: Path) -> None:
    path = tmp_path / "job.sock"
    hub = Hub(interval=0.02)
    feed = hub.add_run("job", f"unix://{path}")
    first: list[PutRecord] = []
    second: list[PutRecord] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(hub.run)
        tg.start_soon(lambda: follow(feed, f"unix://{path}", retry=0.02, patience=30))
        await _job(path, 2, first)
        await _until(lambda: feed.detail == "test completed", "the first job's test stage")
        await _job(path, 1, second)
        await _until(lambda: len(hub.runs) == 2 and hub.runs[1].detail == "test completed", "2nd")
        hub.flush()
        tg.cancel_scope.cancel()
    assert [r.label for r in hub.runs] == ["job", "job (2)"]
    assert hub.runs[0].state == "ended"
    assert len(_collected(hub, 0)[0]) == len(first)
    assert len(_collected(hub, 1)[0]) == len(second)


async def test_a_wrong_token_is_shown_and_not_retried(tmp_path: Path) -> None:
    path = tmp_path / "job.sock"
    hub = Hub()
    feed: RunFeed = hub.add_run("job", f"unix://{path}")
    server = StreamServer(host=None, path=path, token="right", announce=False)

    class Watch(Plugin):
        @on(FitStarted)
        async def watch(self, event: FitStarted) -> None:
            # follow returns by itself: a refused token is not worth retrying.
            with anyio.fail_after(10):
                await follow(feed, f"unix://{path}", token="wrong", retry=0.01)

    trainer = Trainer(max_epochs=1, plugins=[server, Watch()], device="cpu")
    await trainer.fit(TinyModule(), make_loader(16))
    assert feed.state == "failed"
    assert "(auth)" in feed.detail
