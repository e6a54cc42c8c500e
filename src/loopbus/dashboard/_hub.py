"""The dashboard's hub: what the runs sent, batched into messages for the browsers.

Each watched run has a :class:`RunFeed`. Whoever reads the run (a stream client for
``loopbus dashboard``, a bus subscriber in an application that trains in-process) calls
its methods per record; the hub gathers what arrives into columns per record name and,
every ``interval`` seconds, turns it into JSON messages (at most :data:`MESSAGE_POINTS`
records each) appended to a log. Every open page (a browser reading the Server-Sent
Events response) has a :class:`Page`: its place in that log. It reads the log at its own
pace, in chunks of at most ``chunk_bytes``, the next one only once its connection took the
previous one, so a slow page only falls behind, a page that does not read holds one
chunk (not a copy of the history), and a new page gets the history first.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import msgspec

from .._validate import check_int, check_number
from ._runs import Run

__all__ = ["CHUNK_BYTES", "MESSAGE_POINTS", "Hub", "Page", "RunFeed"]

_OWNER = "Dashboard"
#: Bytes of messages handed to a page's connection at once: a chunk holds whole
#: messages up to this size, or one message when that message is larger.
CHUNK_BYTES = 64 * 1024
#: Records in one message at most: a flush with more becomes several messages (so that
#: a chunk is bounded too; record names are at most 256 characters).
MESSAGE_POINTS = 2048
#: Bytes a message's Server-Sent Events framing adds, besides the digits of its id.
_FRAMING = len(b"id: \nevent: data\ndata: \n\n")

#: States of a run as the page shows them.
RUN_STATES = ("waiting", "connected", "between stages", "ended", "failed")


class RunFeed:
    """One run as the hub sees it. Its methods are what a reader calls; the attributes
    (read-only for everyone else) are what the page shows about the run."""

    def __init__(self, hub: Hub, index: int, label: str, address: str) -> None:
        self._hub = hub
        self.index = index
        self.label = label
        self.address = address
        self.state = "waiting"
        self.detail = ""
        self.stage: str | None = None
        self.step = 0
        self.epoch = 0
        self.records = 0
        self.gaps = 0
        # Pending, not yet flushed: name -> ([steps], [values]); markers in order.
        self._columns: dict[str, tuple[list[int], list[Any]]] = {}
        self._markers: list[dict[str, Any]] = []
        #: The run's points, boundaries and facts, as the JSON API serves them.
        self.run = Run(hub._unique_id(label), label, address, kind="stream")
        self.run.state = "live"
        self.run.loaded = True
        self.run.live = self.info

    def __repr__(self) -> str:
        return f"<RunFeed {self.index} {self.label!r} {self.state} step={self.step}>"

    def info(self) -> dict[str, Any]:
        return {
            "run": self.index,
            "label": self.label,
            "address": self.address,
            "state": self.state,
            "detail": self.detail,
            "stage": self.stage,
            "step": self.step,
            "epoch": self.epoch,
            "records": self.records,
            "gaps": self.gaps,
        }

    # ------------------------------------------------------------ what readers call
    def record(
        self,
        name: str,
        value: float | int | bool,
        step: int,
        epoch: int,
        time: float | None = None,
    ) -> None:
        """A record of the run (one ``put``), put at wall ``time`` (default: now)."""
        self.run.point(name, step, _now() if time is None else time, value)
        columns = self._columns.get(name)
        if columns is None:
            columns = self._columns[name] = ([], [])
        columns[0].append(step)
        columns[1].append(value)
        self.step = step
        self.epoch = epoch
        self.records += 1

    def epoch_ended(self, epoch: int, step: int) -> None:
        """An epoch of ``fit`` ended at ``step``: a boundary on every chart."""
        self.run.epochs[epoch] = (step, _now())
        self.run.version += 1
        self._markers.append({"kind": "epoch", "step": step, "label": f"epoch {epoch}"})
        self._hub._changed_status()

    def stage_ended(self, stage: str, reason: str, step: int) -> None:
        """A stage ended: a boundary on every chart, and the run waits for the next."""
        self.run.mark("stage", step, _now(), f"{stage} {reason}")
        self._markers.append({"kind": "stage", "step": step, "label": f"{stage} {reason}"})
        self.set_state("between stages", f"{stage} {reason}")

    def gap(self, count: int) -> None:
        """``count`` items of the run were dropped before they reached the dashboard."""
        self.gaps += count
        self.run.mark("gap", self.step, _now(), f"{count} dropped")
        self._markers.append({"kind": "gap", "step": self.step, "label": f"{count} dropped"})
        self._hub._changed_status()

    def started(self, stage: str | None, step: int, epoch: int) -> None:
        """The run is connected (again), in ``stage``, at ``step``."""
        self.stage = stage
        self.step = max(self.step, step)
        self.epoch = epoch
        self.set_state("connected", stage or "")

    def attach(self, run_dir: str | None, since: float) -> None:
        """The run's stream names its run folder and delivers what was put from wall
        time ``since`` on: the history before it is read in the folder's log."""
        if run_dir:
            self.run.streaming_since(Path(run_dir), since)

    def successor(self) -> RunFeed:
        """A new run on the same address (its steps started again: a new job, or one
        resumed from a checkpoint): a series of its own, ``"label (2)"``."""
        base = self.label.rsplit(" (", 1)[0] if self.label.endswith(")") else self.label
        n = sum(run.address == self.address for run in self._hub.runs) + 1
        self.set_state("ended", self.detail)
        return self._hub.add_run(f"{base} ({n})", self.address)

    def set_state(self, state: str, detail: str = "") -> None:
        """Change what the page says about the run (one of :data:`RUN_STATES`)."""
        if state not in RUN_STATES:
            raise ValueError(f"a run's state is one of {RUN_STATES}, got {state!r}.")
        if (state, detail) != (self.state, self.detail):
            self.state = state
            self.detail = detail
            self.run.state = "finished" if state in ("ended", "failed") else "live"
            if self.run.state == "finished":
                self.run.release()
            self.run.version += 1
            self._hub._changed_status()

    # ------------------------------------------------------------ what the hub calls
    def _take(self) -> dict[str, Any] | None:
        if not self._columns and not self._markers:
            return None
        columns = {
            name: [steps, [_number(v) for v in values]]
            for name, (steps, values) in self._columns.items()
        }
        part = {"run": self.index, "records": columns, "markers": self._markers}
        self._columns = {}
        self._markers = []
        return part


