"""A client that floods the server with Subscribe frames: each bound on subscribing closes
it with a ``Bye`` naming that bound, without the server reading more of it; what the
server holds for it stays bounded; connections are accepted at a bounded rate, and not at
all for a while after one is closed for passing a bound; a client that subscribes a few
times notices nothing."""

from __future__ import annotations

import fnmatch
import tracemalloc
from collections import deque
from typing import Any, cast

import anyio
import msgspec
import pytest

import loopbus
from loopbus import PutRecord
from loopbus.stream import Server
from loopbus.stream._connection import Connection, Rejected, matcher, pattern_cost
from loopbus.stream._fanout import Fanout
from loopbus.stream._limits import (
    ACCEPT_BURST,
    PATTERN_BURST,
    READ_AHEAD,
    RECEIVE_SIZE,
    UNREAD_ACKS,
    Allowance,
    Limits,
)
from loopbus.stream._sessions import Sessions
from loopbus.stream._wire import MAX_PATTERN_LENGTH, MAX_PATTERNS, FrameReader, Subscribe
from tests.stream.raw_client import RawClient, encode_frame

HELLO = encode_frame({"type": "Hello", "version": 2})


def subscribe_frame(names: list[str]) -> bytes:
    return encode_frame({"type": "Subscribe", "names": names, "topics": ["records"]})


def largest_subscribe(i: int) -> bytes:
    """A Subscribe of 64 patterns of 256 characters, each frame's patterns new (no cache
    of compiled patterns helps the server)."""
    return subscribe_frame(
        [f"flood/{i}/{j}/".ljust(MAX_PATTERN_LENGTH, "?") for j in range(MAX_PATTERNS)]
    )


async def closed_by(client: RawClient) -> tuple[list[Any], dict[str, Any]]:
    """Everything the server sent, and its bye (which must be the last message)."""
    messages = await client.read_to_end()
    assert messages, "the server sent nothing"
    bye = messages[-1]
    assert bye["type"] == "Bye", [m["type"] for m in messages]
    return messages, bye


async def test_a_client_flooding_subscribes_without_reading_is_closed_holding_little() -> None:
    # 200 kB: within what a client may send ahead of what the server handled.
    frames = [largest_subscribe(i) for i in range(12)]
    async with Server(flush_interval=0.01) as server:
        assert server.address is not None
        tracemalloc.start()
        try:
            client = await RawClient.open(server.address, HELLO)
            for frame in frames:  # never reading meanwhile
                await client.send(frame)
            messages, bye = await closed_by(client)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert (server.rejected, server.aborted) == (1, 1)
        with anyio.fail_after(10):
            while server.connected:  # noqa: ASYNC110 - a counter
                await anyio.sleep(0.01)
    # (The bye may be lost for a client whose socket buffers are full; this one's are not.)
    assert bye["code"] == "too_large"
    assert "more than 4,096 characters of name patterns a second" in bye["reason"]
    # Only what the budget allows was applied: four of the largest Subscribe (answers
    # still queued when the client is closed are dropped, as after any error).
    acks = [m for m in messages if m["type"] == "Subscribed"]
    assert len(acks) <= PATTERN_BURST // (MAX_PATTERNS * MAX_PATTERN_LENGTH)
    # The frames sent are 200 kB; what the server held meanwhile is a few of them, the
    # patterns compiled and their answers (unbounded, it grew with every frame).
    assert peak < 8 * 1024 * 1024, peak


async def test_more_subscribes_a_second_than_subscribe_rate_close_the_client() -> None:
    async with Server(flush_interval=0.01, subscribe_rate=1) as server:
        assert server.address is not None
        client = await RawClient.open(server.address, HELLO)
        await client.send(b"".join(subscribe_frame([f"m/{i}"]) for i in range(40)))
        messages, bye = await closed_by(client)
        assert server.rejected == 1
    assert bye["code"] == "too_large"
    assert bye["reason"].startswith("more than 1 Subscribe frames a second (after 20 at once)")
    # The burst, and one more a second after it, at most (answers still queued when the
    # client is closed are dropped, as after any error).
    acks = [m for m in messages if m["type"] == "Subscribed"]
    assert len(acks) < 40


