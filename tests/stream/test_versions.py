"""Protocol versions at a trainer's server: a client that says version 1 gets what the
version-1 document promised (a ``Bye`` at each stage's end, the gap accounting closed
by then, no ``StageStarted``), while a version-2 client stays from stage to stage; a
``Hello`` is judged by its version first; the Python client speaks version 2."""

from __future__ import annotations

import socket
from typing import Any

import anyio
import pytest
from anyio.abc import SocketAttribute

import loopbus
from loopbus import PutRecord, Trainer
from loopbus.plugins import StreamServer
from loopbus.stream import PROTOCOL_VERSION, Server, StageEnded
from tests.helpers import TinyModule, make_loader
from tests.plugins.stream_helpers import ChattyModule, Gate
from tests.stream.raw_client import RawClient, accounting, encode_frame, is_type

HELLO_1 = encode_frame({"type": "Hello", "version": 1})
SUBSCRIBE_ALL = encode_frame({"type": "Subscribe", "names": ["*"], "topics": ["records", "events"]})


def _wire(record: PutRecord) -> list[Any]:
    return ["R", record.name, record.value, record.step, record.epoch, record.time, record.source]


class _Job:
    """A trainer with a trainer-scoped stream server, fit held at its start by a gate."""

    def __init__(self, server: StreamServer) -> None:
        self.server = server
        self.gate = Gate()
        self.trainer = Trainer(plugins=[server, self.gate], max_epochs=1)
        self.captured: list[PutRecord] = []
        self.trainer.subscribe(PutRecord, self.captured.append, destination="external")
        self.fitted = anyio.Event()

    async def fit(self, module: Any, data: Any) -> None:
        await self.trainer.fit(module, data)
        self.fitted.set()


async def test_a_version_1_client_gets_a_bye_at_each_stage_end_and_a_version_2_client_stays() -> (
    None
):
    job = _Job(StreamServer(announce=False))
    module = TinyModule()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(job.fit, module, make_loader(64))
            with anyio.fail_after(30):
                await job.gate.started.wait()
            address = job.gate.address
            first = await RawClient.open(address, HELLO_1 + SUBSCRIBE_ALL)
            await first.read_until(is_type("Subscribed"))
            async with loopbus.connect(address, topics=["records", "events"]) as newer:
                assert newer.welcome is not None
                assert (newer.welcome.version, newer.welcome.versions) == (2, [1, 2])
                job.gate.go.set()
                # The version-1 connection ends with fit, before the job does.
                during_fit = await first.read_to_end(within=60)
                with anyio.fail_after(60):
                    await job.fitted.wait()
                fit_records = list(job.captured)
                # Connected again between stages, it is served the next stage.
                second = await RawClient.open(address, HELLO_1 + SUBSCRIBE_ALL)
                await second.read_until(is_type("Subscribed"))
                with anyio.fail_after(60):
                    await job.trainer.test(module, make_loader(32))
                during_test = await second.read_to_end(within=60)
                test_records = job.captured[len(fit_records) :]
                # The version-2 connection saw both stages and ends when the server closes.
                job.server.server.close("the job ended")
                with anyio.fail_after(60):
                    later = [item async for item in newer]
                assert newer.bye is not None
                assert (newer.bye.code, newer.bye.reason) == ("end", "the job ended")
    finally:
        job.server.close()

    welcome, subscribed, *_, bye = during_fit
    assert (welcome["type"], welcome["version"], welcome["stage"]) == ("Welcome", 1, "fit")
    assert welcome["versions"] == [1, 2]
    assert subscribed["type"] == "Subscribed"
    assert bye == {"type": "Bye", "code": "end", "reason": "the fit stage ended"}
    items, missing, end = accounting(during_fit)
    assert missing == 0
    assert len(items) + missing == end == len(fit_records) + 2  # + EpochEnded, StageEnded
    assert items[:-2] == [_wire(r) for r in fit_records]
    assert [i[0] for i in items[-2:]] == ["EpochEnded", "StageEnded"]
    assert items[-1][1:3] == ["fit", "completed"]

    welcome, *_, bye = during_test
    assert (welcome["version"], welcome["stage"], welcome["step"]) == (1, None, 4)
    assert bye == {"type": "Bye", "code": "end", "reason": "the test stage ended"}
    items, missing, end = accounting(during_test)
    assert len(items) + missing == end == len(test_records) + 1
    assert items[:-1] == [_wire(r) for r in test_records]
    assert items[-1][:3] == ["StageEnded", "test", "completed"]
    assert not any(i[0] == "StageStarted" for i in items)

    kinds = [type(i).__name__ if not isinstance(i, PutRecord) else i.name for i in later]
    assert kinds == (
        ["train/loss"] * 4
        + ["EpochEnded", "StageEnded", "StageStarted"]
        + ["test/loss"] * 2
        + ["StageEnded"]
    )
    assert [e.stage for e in later if isinstance(e, StageEnded)] == ["fit", "test"]