def _split(parts: list[dict[str, Any]], limit: int) -> list[list[dict[str, Any]]]:
    """``parts`` (what the runs sent since the last flush) as the parts of messages of at
    most ``limit`` records each; a run's markers ride with its first records."""
    messages: list[list[dict[str, Any]]] = []
    current: list[dict[str, Any]] = []
    room = limit
    for part in parts:
        records: dict[str, list[list[Any]]] = {}
        current.append({"run": part["run"], "records": records, "markers": part["markers"]})
        for name, (steps, values) in part["records"].items():
            at = 0
            while at < len(steps):
                if room == 0:  # this message is full: the rest of the run goes on
                    messages.append(current)
                    records = {}
                    current = [{"run": part["run"], "records": records, "markers": []}]
                    room = limit
                n = min(room, len(steps) - at)
                records[name] = [steps[at : at + n], values[at : at + n]]
                at += n
                room -= n
    messages.append(current)
    return messages


def _now() -> float:
    return time.time()


def _number(value: Any) -> Any:
    """A value as JSON can carry it: booleans as 0/1, NaN and infinities as null (a
    break in the line)."""
    kind = type(value)
    if kind is float:
        return value if math.isfinite(value) else None
    if kind is bool:
        return int(value)
    return value


class Hub:
    """The runs a dashboard shows, the log of messages its pages read and the open pages.

    ``interval``: seconds between flushes while records arrive (the page redraws at
    most that often). ``history``: records kept for pages that open later (a marker
    counts as one); beyond it the oldest messages are forgotten. ``chunk_bytes``: bytes of
    messages handed to a page's connection at once (see :class:`Page`).
    """

    def __init__(
        self,
        *,
        interval: float = 0.1,
        history: int = 2_000_000,
        chunk_bytes: int = CHUNK_BYTES,
    ) -> None:
        self.interval = check_number(
            "interval", interval, exclusive_minimum=0, owner=_OWNER, what="a number of seconds"
        )
        self.history = check_int("history", history, minimum=1, owner=_OWNER)
        self.chunk_bytes = check_int(
            "chunk_bytes", chunk_bytes, minimum=1024, owner=_OWNER, hint="it counts bytes"
        )
        self.runs: list[RunFeed] = []
        self.started = time.time()
        #: Id of the first message still in the log; ids count from 0.
        self.first = 0
        self._log: list[bytes] = []
        self._sizes: list[int] = []
        self._kept = 0
        #: Bytes of the messages in the log.
        self.kept_bytes = 0
        self.status_version = 0
        self._changed = anyio.Event()
        self._encode = msgspec.json.Encoder().encode
        self._pages: set[Page] = set()

    def _unique_id(self, label: str) -> str:
        taken = {run.run.id for run in self.runs}
        run_id, n = label, 2
        while run_id in taken:
            run_id = f"{label} ({n})"
            n += 1
        return run_id

    def add_run(self, label: str, address: str = "") -> RunFeed:
        """A new run to show, as one series on every chart."""
        feed = RunFeed(self, len(self.runs), label, address)
        self.runs.append(feed)
        self._changed_status()
        return feed

    @property
    def next_id(self) -> int:
        """The id the next message will get."""
        return self.first + len(self._log)

    def status(self) -> bytes:
        """Every run's state, the bytes of history kept, and the open pages with the
        bytes queued for them, as JSON."""
        return self._encode(
            {
                "runs": [run.info() for run in self.runs],
                "time": time.time(),
                "started": self.started,
                "history_bytes": self.kept_bytes,
                "pages": len(self._pages),
                "queued": self.queued,
            }
        )

    def read(self, start: int) -> tuple[int, list[bytes]]:
        """The messages from id ``start`` on (from the first kept one if it was forgotten):
        ``(id of the first returned, messages)``."""
        start = max(start, self.first)
        return start, self._log[start - self.first :]

    def messages(self, start: int) -> tuple[int, Iterator[bytes]]:
        """As :meth:`read`, without copying the list: the messages come from an iterator,
        to be read before the next :meth:`flush`."""
        start = max(start, self.first)
        return start, itertools.islice(self._log, start - self.first, None)

    def flush(self) -> int:
        """Turn what the runs sent since the last flush into messages (one, or one per
        :data:`MESSAGE_POINTS` records); returns the number of records they carry."""
        parts = [part for run in self.runs if (part := run._take()) is not None]
        if not parts:
            return 0
        records = 0
        for message in _split(parts, MESSAGE_POINTS):
            count = sum(len(c[0]) for part in message for c in part["records"].values())
            records += count
            count += sum(len(part["markers"]) for part in message)  # history counts both
            encoded = self._encode({"id": self.next_id, "parts": message})
            self._log.append(encoded)
            self._sizes.append(count)
            self._kept += count
            self.kept_bytes += len(encoded)
        while self._kept > self.history and len(self._log) > 1:
            self._kept -= self._sizes.pop(0)
            self.kept_bytes -= len(self._log.pop(0))
            self.first += 1
        self._changed_status()  # the runs' steps and counts moved on
        return records

    # ------------------------------------------------------------ the open pages
    @property
    def pages(self) -> tuple[Page, ...]:
        """The pages open now (each a browser reading the event stream)."""
        return tuple(self._pages)

    @property
    def queued(self) -> int:
        """Bytes handed to the open pages' connections and not yet taken by them."""
        return sum(page.queued for page in self._pages)

    def open_page(self, start: int = 0) -> Page:
        """A page that opened and wants the messages from id ``start`` on; close it with
        :meth:`close_page` when it goes."""
        page = Page(self, start)
        self._pages.add(page)
        return page

    def close_page(self, page: Page) -> None:
        """``page`` went: the hub keeps nothing of it."""
        self._pages.discard(page)
        if not self._pages:
            self._pages = set()  # nor the room that many pages took in the set

    async def wait(self) -> None:
        """Until the next message or change of state."""
        await self._changed.wait()

    async def run(self) -> None:
        """Flush every ``interval`` seconds, until cancelled."""
        while True:
            await anyio.sleep(self.interval)
            self.flush()

    def _changed_status(self) -> None:
        self.status_version += 1
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()


