"""Following a run's stream from outside its process, across stages, for as long as the
dashboard runs: connect, feed what arrives into the hub, and when the stage ends (or the
run is not serving yet, or any more) try again."""

from __future__ import annotations

import anyio

from .._exceptions import StreamError
from ..events import PutRecord
from ..stream import EpochEnded, Gap, StageEnded, StageStarted, Stream, connect
from ._hub import RunFeed

__all__ = ["follow"]


async def follow(
    feed: RunFeed,
    address: str,
    *,
    token: str | None = None,
    retry: float = 0.2,
    connect_timeout: float = 10.0,
    patience: float = 10.0,
) -> None:
    """Feed ``address``'s records and events into ``feed`` until cancelled. A run on
    that address whose steps start again (a new job) gets a feed of its own
    (:meth:`RunFeed.successor`).

    Between attempts it waits ``retry`` seconds; a run that has not served for
    ``patience`` seconds after a stage ended is shown as ended (and still watched: a
    next stage or a new run on the same address is picked up)."""
    ever_connected = False
    last_seen = 0.0  # when the run last served us, by anyio's clock
    while True:
        stream = connect(
            address,
            topics=["records", "events"],
            token=token,
            yield_gaps=True,
            timeout=connect_timeout,
        )
        try:
            async with stream:
                ever_connected = True
                welcome = stream.welcome
                assert welcome is not None
                if welcome.step < feed.step:
                    feed = feed.successor()
                feed.started(welcome.stage, welcome.step, welcome.epoch)
                feed.attach(welcome.run_dir, welcome.time)
                await _feed(feed, stream)
            if feed.state == "connected":  # a bye without a StageEnded before it
                feed.set_state("between stages", "the stage ended")
            last_seen = anyio.current_time()
        except StreamError as exc:
            bye = stream.bye
            if bye is not None and bye.code in ("auth", "version"):
                # Trying again cannot help: say why and stop.
                feed.set_state("failed", str(exc))
                return
            if not ever_connected:
                feed.set_state("waiting", f"not serving yet ({exc})")
            elif feed.state == "connected":
                # Gone in the middle of a stage: killed, or it failed hard.
                feed.set_state("ended", str(exc))
                last_seen = anyio.current_time()
            elif feed.state == "between stages" and anyio.current_time() - last_seen > patience:
                feed.set_state("ended", f"{feed.detail}; not serving any more")
        await anyio.sleep(retry)


async def _feed(feed: RunFeed, stream: Stream) -> None:
    """Feed the records, events and gap notices of ``stream`` into ``feed`` until the
    stream ends."""
    record = feed.record
    async for item in stream:
        kind = type(item)
        if kind is PutRecord:
            r: PutRecord = item  # type: ignore[assignment]
            record(r.name, r.value, r.step, r.epoch, r.time)
        elif kind is EpochEnded:
            e: EpochEnded = item  # type: ignore[assignment]
            feed.epoch_ended(e.epoch, e.step)
        elif kind is StageStarted:
            # The next stage of a job served for the trainer's lifetime.
            t: StageStarted = item  # type: ignore[assignment]
            feed.started(t.stage, t.step, t.epoch)
        elif kind is StageEnded:
            s: StageEnded = item  # type: ignore[assignment]
            feed.stage_ended(s.stage, s.reason, s.step)
        elif kind is Gap:
            g: Gap = item  # type: ignore[assignment]
            feed.gap(g.count)
