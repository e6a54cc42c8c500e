"""``loopbus.stream.Server`` on its own (no trainer), and ``StreamServer`` serving one
address for a trainer's whole life: a client stays connected from ``fit`` to ``test``."""

from __future__ import annotations

import gc
import threading
from typing import Any

import anyio
import pytest

import loopbus
from loopbus import MisconfigurationError, PutRecord, Trainer
from loopbus.plugins import StreamServer
from loopbus.stream import EpochEnded, Server, StageEnded, StageStarted
from tests.helpers import TinyModule, make_loader
from tests.plugins.stream_helpers import Gate


def record(name: str, step: int, value: float = 1.0) -> PutRecord:
    return PutRecord(name=name, value=value, step=step, epoch=0, time=0.0, source="test")


def streamed(r: PutRecord) -> PutRecord:
    return PutRecord(
        name=r.name,
        value=r.value,
        step=r.step,
        epoch=r.epoch,
        time=r.time,
        source=r.source,
        destinations=("external",),
    )


async def test_a_server_without_a_trainer() -> None:
    sent = [record(f"m/{i % 3}", i, float(i)) for i in range(100)]
    async with Server(flush_interval=0.01) as server:
        assert server.serving
        address = server.address
        assert address is not None
        async with (
            loopbus.connect(address, topics=["records", "events"]) as everything,
            loopbus.connect(address, names=["m/1"]) as one,
        ):
            assert server.subscribers == 2
            assert everything.welcome is not None
            assert everything.welcome.stage is None
            server.publish_event(StageStarted(stage="run", step=0, epoch=0, time=0.0))
            for r in sent[:50]:
                server.publish_record(r)
            server.publish_event(EpochEnded(epoch=0, step=49, time=0.0))
            for r in sent[50:]:
                server.publish_record(r)
            server.publish_event(
                StageEnded(stage="run", reason="completed", step=99, epoch=0, time=0.0)
            )
            await server.aclose("done publishing")
            assert not server.serving
            assert server.address is None
            with anyio.fail_after(30):
                items = [item async for item in everything]
                ones = [item async for item in one]
    expected = [streamed(r) for r in sent]
    assert items[0] == StageStarted(stage="run", step=0, epoch=0, time=0.0)
    assert items[1:51] == expected[:50]
    assert items[51] == EpochEnded(epoch=0, step=49, time=0.0)
    assert items[52:102] == expected[50:]
    assert isinstance(items[102], StageEnded)
    assert len(items) == 103
    assert ones == [r for r in expected if r.name == "m/1"]
    for stream in (everything, one):
        assert stream.bye is not None
        assert (stream.bye.code, stream.bye.reason) == ("end", "done publishing")
    assert server.closed
    with pytest.raises(RuntimeError, match="serves once"):
        await server.serve()


async def test_items_handed_over_together_keep_each_client_s_order_and_numbers() -> None:
    """One flush hands many records (of several names, to clients with different
    filters, between events) to the clients' queues in runs: each client still gets its
    own items in order, numbered without gaps, and new clients are welcomed at the step
    and epoch of the last item."""
    sent = [record(f"{'ab'[i % 2]}/{i % 5}", i, float(i)) for i in range(400)]
    async with Server(flush_interval=10.0) as server:  # everything in one hand-over
        address = server.address
        assert address is not None
        async with (
            loopbus.connect(address, topics=["records", "events"]) as everything,
            loopbus.connect(address, names=["a/*"]) as some,
            loopbus.connect(address, topics=["events"]) as events,
        ):
            await anyio.sleep(0.05)  # the first hand-over (at once) is done
            server.publish_record(record("a/0", 0))
            await anyio.sleep(0.05)
            for r in sent[:200]:
                server.publish_record(r)
            server.publish_event(EpochEnded(epoch=0, step=199, time=0.0))
            for r in sent[200:]:
                server.publish_record(r)
            await server.aclose("done")
            assert (server.step, server.epoch) == (399, 0)
            with anyio.fail_after(30):
                items = [item async for item in everything]
                a_items = [item async for item in some]
                e_items = [item async for item in events]
    expected = [streamed(r) for r in sent]
    epoch_end = EpochEnded(epoch=0, step=199, time=0.0)
    assert items == [streamed(record("a/0", 0)), *expected[:200], epoch_end, *expected[200:]]
    assert a_items == [streamed(record("a/0", 0))] + [r for r in expected if r.name[0] == "a"]
    assert e_items == [epoch_end]
    assert everything.gaps == some.gaps == 0


