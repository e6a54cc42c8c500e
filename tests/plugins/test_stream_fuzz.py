"""Fuzz the stream server's decoder: random bytes, truncated frames, huge length
prefixes, valid frames of the wrong types, valid messages with garbage fields. Whatever
arrives, the server's tasks never fail (a failure would fail the run), no connection
task hits an unexpected error, the run completes, and a well-behaved client connected
throughout receives every record."""

from __future__ import annotations

from typing import Any

import anyio
import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import loopbus
from loopbus.plugins import StreamServer
from loopbus.stream import (
    Batch,
    Bye,
    Gap,
    Hello,
    Record,
    Subscribe,
    Subscribed,
    Welcome,
)
from tests.helpers import TinyModule, make_loader
from tests.plugins.stream_helpers import (
    HELLO,
    HELLO_SUBSCRIBE,
    encode_frames,
    exchange,
    frame,
    serving,
)

MAX_FRAME = 4096

_VALID = [
    HELLO,
    HELLO_SUBSCRIBE,
    encode_frames(Hello(version=1), Subscribe(names=["train/*", "x[!a]?"], topics=["events"])),
    encode_frames(Hello(version=1), Bye(code="end", reason="bye")),
]
_SERVER_MESSAGES = [
    encode_frames(Welcome(version=1, server="x")),
    encode_frames(Subscribed(seq=0, names=["*"], topics=["records"])),
    encode_frames(Batch(seq=0, items=[Record(name="a", value=1.0)])),
    encode_frames(Gap(seq=3, count=2)),
]

_msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
_message_like = st.fixed_dictionaries(
    {"type": st.sampled_from(["Hello", "Subscribe", "Bye", "Batch", "Welcome", "Gap", "", "?"])},
    optional={
        "version": _msgpack_values,
        "token": _msgpack_values,
        "names": st.lists(st.text(max_size=12), max_size=5) | _msgpack_values,
        "topics": st.lists(st.sampled_from(["records", "events", "x"]), max_size=3)
        | _msgpack_values,
        "code": _msgpack_values,
    },
)


def _truncated(data: bytes) -> st.SearchStrategy[bytes]:
    return st.integers(min_value=0, max_value=len(data) - 1).map(lambda k: data[:k])


_payload = st.one_of(
    st.binary(max_size=256),  # random bytes
    st.binary(max_size=128).map(frame),  # a well-framed random payload
    st.tuples(  # a length prefix beyond the limit, possibly huge
        st.integers(min_value=MAX_FRAME + 1, max_value=2**32 - 1), st.binary(max_size=32)
    ).map(lambda t: t[0].to_bytes(4, "big") + t[1]),
    st.sampled_from(_VALID + _SERVER_MESSAGES).flatmap(_truncated),  # truncated frames
    st.sampled_from(_SERVER_MESSAGES),  # valid frames of the wrong direction
    _msgpack_values.map(lambda v: frame(msgspec.msgpack.encode(v))),  # wrong shapes
    _message_like.map(lambda v: frame(msgspec.msgpack.encode(v))),  # wrong fields
    st.tuples(st.sampled_from(_VALID), st.binary(max_size=64)).map(lambda t: t[0] + t[1]),
    st.tuples(st.sampled_from(_VALID), _message_like).map(
        lambda t: t[0] + frame(msgspec.msgpack.encode(t[1]))
    ),
)


@settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(payloads=st.lists(_payload, min_size=1, max_size=4))
async def test_fuzzed_clients_never_hurt_the_run_or_other_clients(payloads: list[bytes]) -> None:
    server = StreamServer(scope="stage", announce=False, max_frame=MAX_FRAME, handshake_timeout=5.0)
    received: list[Any] = []
    with anyio.fail_after(60):
        async with serving(TinyModule(), server=server, train=make_loader(48)) as run:
            async with loopbus.connect(run.address) as good:
                for payload in payloads:
                    messages = await exchange(run.address, payload)
                    # Whatever the server answered is well-formed protocol.
                    assert all(isinstance(m, (Welcome, Subscribed, Batch, Gap, Bye)) for m in messages)
                run.gate.go.set()
                received = [record async for record in good]
    assert run.done.is_set()
    assert received == run.expected
    assert len(received) == 3
    assert server.errors == 0
