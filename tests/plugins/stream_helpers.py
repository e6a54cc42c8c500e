"""A run serving its stream in the background, held at its start until a test says go,
and a raw-protocol client for poking at the server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec
import torch

from loopbus import Module, Plugin, PutRecord, Trainer, on
from loopbus.events import FitStarted
from loopbus.plugins import ServerStarted, StreamServer
from loopbus.stream import (
    MAX_SERVER_FRAME,
    FrameReader,
    Hello,
    ServerMessage,
    Subscribe,
    append_frame,
    parse_address,
)
from tests.helpers import TinyModule, make_loader


class Gate(Plugin):
    """Learns the server's address and holds the run at ``FitStarted`` until ``go``."""

    def __init__(self) -> None:
        self.address = ""
        self.started = anyio.Event()
        self.go = anyio.Event()

    @on(ServerStarted)
    def on_server_started(self, event: ServerStarted) -> None:
        self.address = event.address
        self.started.set()

    @on(FitStarted)
    async def hold(self, event: FitStarted) -> None:
        await self.go.wait()


class ChattyModule(TinyModule):
    """Puts ``n`` extra records per training step."""

    def __init__(self, n: int = 50) -> None:
        super().__init__()
        self.n = n

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        loss = super().training_step(batch, ctx)
        for i in range(self.n):
            self.put(f"train/m{i}", float(i))
        return loss


class Run:
    """What :func:`serving` yields."""

    def __init__(self, server: StreamServer, gate: Gate, trainer: Trainer) -> None:
        self.server = server
        self.gate = gate
        self.trainer = trainer
        self.captured: list[PutRecord] = []
        self.done = anyio.Event()

    @property
    def address(self) -> str:
        return self.gate.address

    @property
    def expected(self) -> list[PutRecord]:
        """The records the run put, as a client receives them (the stream does not
        carry the run's other destinations: a streamed record's are ``("external",)``)."""
        return [msgspec.structs.replace(r, destinations=("external",)) for r in self.captured]

    async def wait_for_subscribers(self, n: int, within: float = 60.0) -> None:
        with anyio.fail_after(within):
            while self.server.subscribers < n:  # noqa: ASYNC110 - a counter, no event
                await anyio.sleep(0.02)


@asynccontextmanager
async def serving(
    module: Module | None = None,
    *,
    server: StreamServer | None = None,
    train: Any = None,
    val: Any = None,
    plugins: tuple[Plugin, ...] = (),
    **trainer_options: Any,
) -> AsyncIterator[Run]:
    """Run ``fit`` in the background with a stream server; yields once it listens. The
    run is held at ``FitStarted`` until ``run.gate.go.set()``; leaving the block waits
    for the run to finish (so set the gate before that)."""
    server = server if server is not None else StreamServer(scope="stage", announce=False)
    gate = Gate()
    trainer_options.setdefault("max_epochs", 1)
    trainer = Trainer(plugins=[server, gate, *plugins], **trainer_options)
    run = Run(server, gate, trainer)
    subscription = trainer.subscribe(PutRecord, run.captured.append, destination="external")

    async def fit() -> None:
        await trainer.fit(
            module if module is not None else TinyModule(),
            train if train is not None else make_loader(64),
            val,
        )
        run.done.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(fit)
            with anyio.fail_after(30):
                await gate.started.wait()
            yield run
    finally:
        subscription.unsubscribe()


def frame(payload: bytes) -> bytes:
    return len(payload).to_bytes(4, "big") + payload


def encode_frames(*messages: Any) -> bytes:
    buffer = bytearray()
    encoder = msgspec.msgpack.Encoder()
    for message in messages:
        append_frame(encoder, message, buffer)
    return bytes(buffer)


HELLO = encode_frames(Hello(version=1, client="test"))
HELLO_SUBSCRIBE = encode_frames(Hello(version=1, client="test"), Subscribe())


async def exchange(address: str, payload: bytes, *, within: float = 10.0) -> list[Any]:
    """Send ``payload`` on a fresh connection, half-close, and return every message the
    server sends until it closes the connection."""
    decoder = msgspec.msgpack.Decoder(ServerMessage)
    reader = FrameReader(MAX_SERVER_FRAME)
    messages: list[Any] = []
    stream = await parse_address(address).connect()
    async with stream:
        with anyio.fail_after(within):
            try:
                await stream.send(payload)
                await stream.send_eof()
            except (anyio.BrokenResourceError, OSError):
                pass  # the server may already have closed on a bad prefix
            while True:
                try:
                    data = await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
                    break
                messages += [decoder.decode(f) for f in reader.feed(data)]
    return messages