@pytest.mark.parametrize(
    ("names", "reason"),
    [
        (
            ["m"] * (MAX_PATTERNS + 1),
            "invalid Subscribe message: a Subscribe carries at most 64 name patterns; "
            "this one has 65.",
        ),
        (
            ["ok", "x" * (MAX_PATTERN_LENGTH + 1)],
            "invalid Subscribe message: a name pattern has at most 256 characters; "
            "names[1] has 257.",
        ),
    ],
)
async def test_a_subscribe_beyond_the_pattern_limits_is_refused_naming_the_limit(
    names: list[str], reason: str
) -> None:
    async with Server() as server:
        assert server.address is not None
        client = await RawClient.open(server.address, HELLO + subscribe_frame(names))
        messages, bye = await closed_by(client)
    assert [m["type"] for m in messages] == ["Welcome", "Bye"]
    assert (bye["code"], bye["reason"]) == ("malformed", reason)


async def test_answers_a_client_does_not_read_are_bounded() -> None:
    # The writer is not running, as when the socket's buffers are full: the answers wait.
    fanout = Fanout(deque(), lambda wanted: None)
    client = Connection(cast(Any, None), 16, 1024, "peer", subscribe_rate=1000.0)
    fanout.admit(client, stage_bound=False)
    for i in range(UNREAD_ACKS):
        message = Subscribe(names=[f"m/{i}"])
        client.allow(message, now=0.0)
        fanout.subscribe(client, message)
    with pytest.raises(Rejected, match=r"more than 16 Subscribed answers waiting") as caught:
        client.allow(Subscribe(names=["m"]), now=0.0)
    assert caught.value.code == "too_large"
    assert len(client.acks) == UNREAD_ACKS


async def test_a_subscribe_that_repeats_the_filters_matches_nothing_again() -> None:
    client = Connection(cast(Any, None), 16, 1024, "peer", subscribe_rate=10.0)
    assert client.set_filters(["train/*"], ["records"])
    assert client.takes("train/loss")
    assert not client.takes("val/loss")
    match = client.match
    assert not client.set_filters(["train/*"], ["records"])
    assert client.match is match
    assert client.set_filters(["val/*"], ["records"])
    assert client.takes("val/loss")
    assert not client.takes("train/loss")


async def test_a_client_that_subscribes_a_few_times_is_unaffected() -> None:
    async with Server(flush_interval=0.01) as server:
        assert server.address is not None
        async with loopbus.connect(server.address, names=["a/*"]) as stream:
            for names in (["b/*"], ["c/*"], ["a/*", "d/*"], ["*"]):
                await stream.subscribe(names)

            async def publish() -> None:
                # Only the last filters take these names: receiving one shows they apply.
                for step in range(1_000_000):
                    server.publish_record(PutRecord(name=f"x/{step % 7}", value=1.0, step=step))
                    await anyio.sleep(0.002)

            async with anyio.create_task_group() as tg:
                tg.start_soon(publish)
                with anyio.fail_after(30):
                    received = [await stream.__anext__() for _ in range(20)]
                tg.cancel_scope.cancel()
            assert stream.subscribed is not None
            assert stream.subscribed.names == ["*"]
            assert all(isinstance(r, PutRecord) and r.name.startswith("x/") for r in received)
            assert server.rejected == 0
            assert server.subscribers == 1


class FloodStream:
    """A stand-in for a client's socket that sends a Hello, then Subscribe frames for as
    long as the server reads, and never reads: it counts what the server read."""

    def __init__(self, frame: bytes) -> None:
        self.frame = frame
        self.hello_sent = False
        self.read = 0
        self.sent = bytearray()
        self.closed = False

    def extra(self, attribute: Any, default: Any = None) -> Any:
        return default

    async def receive(self, max_bytes: int = RECEIVE_SIZE) -> bytes:
        await anyio.lowlevel.checkpoint()
        data = self.frame if self.hello_sent else HELLO
        self.hello_sent = True
        self.read += len(data)
        return data

    async def send(self, data: bytes) -> None:
        await anyio.lowlevel.checkpoint()
        self.sent += data

    async def send_eof(self) -> None:
        await anyio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        self.closed = True


async def test_a_client_past_a_bound_is_closed_without_reading_more_of_it() -> None:
    sessions = Sessions(
        Fanout(deque(), lambda wanted: None),
        Limits(),
        token=None,
        versions=(1, 2),
        accepting=lambda: True,
    )
    frame = largest_subscribe(0)
    client = FloodStream(frame)
    with anyio.fail_after(10):
        await sessions.handle(cast(Any, client))
    assert client.closed
    assert (sessions.rejected, sessions.aborted) == (1, 1)
    # It read what it may hold ahead of handling, and not a byte of the client's input
    # after it passed that bound (no draining before closing).
    assert client.read <= len(HELLO) + len(frame) + READ_AHEAD + len(frame)
    messages = [
        msgspec.msgpack.decode(payload) for payload in FrameReader(1 << 24).feed(bytes(client.sent))
    ]
    assert [m["type"] for m in messages] == ["Welcome", "Bye"]
    assert messages[-1]["code"] == "too_large"
    assert messages[-1]["reason"] == (
        f"more than {READ_AHEAD:,} bytes sent ahead of what the server handled."
    )


