"""StreamServer and loopbus.connect: what a client receives, in which order, and what a
slow client costs the run (nothing) and itself (a gap notice with the exact count)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch

import loopbus
from loopbus import MisconfigurationError, PutRecord, StreamError
from loopbus.events import TrainBatchCompleted, ValidationStarted
from loopbus.plugins import JSONLLogger, StreamServer, read_jsonl
from loopbus.stream import (
    Bye,
    EpochEnded,
    Gap,
    RawBatch,
    StageEnded,
    Subscribed,
    Welcome,
    parse_address,
)
from tests.helpers import TinyModule, make_loader
from tests.plugins.stream_helpers import HELLO_SUBSCRIBE, ChattyModule, Gate, serving


async def test_client_receives_exactly_the_records_in_order(tmp_path: Path) -> None:
    """Compared with the JSONL log of the same run (and an inline subscriber's copy)."""
    async with serving(
        TinyModule(),
        max_epochs=2,
        train=make_loader(128),
        val=make_loader(32),
        plugins=(JSONLLogger(tmp_path, name="", version=""),),
    ) as run:
        received: list[PutRecord] = []
        seqs: list[int] = []
        async with loopbus.connect(run.address) as stream:
            run.gate.go.set()
            with anyio.fail_after(60):
                async for record in stream:
                    received.append(record)  # type: ignore[arg-type]
                    seqs.append(stream.seq)
    logged = read_jsonl(tmp_path / "records.jsonl")
    assert len(logged) == 2 * (8 + 2)  # train/loss per batch, val/loss per val batch
    # The stream does not carry the run's other destinations: streamed records have
    # ("external",), logged ones all four.
    assert received == [msgspec.structs.replace(r, destinations=("external",)) for r in logged]
    assert logged == run.captured
    assert seqs == list(range(len(received)))
    assert stream.gaps == 0
    assert stream.bye is not None
    assert stream.bye.code == "end"
    assert stream.welcome is not None
    assert stream.welcome.stage == "fit"
    assert run.server.dropped == 0
    assert run.server.errors == 0


async def test_names_filter_and_events_in_run_order() -> None:
    async with serving(
        TinyModule(), max_epochs=2, train=make_loader(64), val=make_loader(32)
    ) as run:
        async with loopbus.connect(run.address, names=["val/*"], topics=["records", "events"]) as s:
            run.gate.go.set()
            with anyio.fail_after(60):
                items = [item async for item in s]
    kinds = [
        type(i).__name__ if not isinstance(i, PutRecord) else i.name for i in items
    ]
    # Two validation batches per epoch, then the epoch's end; the stage's end last.
    assert kinds == ["val/loss", "val/loss", "EpochEnded"] * 2 + ["StageEnded"]
    assert [r for r in items if isinstance(r, PutRecord)] == [
        r for r in run.expected if r.name.startswith("val/")
    ]
    epochs = [i for i in items if isinstance(i, EpochEnded)]
    assert [e.epoch for e in epochs] == [0, 1]
    assert [e.step for e in epochs] == [4, 8]
    end = items[-1]
    assert isinstance(end, StageEnded)
    assert (end.stage, end.reason, end.step) == ("fit", "completed", 8)


async def test_several_clients_each_get_every_record() -> None:
    async with serving(ChattyModule(5), max_epochs=1, train=make_loader(160)) as run:
        results: list[list[Any]] = [[] for _ in range(4)]

        async def read(i: int, stream: loopbus.stream.Stream) -> None:
            async for record in stream:
                results[i].append(record)

        async with (
            loopbus.connect(run.address) as s0,
            loopbus.connect(run.address) as s1,
            loopbus.connect(run.address) as s2,
            loopbus.connect(run.address, names=["train/m1", "train/m[23]"]) as s3,
        ):
            run.gate.go.set()
            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    for i, stream in enumerate((s0, s1, s2, s3)):
                        tg.start_soon(read, i, stream)
    assert len(run.captured) == 10 * 6
    assert results[0] == results[1] == results[2] == run.expected
    assert results[3] == [r for r in run.expected if r.name in ("train/m1", "train/m2", "train/m3")]
    assert run.server.accepted == 4


async def test_unix_socket() -> None:
    with tempfile.TemporaryDirectory(prefix="lb") as tmp:
        path = os.path.join(tmp, "run.sock")
        server = StreamServer(scope="stage", host=None, path=path, announce=False)
        async with serving(TinyModule(), server=server, train=make_loader(64)) as run:
            assert run.address == f"unix://{path}"
            assert server.address == run.address
            assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)
            async with loopbus.connect(run.address) as stream:
                run.gate.go.set()
                with anyio.fail_after(60):
                    received = [r async for r in stream]
        assert received == run.expected
        assert len(received) == 4
        assert not await anyio.Path(path).exists(), "the socket file is removed at the end"
        assert server.address is None