async def test_a_server_in_its_own_thread_takes_records_from_this_one() -> None:
    server = Server(flush_interval=0.0)
    server.start_in_thread()
    try:
        assert server.address is not None
        async with loopbus.connect(server.address) as stream:
            for i in range(1000):
                server.publish_record(record("x", i))
            server.close("bye")
            with anyio.fail_after(30):
                steps = [item.step async for item in stream]  # type: ignore[union-attr]
    finally:
        server.close()
        assert server.join(10)
    assert steps == list(range(1000))
    assert server.closed


async def test_a_server_refuses_what_is_not_a_stream_event() -> None:
    server = Server()
    with pytest.raises(MisconfigurationError, match=r"publish_event\(\) takes a StageStarted"):
        server.publish_event(record("x", 0))  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationError, match=r"StreamServer\(scope=\.\.\.\)"):
        StreamServer(scope="job")  # type: ignore[arg-type]
    # Publishing to a server that is not serving costs nothing and sends nothing.
    server.publish_record(record("x", 0))
    server.publish_event(StageStarted(stage="fit", step=3, epoch=1, time=0.0))
    assert (server.stage, server.step, server.epoch) == ("fit", 3, 1)


async def test_one_address_for_the_trainer_s_life_a_client_stays_from_fit_to_test() -> None:
    server = StreamServer(announce=False)
    gate = Gate()
    trainer = Trainer(plugins=[server, gate], max_epochs=1)
    captured: list[PutRecord] = []
    trainer.subscribe(PutRecord, captured.append, destination="external")
    module = TinyModule()
    items: list[Any] = []
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer.fit, module, make_loader(64))
            with anyio.fail_after(30):
                await gate.started.wait()
            address = gate.address
            async with loopbus.connect(address, topics=["records", "events"]) as stream:
                gate.go.set()
                with anyio.fail_after(60):
                    async for item in stream:
                        items.append(item)
                        if isinstance(item, StageEnded):
                            break
                    assert server.address == address, "the server outlives the fit stage"
                    await trainer.test(module, make_loader(32))
                    assert gate.address == address, "the test stage is served at the same address"
                    async for item in stream:
                        items.append(item)
                        if isinstance(item, StageEnded):
                            break
                    assert server.connected == 1
        server.close()
        assert server.address is None
    finally:
        server.close()
    kinds = [type(i).__name__ if not isinstance(i, PutRecord) else i.name for i in items]
    assert kinds == (
        ["train/loss"] * 4
        + ["EpochEnded", "StageEnded", "StageStarted"]
        + ["test/loss"] * 2
        + ["StageEnded"]
    )
    assert [i for i in items if isinstance(i, PutRecord)] == [streamed(r) for r in captured]
    ends = [i for i in items if isinstance(i, StageEnded)]
    assert [(e.stage, e.reason) for e in ends] == [("fit", "completed"), ("test", "completed")]
    start = items[6]
    assert isinstance(start, StageStarted)
    assert (start.stage, start.step) == ("test", 4)
    assert stream.bye is None  # the client left first: nothing ended its stream


def test_the_server_outlives_event_loops_and_closes_when_collected() -> None:
    server = StreamServer(announce=False, linger=0.2)
    trainer = Trainer(plugins=[server])
    loopbus.run(trainer.validate, TinyModule(), make_loader(32))
    first = server.address
    assert first is not None
    inner = server.server
    loopbus.run(trainer.test, TinyModule(), make_loader(32))
    assert server.address == first
    assert inner.serving
    threads = [t for t in threading.enumerate() if t.name == "loopbus stream server"]
    assert threads
    del server, trainer
    gc.collect()
    assert inner.join(10)
    assert inner.closed
    assert inner.address is None
