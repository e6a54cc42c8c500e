"""The history reaches a page in bounded chunks, at the page's pace: a page that reads
gets all of it, chunk after chunk; pages that never read hold a chunk each, not a copy
of the history; a page that lags behind the live messages is told what it missed; and
nothing of a page stays in the hub once it went. In process, against the ASGI app."""

from __future__ import annotations

import gc
import math
import tracemalloc
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path

import anyio
import anyio.lowlevel
import msgspec
from starlette.applications import Starlette
from starlette.types import Message

import loopbus.dashboard
from loopbus.dashboard import MESSAGE_POINTS, Hub, Page, routes
from tests.dashboard.sse import Event, parse, request

#: A gate a page's connection passes each chunk through: returns once the page took it.
Gate = Callable[[bytes], Awaitable[None]]


def _hub(flushes: int, records: int, *, chunk_bytes: int, history: int = 10**7) -> Hub:
    """A hub whose log holds ``flushes`` messages of ``records`` records each."""
    hub = Hub(chunk_bytes=chunk_bytes, history=history)
    run = hub.add_run("job", "tcp://127.0.0.1:1")
    run.started("fit", 0, 0)
    _put(hub, flushes, records)
    return hub


def _put(hub: Hub, flushes: int, records: int) -> None:
    run = hub.runs[0]
    for _ in range(flushes):
        step = run.step + 1
        for i in range(records):
            run.record(f"train/m{i % 4}", math.sin(step * records + i), step + i // 4, 0)
        hub.flush()


async def _open_page(app: Starlette, gate: Gate, gone: anyio.Event) -> None:
    """A page that asks for ``/events``, takes each chunk through ``gate``, and goes when
    ``gone`` is set."""

    async def receive() -> Message:
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            await gate(message["body"])

    await app(request("/events"), receive, send)


def _data(events: list[Event]) -> list[Event]:
    return [e for e in events if e.event == "data"]


async def test_a_page_gets_the_whole_history_in_bounded_chunks_one_at_a_time() -> None:
    hub = _hub(200, 20, chunk_bytes=4096)  # about 100 kB of messages of about 500 bytes
    history = hub.read(0)[1]
    assert max(map(len, history)) < 2048
    app = Starlette(routes=routes(hub))
    chunks: list[bytes] = []
    gone = anyio.Event()

    async def gate(chunk: bytes) -> None:
        # The hub made this chunk and no other: the next one waits until this is taken.
        [page] = hub.pages
        assert (page.chunks, page.queued, hub.queued) == (len(chunks) + 1, len(chunk), len(chunk))
        chunks.append(chunk)
        await anyio.lowlevel.checkpoint()  # a page that reads slowly
        if page.position == hub.next_id:
            gone.set()

    with anyio.fail_after(30):
        await _open_page(app, gate, gone)
    assert len(chunks) >= 20
    assert all(len(chunk) <= 4096 for chunk in chunks)
    events = parse(b"".join(chunks).decode())
    assert events[0].event == "status"
    data = _data(events)
    # Reassembled, the page's history is the hub's, message for message, with its ids.
    assert [e.data.encode() for e in data] == history
    assert [e.id for e in data] == [str(i) for i in range(len(history))]
    assert hub.pages == ()


async def test_pages_that_never_read_hold_a_chunk_each_and_nothing_once_gone() -> None:
    hub = _hub(500, 100, chunk_bytes=16384)  # about 1 MB of history
    history_bytes = sum(map(len, hub.read(0)[1]))
    assert history_bytes > 900_000
    app = Starlette(routes=routes(hub))
    pages: list[weakref.ref[Page]] = []

    async def open_pages(count: int) -> tuple[int, int]:
        """``count`` pages that never read, until each was handed its first chunk; then
        they go. Returns the memory held meanwhile: (all of it, the dashboard's own)."""
        gone = anyio.Event()

        async def never_reads(chunk: bytes) -> None:
            await gone.wait()  # the connection takes nothing until the page goes

        async with anyio.create_task_group() as tg:
            for _ in range(count):
                tg.start_soon(_open_page, app, never_reads, gone)
            with anyio.fail_after(30):
                while not _each_has_a_chunk(hub, count):  # noqa: ASYNC110 - counters, no event
                    await anyio.sleep(0.01)
            await anyio.wait_all_tasks_blocked()
            held = _traced()
            assert all((p.chunks, p.sent) == (1, 0) for p in hub.pages)
            assert all(0 < p.queued <= 16384 for p in hub.pages)
            assert hub.queued == sum(p.queued for p in hub.pages) <= count * 16384
            assert msgspec.json.decode(hub.status())["pages"] == count
            pages.extend(weakref.ref(p) for p in hub.pages)
            gone.set()
        return held

    tracemalloc.start()
    try:
        await open_pages(1)  # what the first request imports and caches is not a page's
        pages.clear()
        gc.collect()
        baseline = _traced()
        held = await open_pages(30)
        gc.collect()
        left = _traced()
    finally:
        tracemalloc.stop()
    # 30 copies of the history would be 30 MB: the pages hold a chunk each (the
    # dashboard's own allocations), and what the web framework needs per response.
    assert held[1] - baseline[1] <= 30 * (16384 + 1024), held[1] - baseline[1]
    assert held[0] - baseline[0] < 30 * 256 * 1024, held[0] - baseline[0]
    # Once gone, the hub keeps nothing of them.
    assert hub.pages == ()
    assert hub.queued == 0
    assert [p() for p in pages] == [None] * 30
    assert left[1] - baseline[1] == 0, left[1] - baseline[1]
    assert left[0] - baseline[0] < 30 * 16384, left[0] - baseline[0]


def _each_has_a_chunk(hub: Hub, pages: int) -> bool:
    return len(hub.pages) == pages and all(page.chunks for page in hub.pages)


def _traced() -> tuple[int, int]:
    """Bytes allocated now and traced by tracemalloc: (all, by the dashboard's code)."""
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, str(Path(loopbus.dashboard.__file__).parent / "*"))]
    )
    return tracemalloc.get_traced_memory()[0], sum(t.size for t in snapshot.traces)


