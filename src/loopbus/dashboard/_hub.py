"""The dashboard's hub: what the runs sent, batched into messages for the browsers.

Each watched run has a :class:`RunFeed`. Whoever reads the run (a stream client for
``loopbus dashboard``, a bus subscriber in an application that trains in-process) calls
its methods per record; the hub gathers what arrives into columns per record name and,
every ``interval`` seconds, turns it into one JSON message appended to a log. Every
browser (a Server-Sent Events response) reads that log from its own position at its own
pace, so a slow browser only falls behind and a new one gets the history first.
"""

from __future__ import annotations

import math
import time
from typing import Any

import anyio
import msgspec

from .._validate import check_int, check_number

__all__ = ["Hub", "RunFeed"]

_OWNER = "Dashboard"

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
    def record(self, name: str, value: float | int | bool, step: int, epoch: int) -> None:
        """A record of the run (one ``put``)."""
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
        self._markers.append({"kind": "epoch", "step": step, "label": f"epoch {epoch}"})
        self._hub._changed_status()

    def stage_ended(self, stage: str, reason: str, step: int) -> None:
        """A stage ended: a boundary on every chart, and the run waits for the next."""
        self._markers.append({"kind": "stage", "step": step, "label": f"{stage} {reason}"})
        self.set_state("between stages", f"{stage} {reason}")

    def gap(self, count: int) -> None:
        """``count`` items of the run were dropped before they reached the dashboard."""
        self.gaps += count
        self._markers.append({"kind": "gap", "step": self.step, "label": f"{count} dropped"})
        self._hub._changed_status()

    def started(self, stage: str | None, step: int, epoch: int) -> None:
        """The run is connected (again), in ``stage``, at ``step``."""
        self.stage = stage
        self.step = max(self.step, step)
        self.epoch = epoch
        self.set_state("connected", stage or "")

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
    """The runs a dashboard shows and the log of messages its browsers read.

    ``interval``: seconds between messages while records arrive (the page redraws at
    most that often). ``history``: records kept for browsers that connect later; beyond
    it the oldest messages are forgotten.
    """

    def __init__(self, *, interval: float = 0.1, history: int = 2_000_000) -> None:
        self.interval = check_number(
            "interval", interval, exclusive_minimum=0, owner=_OWNER, what="a number of seconds"
        )
        self.history = check_int("history", history, minimum=1, owner=_OWNER)
        self.runs: list[RunFeed] = []
        self.started = time.time()
        #: Id of the first message still in the log; ids count from 0.
        self.first = 0
        self._log: list[bytes] = []
        self._sizes: list[int] = []
        self._kept = 0
        self.status_version = 0
        self._changed = anyio.Event()
        self._encode = msgspec.json.Encoder().encode

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
        """Every run's state, as JSON."""
        return self._encode(
            {
                "runs": [run.info() for run in self.runs],
                "time": time.time(),
                "started": self.started,
            }
        )

    def read(self, start: int) -> tuple[int, list[bytes]]:
        """The messages from id ``start`` on (from the first kept one if it was forgotten):
        ``(id of the first returned, messages)``."""
        start = max(start, self.first)
        return start, self._log[start - self.first :]

    def flush(self) -> int:
        """Turn what the runs sent since the last flush into one message; returns the
        number of records it carries."""
        parts = [part for run in self.runs if (part := run._take()) is not None]
        if not parts:
            return 0
        count = sum(len(c[0]) for part in parts for c in part["records"].values())
        self._log.append(self._encode({"id": self.next_id, "parts": parts}))
        self._sizes.append(count)
        self._kept += count
        while self._kept > self.history and len(self._log) > 1:
            self._kept -= self._sizes.pop(0)
            self._log.pop(0)
            self.first += 1
        self._changed_status()  # the runs' steps and counts moved on
        return count

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
