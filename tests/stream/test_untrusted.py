"""Decoding frames from other processes: the nesting bound (checked without recursion),
the client's decoder of what servers send, and what the server says about a frame it
cannot decode. The processes with a raised recursion limit are in test_deep_frames.py."""

from __future__ import annotations

import random
import re
from typing import Any

import msgspec
import pytest

from loopbus.stream import (
    PROTOCOL_VERSION,
    Batch,
    Bye,
    ClientMessage,
    EpochEnded,
    Gap,
    Hello,
    Record,
    StageEnded,
    StageStarted,
    Subscribed,
    Welcome,
)
from loopbus.stream._connection import Rejected, decode_client_message
from loopbus.stream._nesting import MAX_DEPTH, ServerFrames, check_nesting, plain

encode = msgspec.msgpack.encode
TOO_DEEP = "nests arrays and maps more than 32 levels deep"


def depth(value: Any) -> int:
    """Levels of arrays and maps in ``value`` (a decoded MessagePack value)."""
    if isinstance(value, (list, tuple)):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, [*value, *value.values()]), default=0)
    return 0


def random_value(rng: random.Random, levels: int) -> Any:
    """A value nested exactly ``levels`` deep, with every kind of MessagePack value
    around the deepest path (wide arrays and maps take the 16-bit count formats)."""
    scalars = [
        None,
        True,
        rng.randrange(-(2**63), 2**64),
        rng.randrange(-32, 128),
        rng.random(),
        "é" * rng.choice([0, 1, 31, 40, 300]),
        b"\x91\x80" * rng.choice([0, 3, 200]),
        msgspec.msgpack.Ext(rng.randrange(128), b"\x91" * rng.choice([1, 2, 4, 8, 16, 3, 300])),
    ]
    if levels == 0:
        return rng.choice(scalars)
    inner = random_value(rng, levels - 1)
    siblings: list[Any] = [rng.choice(scalars) for _ in range(rng.choice([0, 1, 5, 20]))]
    if levels > 1:  # empty arrays and maps, and shallower values, beside the deepest
        siblings += [[]] * rng.choice([0, 3]) + [{}] * rng.choice([0, 2])
        if rng.random() < 0.3:
            siblings.append(random_value(rng, rng.randrange(min(levels - 1, 3))))
    items = [*siblings, inner]
    rng.shuffle(items)
    if rng.random() < 0.5:
        return items
    mapping: dict[Any, Any] = {f"k{i}": item for i, item in enumerate(items)}
    if rng.random() < 0.5:
        mapping[rng.randrange(1000)] = inner if isinstance(inner, (int, str)) else None
    return mapping


def test_the_nesting_bound_agrees_with_the_decoded_depth() -> None:
    rng = random.Random(1234)
    for levels in [*range(0, 40), *rng.sample(range(40, 200), 10)]:
        for _ in range(5):
            value = random_value(rng, levels)
            data = encode(value)
            assert depth(msgspec.msgpack.decode(data)) == levels
            if levels > MAX_DEPTH:
                with pytest.raises(msgspec.DecodeError, match=TOO_DEEP):
                    check_nesting(data)
            else:
                check_nesting(data)
            # A value cut short is judged on the part present (the decoder reports the
            # truncation); trailing bytes are not looked at.
            cut = data[: rng.randrange(len(data) + 1)]
            try:
                check_nesting(cut)
            except msgspec.DecodeError:
                assert levels > MAX_DEPTH
            check_nesting(encode(random_value(rng, min(levels, MAX_DEPTH))) + data)


@pytest.mark.parametrize(
    ("header", "empty"),
    [
        (b"\x91", b"\x90"),  # fixarray, fixmap
        (b"\x81\xa1k", b"\x80"),
        (b"\xdc\x00\x01", b"\xdc\x00\x00"),  # array 16, 32; map 16, 32
        (b"\xdd\x00\x00\x00\x01", b"\xdf\x00\x00\x00\x00"),
        (b"\xde\x00\x01\x01", b"\x90"),
    ],
)
def test_the_bound_is_32_levels_of_arrays_or_maps(header: bytes, empty: bytes) -> None:
    check_nesting(header * 31 + empty)
    check_nesting(header * 32 + b"\x01")
    with pytest.raises(msgspec.DecodeError, match=TOO_DEEP):
        check_nesting(header * 32 + empty)
    with pytest.raises(msgspec.DecodeError, match=TOO_DEEP):
        check_nesting(header * 100_000 + b"\x01")


def test_bytes_that_only_look_like_arrays_are_not_nesting() -> None:
    # Array headers inside strings, bins and exts are data: not refused, and decoded.
    value = ["\x11" * 40, b"\x91" * 100_000, msgspec.msgpack.Ext(1, b"\x91" * 70_000)]
    data = encode({"type": "Hello", "version": 2, "x": value})
    check_nesting(data)
    assert msgspec.msgpack.decode(data, type=Hello) == Hello(version=2)


SERVER_MESSAGES = [
    Welcome(version=PROTOCOL_VERSION, server="loopbus test", stage="fit", step=3),
    Subscribed(seq=5, names=["train/*"], topics=["records", "events"]),
    Gap(seq=3, count=2),
    Bye(code="end", reason="the fit stage ended"),
    Batch(
        seq=7,
        items=[
            Record(name="train/loss", value=0.5, step=1, epoch=0, time=1.5, source="M"),
            StageStarted(stage="fit", step=0, epoch=0, time=1.0),
            EpochEnded(epoch=0, step=4, time=2.0),
            StageEnded(stage="fit", reason="completed", step=4, epoch=1, time=3.0),
            Record(name="train/acc", value=2**64 - 1),
        ],
    ),
]


