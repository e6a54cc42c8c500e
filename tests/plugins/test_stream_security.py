"""What the stream server accepts: loopback unless there is a token, the right token,
the right protocol version, and well-formed frames of client message types. Anything
else closes that client with a reason; the run and the other clients carry on."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

import loopbus
from loopbus import MisconfigurationError, StreamError
from loopbus.plugins import StreamServer
from loopbus.stream import Batch, Bye, Gap, Hello, Record, Subscribe
from tests.helpers import TinyModule, make_loader
from tests.plugins.stream_helpers import (
    HELLO,
    HELLO_SUBSCRIBE,
    encode_frames,
    exchange,
    frame,
    serving,
)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10", "example.com", ""])
def test_binding_beyond_loopback_needs_a_token(host: str) -> None:
    with pytest.raises(MisconfigurationError, match=r"token|host=\.\.\.\) must be"):
        StreamServer(host=host)


def test_binding_beyond_loopback_with_a_token_is_allowed() -> None:
    server = StreamServer(scope="stage", host="0.0.0.0", token="a-long-random-secret")
    assert server.token == "a-long-random-secret"
    for host in ("127.0.0.1", "127.1.2.3", "::1", "localhost"):
        assert StreamServer(host=host).host == host
    with pytest.raises(MisconfigurationError, match=r"token=\.\.\.\) must be a non-empty str"):
        StreamServer(host="0.0.0.0", token="")


async def test_token_is_checked() -> None:
    server = StreamServer(scope="stage", token="s3cret", announce=False)
    async with serving(TinyModule(), server=server, train=make_loader(32)) as run:
        with pytest.raises(StreamError, match=r"\(auth\): wrong token"):
            async with loopbus.connect(run.address, token="wrong"):
                pass
        with pytest.raises(StreamError, match=r"\(auth\): this server requires a token"):
            async with loopbus.connect(run.address):
                pass
        async with loopbus.connect(run.address, token="s3cret") as stream:
            run.gate.go.set()
            received = [r async for r in stream]
    assert received == run.expected
    assert server.rejected == 2
    assert server.accepted == 1


def _bye(messages: list[object]) -> Bye:
    assert messages, "the server sent nothing"
    last = messages[-1]
    assert isinstance(last, Bye), messages
    return last


async def test_bad_input_closes_only_that_client_with_a_reason() -> None:
    server = StreamServer(scope="stage", announce=False, max_frame=1024)
    encode = msgspec.msgpack.encode
    async with serving(TinyModule(), server=server, train=make_loader(64)) as run:
        async with loopbus.connect(run.address) as good:
            cases: list[tuple[bytes, str, str]] = [
                (b"\xff\xff\xff\xff", "too_large", "4294967295 bytes, more than the limit"),
                (frame(b"\x00" * 2000), "too_large", "more than the limit of 1024"),
                (frame(b"\xc1"), "malformed", "malformed frame"),
                (frame(b""), "malformed", "malformed frame"),
                # Refused for its nesting, before anything decodes it: the same reason
                # whatever the process's recursion limit (tests/stream/test_deep_frames.py).
                (
                    frame(b"\x91" * 1000 + b"\x01"),
                    "malformed",
                    "nests arrays and maps more than 32 levels deep",
                ),
                (
                    frame(b"\x83\xa4type\xa5Hello\xa7version\x01\xa1x" + b"\x91" * 900 + b"\x01"),
                    "malformed",
                    "nests arrays and maps more than 32 levels deep",
                ),
                (  # (msgspec words it "can't decode" in 0.22, "Invalid UTF-8" in 0.23)
                    frame(b"\x82\xa4type\xa5Hello\xa5token\xa1\x80"),
                    "malformed",
                    "utf-8",
                ),
                (
                    frame(encode([1, 2, 3])),
                    "malformed",
                    "a msgpack map with a string 'type' key, got array",
                ),
                (frame(encode({"kind": "Hello"})), "malformed", "got a map without 'type'"),
                (
                    encode_frames(Gap(seq=0, count=1)),
                    "unexpected",
                    "unknown message type 'Gap'",
                ),
                (
                    encode_frames(Batch(seq=0, items=[])),
                    "unexpected",
                    "unknown message type 'Batch'",
                ),
                (
                    frame(encode({"type": "Hello", "version": "one"})),
                    "malformed",
                    "invalid Hello message",
                ),
                (encode_frames(Subscribe()), "unexpected", "first message must be Hello"),
                (encode_frames(Hello(version=99)), "version", "asked for version 99"),
                (HELLO + HELLO, "unexpected", "unexpected Hello"),
                (
                    HELLO + frame(encode({"type": "Subscribe", "topics": ["metrics"]})),
                    "malformed",
                    "unknown topic",
                ),
                (
                    HELLO + frame(encode({"type": "Subscribe", "names": ["x" * 300]})),
                    "malformed",
                    "invalid Subscribe message",
                ),
                (HELLO_SUBSCRIBE + b"\x00\x00", "", ""),  # a truncated frame, then EOF
            ]
            for payload, code, reason in cases:
                messages = await exchange(run.address, payload)
                if not code:
                    assert not any(isinstance(m, Bye) for m in messages)
                    continue
                bye = _bye(messages)
                assert bye.code == code, (payload, bye)
                assert reason.lower() in bye.reason.lower(), (payload, bye)
            assert server.rejected == len(cases) - 1
            run.gate.go.set()
            received = [r async for r in good]
    assert received == run.expected
    assert server.errors == 0


async def test_handshake_timeout_and_too_many_clients() -> None:
    server = StreamServer(scope="stage", announce=False, handshake_timeout=0.2, max_clients=1)
    async with serving(TinyModule(), server=server, train=make_loader(32)) as run:
        stream = await loopbus.stream.parse_address(run.address).connect()
        async with stream:
            data = await stream.receive()
        assert msgspec.msgpack.decode(data[4:], type=Bye).code == "timeout"
        async with loopbus.connect(run.address) as first:
            with pytest.raises(StreamError, match=r"\(busy\)"):
                async with loopbus.connect(run.address):
                    pass
            run.gate.go.set()
            assert len([r async for r in first]) == len(run.captured) == 2


async def test_raw_handshake_matches_the_documented_protocol() -> None:
    """Speak the protocol by hand, as a client in another language would: plain msgpack
    maps, length-prefixed; records as ``["R", name, value, step, epoch, time, source]``."""
    async with serving(TinyModule(), train=make_loader(32)) as run:
        stream = await loopbus.stream.parse_address(run.address).connect()
        reader = loopbus.stream.FrameReader(loopbus.stream.MAX_SERVER_FRAME)
        frames: list[Any] = []

        async def until(n: int) -> None:
            while len(frames) < n or (n < 0 and frames[-1].get("type") != "Bye"):
                frames.extend(msgspec.msgpack.decode(f) for f in reader.feed(await stream.receive()))

        async with stream:
            await stream.send(frame(msgspec.msgpack.encode({"type": "Hello", "version": 1})))
            await until(1)
            await stream.send(
                frame(msgspec.msgpack.encode({"type": "Subscribe", "names": ["train/*"]}))
            )
            await until(2)
            run.gate.go.set()
            await until(-1)
    welcome, subscribed, *batches, bye = frames
    assert welcome["type"] == "Welcome"
    assert (welcome["version"], welcome["stage"], welcome["step"]) == (1, "fit", 0)
    assert subscribed == {
        "type": "Subscribed",
        "seq": 0,
        "names": ["train/*"],
        "topics": ["records"],
    }
    assert all(b["type"] == "Batch" for b in batches)
    assert batches[0]["seq"] == 0
    items = [item for b in batches for item in b["items"]]
    assert items == [
        ["R", r.name, r.value, r.step, r.epoch, r.time, r.source] for r in run.captured
    ]
    assert bye == {"type": "Bye", "code": "end", "reason": "the fit stage ended"}
    typed = msgspec.msgpack.decode(msgspec.msgpack.encode(batches[0]), type=Batch)
    assert typed.items[0] == Record(
        name="train/loss",
        value=run.captured[0].value,
        step=run.captured[0].step,
        time=run.captured[0].time,
        source="TinyModule",
    )


# One test per rule of docs/protocol.md on which error a client gets. Each sends raw
# bytes on a fresh connection and reads everything the server answers.


async def _answers(payload: bytes) -> list[Any]:
    async with serving(TinyModule(), train=make_loader(32)) as run:
        messages = await exchange(run.address, payload)
        run.gate.go.set()
    assert run.server.errors == 0
    return messages


async def test_a_map_without_type_is_malformed() -> None:
    bye = _bye(await _answers(frame(msgspec.msgpack.encode({"version": 1}))))
    assert (bye.code, bye.reason) == (
        "malformed",
        "a message must be a msgpack map with a string 'type' key, got a map without 'type'.",
    )


@pytest.mark.parametrize("kind", [1, None, True, 1.5, b"Hello", ["Hello"], {"a": 1}])
async def test_a_map_with_a_type_that_is_not_a_string_is_malformed(kind: Any) -> None:
    payload = frame(msgspec.msgpack.encode({"type": kind, "version": 1}))
    bye = _bye(await _answers(payload))
    assert bye.code == "malformed", bye
    assert "a msgpack map with a string 'type' key, got a map whose 'type' is" in bye.reason


async def test_an_unknown_type_name_is_unexpected() -> None:
    bye = _bye(await _answers(frame(msgspec.msgpack.encode({"type": "Hola", "version": 1}))))
    assert (bye.code, bye.reason[:29]) == ("unexpected", "unknown message type 'Hola'; ")


@pytest.mark.parametrize("version", [-1, 0, 3, 2**63 - 1, -(2**63), 2**64 - 1])
async def test_a_hello_with_another_integer_version_is_version(version: int) -> None:
    messages = await _answers(frame(msgspec.msgpack.encode({"type": "Hello", "version": version})))
    assert len(messages) == 1
    bye = _bye(messages)
    assert bye.code == "version", bye
    assert f"asked for version {version}." in bye.reason


async def test_a_hello_with_another_version_is_version_whatever_its_other_keys() -> None:
    """A later protocol version may change the other keys: the version is judged first."""
    hello = {"type": "Hello", "version": 3, "token": {"scheme": "new"}, "client": ["x"]}
    bye = _bye(await _answers(frame(msgspec.msgpack.encode(hello))))
    assert bye.code == "version", bye


@pytest.mark.parametrize("version", ["1", 1.0, None, True, [1]])
async def test_a_hello_whose_version_is_not_an_integer_is_malformed(version: Any) -> None:
    payload = frame(msgspec.msgpack.encode({"type": "Hello", "version": version}))
    bye = _bye(await _answers(payload))
    assert bye.code == "malformed", bye
    assert "invalid Hello message" in bye.reason


async def test_a_hello_without_version_is_malformed() -> None:
    bye = _bye(await _answers(frame(msgspec.msgpack.encode({"type": "Hello"}))))
    assert (bye.code, bye.reason) == (
        "malformed",
        "invalid Hello message: Object missing required field `version`",
    )


_TRAILERS = {
    "garbage": frame(b"\xc1"),
    "a map without type": frame(msgspec.msgpack.encode({"version": 1})),
    "an unknown type": encode_frames(Gap(seq=0, count=1)),
    "a length prefix above max_frame": b"\xff\xff\xff\xff",
    "a truncated frame": b"\x00\x00\x00\x10\x82",
    "a valid Subscribe": encode_frames(Subscribe()),
}


@pytest.mark.parametrize("trailer", list(_TRAILERS), ids=list(_TRAILERS))
async def test_a_bad_hello_is_judged_alone_whatever_follows_in_the_same_read(
    trailer: str,
) -> None:
    """Only the first frame is judged; the bytes after it, sent in the same write, are
    ignored once the server answered with an error."""
    for hello, code in [
        (encode_frames(Hello(version=99)), "version"),
        (frame(msgspec.msgpack.encode({"type": "Hello", "version": "1"})), "malformed"),
        (encode_frames(Subscribe()), "unexpected"),
    ]:
        messages = await _answers(hello + _TRAILERS[trailer])
        assert len(messages) == 1, messages
        assert _bye(messages).code == code, (trailer, messages)


@pytest.mark.parametrize(
    ("trailer", "code"),
    [
        ("garbage", "malformed"),
        ("a map without type", "malformed"),
        ("an unknown type", "unexpected"),
        ("a length prefix above max_frame", "too_large"),
    ],
)
async def test_a_good_hello_is_welcomed_before_what_follows_in_the_same_read_is_judged(
    trailer: str, code: str
) -> None:
    messages = await _answers(HELLO + _TRAILERS[trailer])
    assert [type(m).__name__ for m in messages] == ["Welcome", "Bye"], messages
    assert _bye(messages).code == code