async def test_after_closing_a_client_past_a_bound_the_server_pauses_accepting() -> None:
    async with Server(flush_interval=0.01) as server:
        assert server.address is not None
        flooder = await RawClient.open(
            server.address, HELLO + b"".join(largest_subscribe(i) for i in range(20))
        )
        await flooder.read_to_end()
        assert (server.rejected, server.aborted) == (1, 1)
        assert server.paced == 0
        # The listener took its next turn before the pause: the client that connects next
        # is welcomed, and the listener then waits out the pause before it accepts again.
        async with loopbus.connect(server.address, names=["*"]) as stream:
            assert stream.welcome is not None
            assert server.paced == 1
        async with loopbus.connect(server.address, names=["*"]) as stream:
            assert stream.welcome is not None
        assert server.accepted == 3


async def test_connections_beyond_the_burst_are_accepted_at_accept_rate() -> None:
    n = ACCEPT_BURST + 2
    async with Server(max_clients=n, accept_rate=1.0) as server:
        assert server.address is not None
        clients = [await RawClient.open(server.address, HELLO) for _ in range(n)]
        try:
            for client in clients:
                welcome = await client.read_until(lambda m: True)
                assert welcome["type"] == "Welcome"
        finally:
            for client in clients:
                await client.aclose()
        assert server.accepted == n
        # The burst went in at once; a connection after it waited for its turn (two
        # would not, only if opening each took more than a second: a loaded machine).
        assert server.paced >= 1


def test_accept_rate_is_checked() -> None:
    with pytest.raises(loopbus.MisconfigurationError, match="accept_rate"):
        Server(accept_rate=0)


def test_allowance_pause_holds_back_the_next_unit_however_full_it_was() -> None:
    allowance = Allowance(10.0, 64)
    assert allowance.reserve(1, now=0.0) == 0.0
    allowance.pause(1.0, now=0.0)
    assert allowance.reserve(1, now=0.0) == pytest.approx(1.1)
    # Pauses do not add up.
    fresh = Allowance(10.0, 64)
    fresh.pause(1.0, now=0.0)
    fresh.pause(1.0, now=0.0)
    assert fresh.reserve(1, now=0.0) == pytest.approx(1.1)


@pytest.mark.parametrize(
    "pattern",
    ["*", "train/*", "a?c", "[ab]x", "[!ab]x", "x[a-c]*", "*a*b*", "[]]", "[!]]", "a[", "\\*"],
)
def test_name_patterns_match_as_shell_globs(pattern: str) -> None:
    names = ["", "a", "abc", "ax", "bx", "cx", "]", "x", "xb/y", "train/loss", "a[", "\\x"]
    match = matcher([pattern])
    assert [match(n) for n in names] == [fnmatch.fnmatchcase(n, pattern) for n in names]
    both = matcher([pattern, "train/*"])
    assert [both(n) for n in names] == [
        fnmatch.fnmatchcase(n, pattern) or n.startswith("train/") for n in names
    ]


def test_a_pattern_costs_its_length_and_a_quarter_of_the_width_of_its_ranges() -> None:
    assert pattern_cost("train/*") == 7
    assert pattern_cost("[a-z]") == 5 + 25 // 4
    assert pattern_cost("val-loss") == 8  # "l-l": no width
    assert pattern_cost("[\x00-\uffff]") == 5 + 0xFFFF // 4
    # Ranges beyond the first 65,536 characters compile quickly: only those count.
    assert pattern_cost("[\U00010000-\U0010ffff]") == 5


async def test_patterns_of_wide_ranges_count_against_the_pattern_allowance() -> None:
    client = Connection(cast(Any, None), 16, 1024, "peer", subscribe_rate=10.0)
    wide = "[\x00-\uffff]"
    assert client.allow(Subscribe(names=[wide] * 3), now=0.0) == 3 * pattern_cost(wide)
    with pytest.raises(Rejected, match="characters of name patterns a second") as caught:
        client.allow(Subscribe(names=[wide]), now=0.0)
    assert caught.value.abort