@pytest.mark.parametrize("message", SERVER_MESSAGES, ids=lambda m: type(m).__name__)
def test_the_client_decodes_every_server_message(message: Any) -> None:
    decode = ServerFrames().decode
    decoded = decode(encode(message))
    if isinstance(message, Batch):
        assert isinstance(decoded, Batch)
        assert decoded.seq == message.seq
        items = [plain(item) for item in decoded.items]
        assert [type(item) for item in items[1:4]] == [StageStarted, EpochEnded, StageEnded]
        assert items[1:4] == message.items[1:4]
        records = [items[0], items[4]]
        assert all(isinstance(r, Record) for r in records)
        assert [msgspec.structs.asdict(r) for r in records] == [
            msgspec.structs.asdict(r) for r in (message.items[0], message.items[4])
        ]
    else:
        assert type(decoded) is type(message)
        assert decoded == message


def test_the_client_ignores_keys_and_elements_it_does_not_know() -> None:
    """As the protocol says (a later version may add keys), when they nest at most 32
    deep, wherever they are; deeper ones are refused."""
    decode = ServerFrames().decode
    welcome = {"type": "Welcome", "version": PROTOCOL_VERSION, "server": "s"}
    new = {"new": [[1], {"a": [2]}]}
    assert decode(encode({**welcome, **new})) == Welcome(version=PROTOCOL_VERSION, server="s")
    assert decode(encode({**new, "type": "Gap", "seq": 1, "count": 1})) == Gap(seq=1, count=1)
    batch = {"type": "Batch", "seq": 0, "items": [["R", "x", 1.0, 0, 0, 0.0, "", [[3]]]]}
    [record] = decode(encode(batch)).items
    assert (type(record), record.name, record.value) == (Record, "x", 1.0)
    for deep in (b"\x91" * 33 + b"\x90", b"\x91" * 100_000 + b"\x90"):
        for data in (
            b"\x84" + encode(welcome)[1:] + encode("new") + deep,
            b"\x84" + encode("new") + deep + encode({"type": "Gap", "seq": 1, "count": 1})[1:],
            encode(batch)[:-1] + deep,
        ):
            with pytest.raises(msgspec.DecodeError, match=TOO_DEEP):
                decode(data)


def test_the_client_reports_what_is_wrong_with_a_frame() -> None:
    decode = ServerFrames().decode
    with pytest.raises(msgspec.ValidationError, match=r"missing required field `count`"):
        decode(encode({"type": "Gap", "seq": 1}))
    with pytest.raises(msgspec.ValidationError, match=r"Expected `object`, got `array`"):
        decode(encode([1, 2]))
    with pytest.raises(msgspec.DecodeError, match=r"truncated"):
        decode(encode({"type": "Gap", "seq": 1, "count": 1})[:-1])
    with pytest.raises(msgspec.ValidationError, match=r"Invalid value 'Hello'"):
        decode(encode(Hello(version=2)))


_decode_client = msgspec.msgpack.Decoder(ClientMessage).decode
_ARRAY_OR_MAP = "a message must be a msgpack map with a string 'type' key, got"


@pytest.mark.parametrize(
    ("data", "code", "reason"),
    [
        (b"\x91" * 100_000 + b"\x01", "malformed", f"malformed frame: it {TOO_DEEP}"),
        (
            b"\x83"
            + encode({"type": "Hello", "version": 9})[1:]
            + b"\xa1x"
            + b"\x91" * 33
            + b"\x01",
            "malformed",
            f"malformed frame: it {TOO_DEEP}",
        ),
        (b"\x91" * 32 + b"\x01", "malformed", f"{_ARRAY_OR_MAP} array"),
        (encode(None), "malformed", f"{_ARRAY_OR_MAP} nil"),
        (encode("Hello"), "malformed", f"{_ARRAY_OR_MAP} str"),
        (encode({1: "Hello"}), "malformed", f"{_ARRAY_OR_MAP} a map with a key that is not a str"),
        (encode({"kind": "Hello"}), "malformed", f"{_ARRAY_OR_MAP} a map without 'type'"),
        (encode({"type": 1.5}), "malformed", f"{_ARRAY_OR_MAP} a map whose 'type' is float"),
        (encode({"type": [[1]]}), "malformed", f"{_ARRAY_OR_MAP} a map whose 'type' is array"),
        (encode({"type": "Gap"}), "unexpected", "unknown message type 'Gap'"),
        (encode({"type": "Hello", "version": True}), "malformed", "invalid Hello message"),
        (encode({"type": "Subscribe", "names": "*"}), "malformed", "invalid Subscribe message"),
        (b"\xc1", "malformed", "malformed frame: MessagePack data is malformed"),
    ],
)
def test_the_server_says_what_is_wrong_with_a_frame(data: bytes, code: str, reason: str) -> None:
    with pytest.raises(Rejected, match=re.escape(reason)) as caught:
        decode_client_message(_decode_client, data)
    assert caught.value.code == code


def test_the_server_judges_a_hello_of_another_version_by_its_version_alone() -> None:
    data = encode({"type": "Hello", "version": 99, "token": 5, "new": [[{"a": 1}]]})
    assert decode_client_message(_decode_client, data) == Hello(version=99)
    data = encode({"type": "Hello", "version": 1, "new": [[{"a": 1}]]})
    assert decode_client_message(_decode_client, data) == Hello(version=1)
