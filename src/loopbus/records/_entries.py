"""What waits in the recorder: one typed entry per kind of thing, from a ``put`` or a
``trainer.publish`` to the flush that delivers it, and a record nobody has read yet; and
:func:`record_of`, the one place a :class:`~loopbus.events.PutRecord` is made of them.

The entries are ``msgspec`` structs: building one is a single type call with no Python
frame (``put`` is on every step's path); the put and unread entries are not tracked by
the garbage collector (they hold numbers, detached tensors and strings, never a cycle).
They are final, so that ``type(entry) is PendingPut`` (no call) tells them apart.
"""

from __future__ import annotations

from typing import Any, final

import msgspec

from ..events import Event, PutRecord

__all__ = ["PendingEvent", "PendingPut", "Unread", "record_of"]


@final
class PendingPut(msgspec.Struct, gc=False):
    """A record ``put`` queued: its name, its value as put (a number, or a detached
    one-element tensor read on the host at the flush), its destinations (checked and
    sorted) and its source (who put it)."""

    name: str
    value: Any
    destinations: tuple[str, ...]
    source: str


@final
class PendingEvent(msgspec.Struct):
    """An event ``trainer.publish`` queued, delivered in order with the records put
    around it."""

    event: Event


@final
class Unread(msgspec.Struct, gc=False):
    """A record nobody has listened to, kept as the latest of its name with its value
    not yet read on the host: the put, and the step and epoch of its flush. It becomes a
    :class:`~loopbus.events.PutRecord` when someone asks for it (see
    ``Latest.stage_records``), stamped with that time."""

    put: PendingPut
    step: int
    epoch: int


def record_of(put: PendingPut, value: Any, step: int, epoch: int, time: float) -> PutRecord:
    """The :class:`~loopbus.events.PutRecord` of ``put`` with ``value`` (its value read
    on the host), flushed at ``step`` and ``epoch``, stamped with ``time``."""
    return PutRecord(
        name=put.name,
        value=value,
        step=step,
        epoch=epoch,
        time=time,
        source=put.source,
        destinations=put.destinations,
    )