async def test_stalled_client_gets_exact_gap_notice_and_never_slows_the_run() -> None:
    """The client stops reading while 150 steps (15,150 records) run; the run does not
    wait for it. When it resumes it gets what the socket buffers held, a gap notice
    whose count is exactly the number of missing sequence numbers, then the rest."""
    halfway = anyio.Event()

    class Halfway(loopbus.Plugin):
        @loopbus.on(TrainBatchCompleted, once=150)
        def reached(self, event: TrainBatchCompleted) -> None:
            halfway.set()

    marker = Halfway()
    server = StreamServer(scope="stage", client_buffer=1024, send_buffer=16384, announce=False)
    async with serving(
        ChattyModule(100), server=server, max_steps=250, train=make_loader(16 * 250),
        plugins=(marker,),
    ) as run:
        async with loopbus.connect(run.address, yield_gaps=True) as stream:
            run.gate.go.set()
            with anyio.fail_after(120):
                # Not reading: if the run waited for this client it would never get here.
                await halfway.wait()
                items = [item async for item in stream]
    captured = run.expected
    assert len(captured) == 250 * 101
    seq = 0
    gaps = []
    for item in items:
        if isinstance(item, Gap):
            assert item.seq == seq
            gaps.append(item)
            seq += item.count
        else:
            assert item == captured[seq]
            seq += 1
    assert seq == len(captured)
    assert gaps, "the stalled client should have lost records"
    missing = sum(g.count for g in gaps)
    assert missing == stream.gaps == run.server.dropped
    assert len(items) - len(gaps) == len(captured) - missing
    assert stream.bye is not None
    assert stream.bye.code == "end"


async def test_client_that_never_reads_does_not_hold_the_run() -> None:
    # 40,200 records: far more than the socket buffers and the client's queue hold.
    server = StreamServer(scope="stage", send_buffer=16384, linger=0.2, announce=False)
    async with serving(
        ChattyModule(200), server=server, max_steps=200, train=make_loader(3200)
    ) as run:
        async with loopbus.connect(run.address) as stream:
            run.gate.go.set()
            with anyio.fail_after(120):
                await run.done.wait()
            assert run.trainer.global_step == 200
            assert server.dropped > 0
            # The server gave up on the client after `linger`: what the socket held
            # arrives, then the connection ends without a bye.
            with pytest.raises(StreamError, match="without a bye"):
                async for _ in stream:
                    pass
            assert stream.received < len(run.captured)


async def test_server_address_is_published_and_printed(capfd: pytest.CaptureFixture[str]) -> None:
    server = StreamServer(scope="stage")
    async with serving(TinyModule(), server=server) as run:
        assert server.address == run.address
        host_port = parse_address(run.address)
        assert host_port.host == "127.0.0.1"
        assert host_port.port > 0
        run.gate.go.set()
    assert f"streaming records on {run.address}" in capfd.readouterr().err


async def test_connect_refused_and_bad_arguments() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()
    with pytest.raises(StreamError, match=f"could not connect to tcp://127.0.0.1:{port}"):
        async with loopbus.connect(f"tcp://127.0.0.1:{port}"):
            pass
    with pytest.raises(ValueError, match="unknown topic"):
        loopbus.connect("tcp://127.0.0.1:1", topics=["metrics"])
    with pytest.raises(ValueError, match="stream address"):
        loopbus.connect("http://example.com")


def test_parse_address() -> None:
    assert str(parse_address("tcp://127.0.0.1:8765")) == "tcp://127.0.0.1:8765"
    assert str(parse_address("8765")) == "tcp://127.0.0.1:8765"
    assert str(parse_address("localhost:1")) == "tcp://localhost:1"
    assert str(parse_address("tcp://[::1]:9")) == "tcp://[::1]:9"
    assert str(parse_address("unix:///tmp/x.sock")) == "unix:///tmp/x.sock"
    assert parse_address("/tmp/x.sock").path == "/tmp/x.sock"
    for bad in ("", "tcp://host", "host:port", "tcp://h:70000", "udp://h:1", "unix:"):
        with pytest.raises(ValueError, match=r"address|port"):
            parse_address(bad)