async def test_a_version_1_client_that_reads_slowly_gets_gaps_and_its_accounting_closes() -> None:
    """The client reads nothing while fit runs: its queue overflows, and when it reads at
    last it gets a gap for what was dropped, the newest items and the stage's Bye, with
    received + reported missing = sent."""
    job = _Job(StreamServer(announce=False, client_buffer=16, send_buffer=1024))
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(job.fit, ChattyModule(n=200), make_loader(512))
            with anyio.fail_after(30):
                await job.gate.started.wait()
            client = await RawClient.open(job.gate.address, HELLO_1 + SUBSCRIBE_ALL)
            raw = client.stream.extra(SocketAttribute.raw_socket)
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            await client.read_until(is_type("Subscribed"))
            job.gate.go.set()
            with anyio.fail_after(120):
                await job.fitted.wait()
            messages = await client.read_to_end(within=60)
    finally:
        job.server.close()
    sent = len(job.captured) + 2  # the records, EpochEnded and StageEnded
    assert sent > 6000
    items, missing, end = accounting(messages)
    assert missing > 0, "the client's queue never overflowed"
    assert len(items) + missing == end == sent
    assert messages[-1] == {"type": "Bye", "code": "end", "reason": "the fit stage ended"}
    assert [i[0] for i in items[-2:]] == ["EpochEnded", "StageEnded"]
    # What arrived is what was sent, in order, less what the gaps report.
    records = [i for i in items if i[0] == "R"]
    wire = iter([_wire(r) for r in job.captured])
    assert all(any(r == w for w in wire) for r in records)


async def test_the_python_client_speaks_the_newest_version() -> None:
    assert PROTOCOL_VERSION == 2
    assert Server.versions == (1, 2)
    async with Server() as server:
        assert server.address is not None
        async with loopbus.connect(server.address) as stream:
            assert stream.welcome is not None
            assert stream.welcome.version == PROTOCOL_VERSION
            assert stream.welcome.versions == [1, 2]


@pytest.mark.parametrize(
    ("hello", "code", "reason"),
    [
        # A version the server speaks: the Hello is judged whole.
        ({"type": "Hello", "version": 1, "token": 5}, "malformed", "invalid Hello message"),
        ({"type": "Hello", "version": 2, "client": ["x"]}, "malformed", "invalid Hello message"),
        # Another version: judged by its version alone, the reason names both sides.
        (
            {"type": "Hello", "version": 3, "token": {"scheme": "new"}},
            "version",
            "this server speaks protocol versions 1 and 2; the client asked for version 3.",
        ),
    ],
    ids=["version 1, bad token", "version 2, bad client", "version 3"],
)
async def test_a_hello_is_judged_by_its_version_first(
    hello: dict[str, Any], code: str, reason: str
) -> None:
    async with Server() as server:
        assert server.address is not None
        client = await RawClient.open(server.address, encode_frame(hello))
        messages = await client.read_to_end()
        assert server.accepted == 0
    assert len(messages) == 1
    assert messages[0]["type"] == "Bye"
    assert messages[0]["code"] == code
    assert messages[0]["reason"].startswith(reason)
