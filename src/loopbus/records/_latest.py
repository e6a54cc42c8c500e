"""The latest record of each name: of the running (or last) stage, and of earlier
stages, as :class:`~loopbus.events.PutRecord` s whose values are read on the host (a
record nobody listened to is kept unread until someone asks for it); and their part of
a checkpoint."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, cast

from ..events import PutRecord
from ._entries import PendingPut, Unread, record_of
from ._readback import Flushed, resolve

__all__ = ["Latest"]


class Latest:
    """The latest records. :attr:`stage` holds those of the running (or last) stage, as
    the flush leaves them: a :class:`PutRecord`, or an :class:`Unread` entry for a record
    nobody has listened to (read when asked for: :meth:`stage_records`). :attr:`earlier`
    holds those of earlier stages whose names this stage has not put (yet): a stage's
    start moves the stage's records there (:meth:`new_stage`), and
    :meth:`latest_records` is both, so a name keeps its last value across stages until
    a record of the same name replaces it."""

    __slots__ = ("earlier", "stage")

    def __init__(self) -> None:
        #: The latest of each name this stage (written by the flush).
        self.stage: dict[str, PutRecord | Unread] = {}
        self.earlier: dict[str, PutRecord] = {}

    def new_stage(self) -> None:
        """A stage starts: the last records so far become earlier ones."""
        if self.stage:
            earlier = self.earlier
            for name, record in self.stage_records().items():
                earlier.pop(name, None)  # keep the order in which names were last put
                earlier[name] = record
            self.stage.clear()

    def keep(self, flushes: Iterable[Flushed]) -> None:
        """Keep the records of ``flushes`` (not delivered yet) as the latest of their
        names, their values read now."""
        stage = self.stage
        for flushed in flushes:
            for (item, _), value in zip(flushed.routed, flushed.values(), strict=True):
                if type(item) is PendingPut:
                    put = PendingPut(item.name, value, item.destinations, item.source)
                    stage[item.name] = Unread(put, flushed.step, flushed.epoch)

    def stage_records(self) -> dict[str, PutRecord]:
        """The last record of each name put during the running (or last) stage (values
        still unread are read on the host now: one read per dtype)."""
        stage = self.stage
        unread = [item for item in stage.values() if type(item) is Unread]
        if unread:
            now = time.time()
            values = resolve([item.put.value for item in unread])
            for item, value in zip(unread, values, strict=True):
                stage[item.put.name] = record_of(item.put, value, item.step, item.epoch, now)
        return cast("dict[str, PutRecord]", dict(stage))

    def latest_records(self) -> dict[str, PutRecord]:
        """The last record of each name, of this stage or an earlier one (values read on
        the host now if still unread)."""
        stage = self.stage_records()
        earlier = self.earlier
        if not earlier:
            return stage
        out = {name: record for name, record in earlier.items() if name not in stage}
        out.update(stage)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            name: {
                "value": record.value,
                "step": record.step,
                "epoch": record.epoch,
                "time": record.time,
                "source": record.source,
                "destinations": list(record.destinations),
            }
            for name, record in self.latest_records().items()
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        stage = self.stage
        for name, r in state.items():
            try:
                put = PendingPut(name, r["value"], tuple(r["destinations"]), str(r["source"]))
                stage[name] = record_of(
                    put, r["value"], int(r["step"]), int(r["epoch"]), float(r["time"])
                )
            except (KeyError, TypeError, ValueError):
                continue  # a malformed entry: that name has no latest record