def test_server_options_are_validated() -> None:
    with pytest.raises(MisconfigurationError, match="somewhere to listen"):
        StreamServer(host=None)
    with pytest.raises(MisconfigurationError, match=r"port=\.\.\.\) must be an int from 0 to 65535"):
        StreamServer(port=-1)
    with pytest.raises(MisconfigurationError, match=r"client_buffer=\.\.\.\) must be an int >= 1"):
        StreamServer(client_buffer=0)
    with pytest.raises(MisconfigurationError, match=r"linger=\.\.\.\) must be a number of seconds >= 0"):
        StreamServer(linger=-1)
    assert StreamServer.from_address("unix:///tmp/a.sock").path == "/tmp/a.sock"
    assert StreamServer.from_address("tcp://127.0.0.1:5").port == 5


async def test_thread_executor_and_a_new_server_for_each_stage() -> None:
    """Steps in a worker thread change nothing for clients; each stage serves anew
    (a new port with port=0) and ends its clients' streams with a bye."""
    server = StreamServer(scope="stage", announce=False)
    async with serving(
        TinyModule(), server=server, executor="thread", train=make_loader(64)
    ) as run:
        async with loopbus.connect(run.address) as stream:
            run.gate.go.set()
            with anyio.fail_after(60):
                received = [r async for r in stream]
    assert received == run.expected
    assert stream.bye is not None
    assert stream.bye.reason == "the fit stage ended"
    first_address = run.address

    class ValidationGate(Gate):
        @loopbus.on(ValidationStarted)
        async def hold_validation(self, event: ValidationStarted) -> None:
            await self.go.wait()

    gate = ValidationGate()
    trainer = loopbus.Trainer(plugins=[server, gate], executor="thread")
    records: list[Any] = []
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(trainer.validate, TinyModule(), make_loader(64))
            await gate.started.wait()
            async with loopbus.connect(gate.address, topics=["records", "events"]) as stream:
                gate.go.set()
                records = [r async for r in stream]
    assert gate.address != first_address
    assert [type(r).__name__ for r in records] == ["PutRecord"] * 4 + ["StageEnded"]
    assert stream.bye is not None
    assert stream.bye.reason == "the validate stage ended"


async def test_numbers_on_the_wire_as_documented() -> None:
    """docs/protocol.md: floats are float 64 (integral ones included, whatever the
    tensor's dtype), ints the smallest integer format (uint 64 up to 2**64 - 1)."""

    class Numbers(TinyModule):
        def training_step(self, batch: Any, ctx: Any) -> Any:
            self.put("f", 2.0)
            self.put("h", torch.tensor(2.0, dtype=torch.float16))
            self.put("i", 2)
            self.put("u", 2**64 - 1)
            self.put("n", -(2**63))
            self.put("b", True)
            return super().training_step(batch, ctx)

    async with serving(Numbers(), max_steps=1, train=make_loader(16)) as run:
        stream = await parse_address(run.address).connect()
        reader = loopbus.stream.FrameReader(loopbus.stream.MAX_SERVER_FRAME)
        decode = msgspec.msgpack.Decoder(Welcome | Subscribed | RawBatch | Bye).decode
        values: dict[str, bytes] = {}
        async with stream:
            await stream.send(HELLO_SUBSCRIBE)
            await run.wait_for_subscribers(1)
            run.gate.go.set()
            bye = None
            with anyio.fail_after(30):
                while bye is None:
                    for data in reader.feed(await stream.receive()):
                        message = decode(data)
                        if isinstance(message, Bye):
                            bye = message
                        elif isinstance(message, RawBatch):
                            for raw in message.items:
                                # ["R", name, value, ...]: 97 a1 52 a1 <name> <value> ...
                                item = bytes(raw)
                                values[msgspec.msgpack.decode(item)[1]] = item[5:]
    assert bye is not None
    assert bye.code == "end"
    assert values["f"].startswith(bytes.fromhex("cb 40 00 00 00 00 00 00 00"))
    assert values["h"].startswith(bytes.fromhex("cb 40 00 00 00 00 00 00 00"))
    assert values["i"].startswith(bytes.fromhex("02"))
    assert values["u"].startswith(bytes.fromhex("cf ff ff ff ff ff ff ff ff"))
    assert values["n"].startswith(bytes.fromhex("d3 80 00 00 00 00 00 00 00"))
    assert values["b"].startswith(bytes.fromhex("c3"))
