"""The stream server's limits under load: ``max_clients`` holds for a burst of
simultaneous connections at any time (before the first step and while steps run), and a
client that keeps up loses nothing with the default queue under the inline executor."""

from __future__ import annotations

from collections import Counter
from contextlib import AsyncExitStack
from typing import Any

import anyio
import msgspec
import pytest

import loopbus
from loopbus.events import TrainBatchCompleted
from loopbus.plugins import StreamServer
from loopbus.stream import (
    MAX_SERVER_FRAME,
    Bye,
    FrameReader,
    Gap,
    ServerMessage,
    Welcome,
    parse_address,
)
from tests.helpers import TinyModule, make_loader
from tests.plugins.stream_helpers import HELLO, ChattyModule, serving


class Stepping(loopbus.Plugin):
    """Sets ``running`` once a few training steps completed."""

    def __init__(self) -> None:
        self.running = anyio.Event()

    @loopbus.on(TrainBatchCompleted)
    def stepped(self, event: TrainBatchCompleted) -> None:
        if event.step >= 3:
            self.running.set()


async def _burst(address: str, n: int) -> Counter[str]:
    """Open ``n`` connections, then send every ``Hello`` at once; return how many got
    each first answer (``"Welcome"`` or the bye code). Welcomed connections stay open
    until every connection has its answer, so none frees a slot for another."""
    decoder = msgspec.msgpack.Decoder(ServerMessage)
    answers: list[str] = []
    connected = 0
    all_connected = anyio.Event()
    go = anyio.Event()
    all_answered = anyio.Event()
    release = anyio.Event()

    async def knock() -> None:
        nonlocal connected
        stream = await parse_address(address).connect()
        async with stream:
            connected += 1
            if connected == n:
                all_connected.set()
            await go.wait()
            await stream.send(HELLO)
            reader = FrameReader(MAX_SERVER_FRAME)
            frames: list[bytes] = []
            while not frames:
                frames = reader.feed(await stream.receive())
            first = decoder.decode(frames[0])
            if isinstance(first, Welcome):
                answers.append("Welcome")
            else:
                assert isinstance(first, Bye), first
                answers.append(first.code)
            if len(answers) == n:
                all_answered.set()
            if isinstance(first, Welcome):
                await release.wait()

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for _ in range(n):
                tg.start_soon(knock)
            await all_connected.wait()
            # Let the server accept them all, so that the Hellos arrive together.
            await anyio.sleep(0.05)
            go.set()
            await all_answered.wait()
            counts = Counter(answers)
            release.set()
    return counts


async def _until_connected(server: StreamServer, n: int) -> None:
    """Wait (bounded) until the server counts ``n`` connected clients."""
    with anyio.fail_after(10):
        while server.connected != n:  # noqa: ASYNC110 - a counter, no event
            await anyio.sleep(0.01)


@pytest.mark.parametrize(("max_clients", "holders", "burst"), [(2, 0, 10), (2, 1, 10), (16, 5, 40)])
async def test_max_clients_holds_for_a_burst_before_and_during_training(
    max_clients: int, holders: int, burst: int
) -> None:
    """``holders`` clients stay connected; ``burst`` more connect at once, first while
    the run is held before its first step, then while steps run. Exactly the free slots
    are welcomed each time; every other connection is turned away as ``busy``."""
    server = StreamServer(scope="stage", announce=False, max_clients=max_clients)
    stepping = Stepping()
    free = max_clients - holders
    expected = Counter({"Welcome": free, "busy": burst - free})
    async with serving(
        TinyModule(),
        server=server,
        max_epochs=100_000,
        train=make_loader(64),
        plugins=(stepping,),
    ) as run:
        async with AsyncExitStack() as stack:
            for _ in range(holders):
                await stack.enter_async_context(loopbus.connect(run.address))
            assert server.connected == holders
            held = await _burst(run.address, burst)
            assert run.trainer.global_step == 0
            await _until_connected(server, holders)
            run.gate.go.set()
            with anyio.fail_after(30):
                await stepping.running.wait()
            step = run.trainer.global_step
            training = await _burst(run.address, burst)
            assert run.trainer.global_step > step, "the burst should arrive while steps run"
            assert not run.done.is_set()
            await _until_connected(server, holders)
        run.trainer.request_stop("test over")
    assert (held, training) == (expected, expected)
    assert server.accepted == holders + 2 * free
    assert server.rejected == 2 * (burst - free)
    assert server.errors == 0


@pytest.mark.parametrize("extra", [0, 20], ids=["1-per-step", "21-per-step"])
async def test_default_client_buffer_loses_nothing_for_a_client_that_keeps_up(extra: int) -> None:
    """Steps inline on the event loop (the default executor): a client's writer runs only
    when the run yields, so the queue must hold what the run puts meanwhile. With the
    default options a client reading every record as it comes gets all of them, also
    when the run puts several times ``client_buffer`` records in all."""
    steps = 3000
    server = StreamServer(scope="stage", announce=False)
    module = ChattyModule(extra) if extra else TinyModule()
    items: list[Any] = []
    async with serving(
        module, server=server, max_steps=steps, train=make_loader(16 * steps)
    ) as run:
        assert run.trainer.executor == "inline"
        async with loopbus.connect(run.address, yield_gaps=True) as stream:
            run.gate.go.set()
            with anyio.fail_after(60):
                items = [item async for item in stream]
    assert len(run.captured) == steps * (1 + extra)
    assert not [item for item in items if isinstance(item, Gap)]
    assert items == run.expected
    assert stream.gaps == server.dropped == 0
    assert stream.bye is not None
    assert stream.bye.code == "end"