class Page:
    """One open page (a browser reading the event stream) as the hub sees it: its place
    in the log and the bytes handed to its connection that the connection has not taken
    yet. Made by :meth:`Hub.open_page`; the event stream closes it when the page goes.

    The stream asks :meth:`next_chunk` for what to send, hands it to the connection and
    calls :meth:`written` once the connection took it, and only then asks for the next
    chunk: a page reads the history and the live messages at its own pace, a chunk
    (``Hub.chunk_bytes``) at a time, and a page that does not read holds one chunk. The
    attributes are read-only for everyone else.
    """

    def __init__(self, hub: Hub, position: int) -> None:
        self._hub = hub
        #: Id of the next message the page gets.
        self.position = position
        #: Bytes handed to the connection, not yet taken (0 between chunks).
        self.queued = 0
        #: Bytes the connection took, and in how many chunks.
        self.sent = 0
        self.chunks = 0
        self._status = -1  # the hub's status_version the page was sent

    def __repr__(self) -> str:
        return f"<Page at {self.position} queued={self.queued} sent={self.sent}>"

    def next_chunk(self) -> bytes | None:
        """The next chunk of the event stream (Server-Sent Events: the runs' status if it
        changed, how many messages the page missed if the history forgot them, then
        messages up to ``Hub.chunk_bytes``), or None when the page has everything."""
        hub = self._hub
        events: list[bytes] = []
        if hub.status_version != self._status:
            self._status = hub.status_version
            events.append(b"event: status\ndata: %s\n\n" % hub.status())
        first, messages = hub.messages(self.position)
        if first > self.position:
            events.append(b"event: forgotten\ndata: %d\n\n" % (first - self.position))
        size = sum(map(len, events))
        position = first
        for message in messages:  # whole messages up to the budget, at least one
            framed = len(message) + _FRAMING + len(str(position))
            if position > first and size + framed > hub.chunk_bytes:
                break
            events.append(b"id: %d\nevent: data\ndata: %s\n\n" % (position, message))
            size += framed
            position += 1
        self.position = position
        if not events:
            return None
        chunk = b"".join(events)
        self.queued = len(chunk)
        self.chunks += 1
        return chunk

    def written(self) -> None:
        """The connection took the last chunk."""
        self.sent += self.queued
        self.queued = 0