async def test_a_page_that_lags_behind_live_messages_is_told_what_it_missed() -> None:
    hub = _hub(10, 100, chunk_bytes=8192, history=2000)  # 20 messages kept at most
    app = Starlette(routes=routes(hub))
    gone = anyio.Event()
    stalled = anyio.Event()
    release = anyio.Event()
    chunks: list[bytes] = []

    async def lags(chunk: bytes) -> None:
        chunks.append(chunk)
        if len(chunks) == 1:
            stalled.set()
            await release.wait()
        [page] = hub.pages
        if page.position == hub.next_id:
            gone.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(_open_page, app, lags, gone)
        with anyio.fail_after(30):
            await stalled.wait()
        [page] = hub.pages
        queued, position = page.queued, page.position
        _put(hub, 40, 100)  # live messages while the page does not read
        # It holds the chunk it was handed, no more: the log is shared, not copied.
        assert (page.queued, page.position, page.chunks, hub.queued) == (
            queued,
            position,
            1,
            queued,
        )
        assert hub.first > position
        # The hub's own history stays within its bound, and says its size.
        assert hub.kept_bytes == sum(map(len, hub.read(0)[1]))
        assert msgspec.json.decode(hub.status())["history_bytes"] == hub.kept_bytes
        release.set()
    events = parse(b"".join(chunks).decode())
    [forgotten] = [e for e in events if e.event == "forgotten"]
    assert int(forgotten.data) == hub.first - position
    data = _data(events)
    assert [int(e.id) for e in data] == [*range(position), *range(hub.first, hub.next_id)]
    assert [e.data.encode() for e in data[position:]] == hub.read(0)[1]
    assert all(len(chunk) <= 8192 for chunk in chunks)


def test_a_big_flush_becomes_messages_of_bounded_size_and_the_history_counts_markers() -> None:
    hub = Hub(chunk_bytes=4096)
    run = hub.add_run("job")
    other = hub.add_run("other")
    points = 2 * MESSAGE_POINTS + 10
    for step in range(points):
        run.record("train/loss", 1.0 / (step + 1), step, 0)
    run.epoch_ended(0, points - 1)
    other.record("val/loss", 0.5, 7, 0)
    assert hub.flush() == points + 1
    messages = [msgspec.json.decode(m) for m in hub.read(0)[1]]
    assert [m["id"] for m in messages] == [0, 1, 2]
    sizes = [sum(len(c[0]) for p in m["parts"] for c in p["records"].values()) for m in messages]
    assert sizes == [MESSAGE_POINTS, MESSAGE_POINTS, 11]
    steps = [
        s
        for m in messages
        for p in m["parts"]
        if p["run"] == 0
        for s in p["records"]["train/loss"][0]
    ]
    assert steps == list(range(points))
    # A run's markers ride with its first records; the other run follows in the last.
    assert messages[0]["parts"][0]["markers"] == [
        {"kind": "epoch", "step": points - 1, "label": "epoch 0"}
    ]
    assert [p["run"] for p in messages[2]["parts"]] == [0, 1]

    # Markers count towards the history: a run of epochs without records is forgotten too.
    small = Hub(history=10)
    job = small.add_run("job")
    for epoch in range(30):
        job.epoch_ended(epoch, epoch)
        small.flush()
    assert small.next_id - small.first <= 11
