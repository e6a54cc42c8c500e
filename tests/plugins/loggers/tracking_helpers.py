"""What the tracker loggers' tests share: a plugin that keeps what the loggers were sent."""

from __future__ import annotations

import loopbus
from loopbus import Plugin, PutRecord, on
from loopbus.plugins import CheckpointSaved


class Captured(Plugin):
    """The records the loggers were sent, in order, and the checkpoints announced."""

    delivery = loopbus.Delivery(destination="loggers")

    def __init__(self) -> None:
        self.records: list[PutRecord] = []
        self.saved: list[CheckpointSaved] = []

    @on(PutRecord)
    def keep(self, record: PutRecord) -> None:
        self.records.append(record)

    @on(CheckpointSaved)
    def keep_saved(self, event: CheckpointSaved) -> None:
        self.saved.append(event)
