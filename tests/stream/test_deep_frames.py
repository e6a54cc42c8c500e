"""Frames nested as deep as the frame limits allow, against processes that raised their
recursion limit (``sys.setrecursionlimit(200_000)``): the run and the client survive,
the peer that sent them is told why, the other clients lose nothing.

Decoders recurse once per level of nesting and stop only at the recursion limit, so
without a bound on the nesting a 60 kB frame overflows the C stack of such a process (a
segmentation fault: the run dies, nothing saved since its last checkpoint). The peers run
in subprocesses (``deep_frames_script.py``), so a crash is an exit code, not a dead test
session.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
from anyio.abc import SocketAttribute, SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream

import loopbus
from loopbus.stream import (
    MAX_CLIENT_FRAME,
    MAX_SERVER_FRAME,
    PROTOCOL_VERSION,
    Bye,
    Hello,
    Subscribe,
    Subscribed,
    Welcome,
)
from tests.helpers import ROOT
from tests.plugins.stream_helpers import encode_frames, exchange, frame

pytestmark = pytest.mark.external

SCRIPT = [sys.executable, "-m", "tests.stream.deep_frames_script"]
#: What the refusal says, whatever the recursion limit.
TOO_DEEP = "nests arrays and maps more than 32 levels deep"
encode = msgspec.msgpack.encode


def nested(size: int) -> bytes:
    """``size`` bytes of MessagePack: an array in an array in ... (``size - 1`` levels)."""
    return b"\x91" * (size - 1) + b"\xc0"


def with_deep_key(fields: dict[str, Any], size: int, *, first: bool = False) -> bytes:
    """``size`` bytes of MessagePack: the map ``fields`` with one more key, ``"x"``
    (the first key or the last), whose value nests as deep as the size allows."""
    body = encode(fields)
    assert 0x80 <= body[0] < 0x8F
    head, key = bytes([body[0] + 1]), encode("x")
    deep = nested(size - len(body) - len(key))
    return head + key + deep + body[1:] if first else head + body[1:] + key + deep


def record_with_deep_element(size: int) -> bytes:
    """``size`` bytes: a batch whose one record array has an 8th element, nested deep."""
    body = encode({"type": "Batch", "seq": 0})
    record = b"\x98" + b"".join(encode(v) for v in ("R", "train/loss", 1.0, 0, 0, 0.0, ""))
    head = bytes([body[0] + 1]) + body[1:] + encode("items") + b"\x91" + record
    return head + nested(size - len(head))


async def _line(reader: BufferedByteReceiveStream) -> str:
    return (await reader.receive_until(b"\n", 1 << 20)).decode()


@pytest.mark.parametrize(("scope", "token"), [("stage", None), ("trainer", "s3cret")])
async def test_the_deepest_client_frames_close_that_client_and_the_run_finishes(
    anyio_backend: tuple[str, Any], tmp_path: Path, scope: str, token: str | None
) -> None:
    """Before and after the handshake, a frame nested as deep as ``max_frame`` allows
    (an array, or a message with a deep key) gets ``Bye(malformed)`` saying so."""
    handshake = encode_frames(
        Hello(version=PROTOCOL_VERSION, token=token, client="test"), Subscribe()
    )
    hello = {"type": "Hello", "version": PROTOCOL_VERSION}
    hostile = {
        "an array, first": frame(nested(MAX_CLIENT_FRAME)),
        "a Hello with a deep key": frame(with_deep_key(hello, MAX_CLIENT_FRAME)),
        "a Hello with a deep first key": frame(with_deep_key(hello, MAX_CLIENT_FRAME, first=True)),
        "an array, after the handshake": handshake + frame(nested(MAX_CLIENT_FRAME)),
        "a Subscribe with a deep key, after the handshake": handshake
        + frame(with_deep_key({"type": "Subscribe"}, MAX_CLIENT_FRAME)),
    }
    command = [*SCRIPT, "serve", anyio_backend[0], scope, token or "-"]
    with (tmp_path / "stderr").open("wb") as stderr:
        process = await anyio.open_process(
            command, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr
        )
    async with process:
        assert process.stdin is not None
        assert process.stdout is not None
        lines = BufferedByteReceiveStream(process.stdout)
        try:
            with anyio.fail_after(120):
                address = (await _line(lines)).split()[1]
                async with loopbus.connect(address, token=token) as good:
                    for what, payload in hostile.items():
                        messages = await exchange(address, payload)
                        assert messages, f"{what}: no answer (did the run crash?)"
                        bye = messages[-1]
                        assert isinstance(bye, Bye), (what, messages)
                        assert bye.code == "malformed", (what, bye)
                        assert TOO_DEEP in bye.reason, (what, bye)
                    await process.stdin.send(b"go\n")
                    received = [item async for item in good]
                put = int((await _line(lines)).split()[1])
                code = await process.wait()
        finally:
            if process.returncode is None:
                process.kill()
    assert code == 0, (tmp_path / "stderr").read_text()
    assert good.bye is not None
    assert good.bye.code == "end"
    assert good.gaps == 0
    assert len(received) == put > 0


async def _hostile_server(stream: SocketStream, payload: bytes) -> None:
    """Read the client's Hello, send ``payload``, then read until the client leaves."""
    async with stream:
        received = b""
        while len(received) < 4 or len(received) < 4 + int.from_bytes(received[:4], "big"):
            received += await stream.receive()
        await stream.send(payload)
        try:
            while True:
                await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            pass


async def test_the_deepest_server_frames_end_the_stream_with_a_clear_error(
    anyio_backend: tuple[str, Any], tmp_path: Path
) -> None:
    """A hostile server sends, instead of a valid handshake or after one, a frame nested
    as deep as the client's 16 MiB limit allows: the client says what was wrong."""
    handshake = encode_frames(
        Welcome(version=PROTOCOL_VERSION, server="hostile"),
        Subscribed(seq=0, names=["*"], topics=["records"]),
    )
    welcome = {"type": "Welcome", "version": PROTOCOL_VERSION, "server": "hostile"}
    hostile = {
        "an array instead of a Welcome": frame(nested(MAX_SERVER_FRAME)),
        "a Welcome with a deep key": frame(with_deep_key(welcome, MAX_SERVER_FRAME)),
        "a Gap with a deep first key, after the handshake": handshake
        + frame(with_deep_key({"type": "Gap", "seq": 0, "count": 1}, MAX_SERVER_FRAME, first=True)),
        "a record with a deep element, after the handshake": handshake
        + frame(record_with_deep_element(MAX_SERVER_FRAME)),
    }
    payloads = iter(hostile.values())  # one per connection, in order

    async def serve(stream: SocketStream) -> None:
        await _hostile_server(stream, next(payloads))

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(SocketAttribute.local_port)
        address = f"tcp://127.0.0.1:{port}"
        command = [*SCRIPT, "connect", anyio_backend[0], address, str(len(hostile))]
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, serve)
            with (tmp_path / "stderr").open("wb") as stderr:
                with anyio.fail_after(120):
                    result = await anyio.run_process(command, cwd=ROOT, stderr=stderr, check=False)
            tg.cancel_scope.cancel()
    assert result.returncode == 0, (tmp_path / "stderr").read_text()
    lines = result.stdout.decode().splitlines()
    assert len(lines) == len(hostile), lines
    for what, line in zip(hostile, lines, strict=True):
        assert line.startswith(f"error StreamError: {address} sent an invalid frame"), (what, line)
        assert TOO_DEEP in line, (what, line)
