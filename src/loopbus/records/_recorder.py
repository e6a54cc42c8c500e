"""The recorder: the trainer's pending put records (and published events), their
routing and delivery, and the latest record of each name.

Records flow one way, from ``put`` to the subscribers: ``put`` queues a typed entry
(``_entries``), and the recorder flushes the pending entries at step and hook
boundaries: it reads tensor values on the host (one read per dtype; on CUDA, a step's
values are copied to the host without blocking and delivered a few steps later, see
:meth:`Recorder.flush_step`), builds a :class:`PutRecord` of each and routes it to the
bus's subscribers whose role its destinations name. Records nobody listens to are kept
unread, as the latest of their name, until someone asks for them.

The bus holds the subscriptions and never calls the recorder: a trainer's bus is the
recorder's own :class:`RecordingBus`, whose inline delivery flushes what a handler put
before the next handler of the same event runs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator, Sized
from operator import attrgetter
from typing import TYPE_CHECKING, Any, cast

import msgspec
import torch

from loopbus.data import _device

from .._exceptions import HandlerError, StopLoop
from ..events import CustomEvent, Event, EventBus, PutRecord
from ..events._handlers import handler_error
from ..events._subscription import Entry
from ._checks import STRIDED, described
from ._entries import PendingEvent, PendingPut, Unread

if TYPE_CHECKING:
    from loopbus.state._runstate import RunState

__all__ = ["Publication", "Recorder", "RecordingBus"]

_Tensor = torch.Tensor

#: A pending entry and the record subscribers it goes to: None for a published event
#: (delivered through the bus's dispatch table), ``()`` for a record that follows an
#: earlier one of its name to nobody (so that it is the latest of its name, as put).
_Routed = tuple[PendingPut | PendingEvent, Any]


def _resolve(values: list[Any]) -> list[Any]:
    """``values`` with every tensor read as a Python number: one host read per dtype
    (the tensors of a dtype stacked into one) instead of one ``.item()`` per record."""
    if len(values) == 1:  # the common case: one record per step
        value = values[0]
        if type(value) is _Tensor or isinstance(value, _Tensor):
            return [value.item()]
        return values
    tensors: dict[Any, list[int]] = {}
    for index, value in enumerate(values):
        if type(value) is _Tensor or isinstance(value, _Tensor):
            tensors.setdefault((value.dtype, value.device, value.layout), []).append(index)
    if not tensors:
        return values
    out = list(values)
    for (_, _, layout), indices in tensors.items():
        if len(indices) == 1 or layout is not STRIDED:
            for i in indices:
                out[i] = values[i].item()
            continue
        numbers = torch.stack([_device.scalar(values[i]) for i in indices]).tolist()
        for i, number in zip(indices, numbers, strict=True):
            out[i] = number
    return out


class Publication:
    """What :meth:`Trainer.publish <loopbus.Trainer.publish>` returns: the event is
    already queued, in order with the records put before it. Awaiting this delivers it
    (and everything queued before it) now; left un-awaited (from synchronous code such as
    ``training_step``) it is delivered at the next step or hook boundary. Either way it
    is delivered: nothing is lost because an ``await`` was left out."""

    __slots__ = ("_recorder",)

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder

    def __await__(self) -> Generator[Any, None, None]:
        return self._recorder.flush().__await__()


class _Deferred:
    """One step flush whose device values are on their way to the host."""

    __slots__ = ("_indices", "_reading", "_values", "epoch", "routed", "step")

    def __init__(
        self,
        routed: list[_Routed],
        step: int,
        epoch: int,
        readback: _device.Readback | None,
    ) -> None:
        self.routed = routed
        self.step = step
        self.epoch = epoch
        self._values: list[Any] | None = None
        self._reading: _device.Reading | None = None
        # The records whose values are read back from the device.
        self._indices = (
            []
            if readback is None
            else [
                i
                for i, (item, _) in enumerate(routed)
                if type(item) is PendingPut
                and isinstance(item.value, _Tensor)
                and item.value.device.type == readback.device_type
            ]
        )
        if readback is not None and self._indices:
            self._reading = readback.start([_value(routed[i][0]) for i in self._indices])

    def ready(self) -> bool:
        reading = self._reading
        return reading is None or reading.ready()

    def values(self) -> list[Any]:
        """The records' values as Python numbers (None for the events)."""
        if self._values is not None:
            return self._values
        raw = _values(self.routed)
        reading = self._reading
        if reading is not None:
            for i, number in zip(self._indices, reading.values(), strict=True):
                raw[i] = number
        self._values = _resolve(raw)  # CPU tensors, one read per dtype
        return self._values


def _value(item: PendingPut | PendingEvent) -> Any:
    """The value of a pending record (None for an event)."""
    return item.value if type(item) is PendingPut else None


def _values(routed: list[_Routed]) -> list[Any]:
    """The values of the routed records as put (None for the events)."""
    return [item.value if type(item) is PendingPut else None for item, _ in routed]


class Recorder:
    """The trainer's pending put records (and published events), their routing and
    delivery, and the latest record of each name.

    What is pending is the recorder's own: ``put`` queues through :attr:`enqueue`,
    compiled code through :meth:`queue_put`, ``trainer.publish`` through
    :meth:`queue_event`; others read :attr:`has_pending` (and tests :meth:`peek`).

    The latest records of the running (or last) stage are :meth:`stage_records`;
    ``earlier`` holds those of earlier stages whose names this stage has not put (yet). A
    stage's start moves the stage's records into ``earlier``; :meth:`latest_records` is
    both, so a name keeps its last value across stages until a record of the same name
    replaces it. Whoever reads them gets :class:`PutRecord` s, values read on the host.
    """

    __slots__ = (
        "_delivering",
        "_latest",
        "_pending",
        "bus",
        "compiled",
        "earlier",
        "enqueue",
        "inflight",
        "lag",
        "readback",
        "state",
        "stepping",
        "traced",
    )

    def __init__(self, state: RunState, bus: EventBus | None = None, lag: int = 4) -> None:
        #: The run state whose step and epoch the records carry.
        self.state = state
        #: What the records and published events are delivered through: ``bus``, or
        #: without one a :class:`RecordingBus` of this recorder's (a trainer's bus).
        self.bus: EventBus = RecordingBus(self) if bus is None else bus
        # What was put or published since the last flush, in order: one list for the
        # recorder's life (a flush takes its items out), so that ``enqueue`` stays bound.
        self._pending: list[PendingPut | PendingEvent] = []
        #: Queue a pending entry (what the eager ``put`` calls): the pending list's own
        #: ``append``, so a put costs no Python frame of the recorder's.
        self.enqueue = self._pending.append
        # The latest of each name this stage: a PutRecord, or an Unread entry for a
        # record nobody has listened to (turned into a PutRecord when read).
        self._latest: dict[str, PutRecord | Unread] = {}
        self.earlier: dict[str, PutRecord] = {}
        #: How many step flushes whose device values are still being copied to the
        #: host may wait before the oldest is read anyway (waiting for its copy).
        self.lag = lag
        #: Step flushes waiting for their device values, oldest first (see flush_step).
        self.inflight: deque[_Deferred] = deque()
        self._delivering = 0
        #: How this stage's device reads put values without waiting (None: the CPU,
        #: where reading is immediate); see :meth:`use_device`.
        self.readback: _device.Readback | None = None
        #: Whether this stage's steps are compiled (``put`` then takes its traceable path).
        self.compiled = False
        #: Whether a compiled step runs (see :meth:`run_compiled`), and what its puts
        #: handed out: one list, empty whenever a step starts (compiled code guards on
        #: the length of a list it appends to; this one's never varies). A put is kept
        #: there as a plain ``(name, value, destinations, source)`` tuple, which compiled
        #: code builds without a graph break, and typed when the step returns.
        self.stepping = False
        self.traced: list[tuple[str, Any, tuple[str, ...], str] | PendingEvent] = []

    if TYPE_CHECKING:

        @property
        def has_pending(self) -> Sized:
            """Truthy while something is pending (not to be changed)."""
            ...

    else:
        #: Truthy while something is pending: what the step boundary and the recording
        #: bus read, every step; a getter without a Python frame.
        has_pending = property(attrgetter("_pending"))

    @property
    def pending_count(self) -> int:
        """How many entries are pending (``put_dict`` marks where its items start)."""
        return len(self._pending)

    def retract(self, count: int) -> None:
        """Drop the pending entries after the first ``count`` (the items a ``put_dict``
        put before one of its items was refused)."""
        del self._pending[count:]

    def peek(self) -> list[Any]:
        """What is pending, in order, for inspection: each put as its ``(name, value,
        destinations, source)`` tuple, each published event as itself. A new list:
        changing it changes nothing."""
        return [
            (item.name, item.value, item.destinations, item.source)
            if type(item) is PendingPut
            else item.event
            for item in self._pending
        ]

    def use_device(self, device: Any, compiled: bool = False) -> None:
        """Set the stage's device (on CUDA, :meth:`flush_step` reads put values back
        without making the host wait) and whether its steps are compiled (``put`` then
        takes the path compiled code traces without a graph break)."""
        self.readback = _device.readback_for(device)
        self.compiled = compiled

    def queue_put(self, name: str, value: Any, destinations: tuple[str, ...], source: str) -> None:
        """Queue a checked put (what the compiled ``put`` calls, also while compiled
        code traces it): while a compiled step runs, into its step buffer
        (:attr:`traced`, see :meth:`run_compiled`); otherwise with the pending records."""
        if self.stepping:
            self.traced.append((name, value, destinations, source))
        else:
            self._pending.append(PendingPut(name, value, destinations, source))

    def run_compiled(self, fn: Callable[[Any, Any], Any], batch: Any, ctx: Any) -> Any:
        """``fn(batch, ctx)``, a compiled step: the puts it makes go to :attr:`traced`
        and join the pending records, in the order they were made, when it returns
        (or raises). So compiled code never sees the pending list, whose length changes
        with what handlers put between steps."""
        self.stepping = True
        try:
            return fn(batch, ctx)
        finally:
            self.stepping = False
            traced = self.traced
            if traced:
                self._pending.extend(
                    item if type(item) is PendingEvent else PendingPut(*item) for item in traced
                )
                traced.clear()

    def reset(self) -> None:
        """Start a stage: nothing pending; the last records so far become earlier ones
        (they stay until a record of the same name replaces them)."""
        self._pending.clear()
        self.inflight.clear()
        if self._latest:
            earlier = self.earlier
            for name, record in self.stage_records().items():
                earlier.pop(name, None)  # keep the order in which names were last put
                earlier[name] = record
            self._latest.clear()

    def discard_pending(self) -> None:
        """Drop what was put or published but not flushed (a cancelled or failed stage)."""
        self._pending.clear()
        self.inflight.clear()

    async def flush_pending(self) -> None:
        """:meth:`flush` if anything waits (a rare boundary: an epoch's or a pass's end)."""
        if self._pending or self.inflight:
            await self.flush()

    def publish(self, event: Event) -> Publication:
        """``trainer.publish``: check ``event``, stamp a :class:`CustomEvent` left with
        ``step``/``epoch`` at -1 with the run's, and queue it (see :meth:`queue_event`).
        Raises :class:`RuntimeError` while no stage runs, where nothing would deliver it."""
        if not isinstance(event, Event):
            raise TypeError(
                f"trainer.publish() takes an event (an instance of a loopbus.Event "
                f"subclass), got {described(event)}."
            )
        state = self.state
        if state.stage is None:
            raise RuntimeError(
                f"trainer.publish({type(event).__name__}(...)) was called while no stage "
                "runs, so nothing would deliver it; publish from a step, a handler or a "
                "plugin while fit/validate/test/predict runs, or call "
                "`await trainer.bus.publish(event)`."
            )
        if isinstance(event, CustomEvent) and (event.step < 0 or event.epoch < 0):
            event = msgspec.structs.replace(
                event,
                step=state.step if event.step < 0 else event.step,
                epoch=state.epoch if event.epoch < 0 else event.epoch,
            )
        return self.queue_event(event)

    def queue_event(self, event: Event) -> Publication:
        """Queue ``event`` for delivery at the next flush, after what is pending (during
        a compiled step, after what the step has put so far: its puts join the pending
        records only when it returns, see :meth:`run_compiled`)."""
        (self.traced if self.stepping else self._pending).append(PendingEvent(event))
        return Publication(self)

    # The latest records are part of a checkpoint (a resumed run's monitors see them).
    def state_dict(self) -> dict[str, Any]:
        # Records still on their way from the device belong to the state saved now.
        self._settle_inflight()
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
        latest = self._latest
        for name, r in state.items():
            try:
                latest[name] = PutRecord(
                    name=name,
                    value=r["value"],
                    step=int(r["step"]),
                    epoch=int(r["epoch"]),
                    time=float(r["time"]),
                    source=str(r["source"]),
                    destinations=tuple(r["destinations"]),
                )
            except (KeyError, TypeError, ValueError):
                continue  # a malformed entry: that name has no latest record

    async def flush(self) -> None:
        """Convert and deliver the pending records and published events, in the order
        they were put or published, after the step flushes still waiting for their
        device values (reading those now, waiting for their copies if need be)."""
        inflight = self.inflight
        if inflight and not self._delivering:
            while inflight:
                await self._deliver_deferred(inflight.popleft())
        pending = self._pending
        if not pending:
            return
        items = pending[:]  # what handlers put while these are delivered waits its turn
        del pending[:]
        state = self.state
        routed = self._route(items, state.step, state.epoch)
        if routed:
            values = _resolve(
                [item.value if type(item) is PendingPut else None for item, _ in routed]
            )
            await self._deliver(routed, values, state.step, state.epoch)

    async def flush_step(self) -> None:
        """The flush at a step boundary. Where put values live on a device whose reads
        make the host wait (CUDA), their copies to the host start now and the records
        are delivered once the copies are done, checked without waiting at every step
        boundary, and at the latest when more than :attr:`lag` step flushes wait (then
        the oldest is read, waiting for its copy). Any other flush delivers everything
        first, so records always arrive in the order they were put, with the step and
        epoch of their step. On the CPU this is :meth:`flush`."""
        inflight = self.inflight
        pending = self._pending
        readback = self.readback
        if pending:
            items = pending[:]
            del pending[:]
            state = self.state
            step, epoch = state.step, state.epoch
            routed = self._route(items, step, epoch)
            if routed:
                inflight.append(_Deferred(routed, step, epoch, readback))
        while inflight and (len(inflight) > self.lag or inflight[0].ready()):
            await self._deliver_deferred(inflight.popleft())

    async def _deliver_deferred(self, batch: _Deferred) -> None:
        self._delivering += 1
        try:
            await self._deliver(batch.routed, batch.values(), batch.step, batch.epoch)
        finally:
            self._delivering -= 1

    def _settle_inflight(self) -> None:
        """Read the values of the waiting step flushes into the latest records (not
        delivered: their handlers still get them, in order, at the next flush)."""
        latest = self._latest
        for batch in self.inflight:
            for (item, _), value in zip(batch.routed, batch.values(), strict=True):
                if type(item) is PendingPut:
                    latest[item.name] = Unread(
                        item.name, value, batch.step, batch.epoch, item.source, item.destinations
                    )

    def _route(
        self, pending: list[PendingPut | PendingEvent], step: int, epoch: int
    ) -> list[_Routed]:
        """The subscribers each pending entry goes to; records nobody listens to are
        kept unread as the latest of their name (read when someone asks:
        :meth:`latest_records`)."""
        bus = self.bus
        routes = bus.routes
        latest = self._latest
        routed: list[_Routed] = []
        for item in pending:
            if type(item) is PendingEvent:
                routed.append((item, None))
                continue
            destinations = item.destinations
            try:  # a subscript, not routes.get: no call where the route is cached
                entries = routes[destinations]
            except KeyError:
                entries = bus.route(destinations)
            if entries:
                routed.append((item, entries))
            elif routed and any(
                type(earlier) is PendingPut and earlier.name == item.name for earlier, _ in routed
            ):
                # A record of this name goes out first (to other destinations): this
                # one follows it to nobody, so the latest is this one, as put.
                routed.append((item, ()))
            else:  # nobody listens: kept unread until someone asks (latest_records)
                name = item.name
                latest[name] = Unread(name, item.value, step, epoch, item.source, destinations)
        return routed

    async def _deliver(self, routed: list[_Routed], values: list[Any], step: int, epoch: int) -> None:
        now = 0.0
        bus = self.bus
        deliver = bus.deliver_record
        latest = self._latest
        for (item, entries), value in zip(routed, values, strict=True):
            if type(item) is PendingEvent:  # an event from trainer.publish
                await bus.publish(item.event)
                continue
            if not now:
                now = time.time()
            name = item.name
            record = PutRecord(
                name=name,
                value=value,
                step=step,
                epoch=epoch,
                time=now,
                source=item.source,
                destinations=item.destinations,
            )
            latest[name] = record
            await deliver(entries, record)

    def last_value(self, name: str) -> Any:
        """The value last put under ``name`` (None: never), including one put in the
        running step and not delivered yet (a tensor is read on the host: on an
        accelerator, a sync). For a step-interval scheduler that monitors a record the
        step puts."""
        for item in reversed(self._pending):
            if type(item) is PendingPut and item.name == name:
                value = item.value
                return value.item() if isinstance(value, _Tensor) else value
        self._settle_inflight()  # values on their way from the device, read now
        record = self.latest_records().get(name)
        return None if record is None else record.value

    @property
    def latest(self) -> dict[str, PutRecord]:
        """The last record of each name put during the running (or last) stage: see
        :meth:`stage_records`."""
        return self.stage_records()

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

    def stage_records(self) -> dict[str, PutRecord]:
        """The last record of each name put during the running (or last) stage (values
        still unread are read on the host now: one read per dtype)."""
        latest = self._latest
        unread = [item for item in latest.values() if type(item) is Unread]
        if unread:
            now = time.time()
            values = _resolve([item.value for item in unread])
            for item, value in zip(unread, values, strict=True):
                latest[item.name] = PutRecord(
                    name=item.name,
                    value=value,
                    step=item.step,
                    epoch=item.epoch,
                    time=now,
                    source=item.source,
                    destinations=item.destinations,
                )
        return cast("dict[str, PutRecord]", dict(latest))


class RecordingBus(EventBus):
    """The bus of a :class:`Recorder` made without one (a trainer's: ``trainer.bus``):
    an :class:`EventBus` whose inline delivery keeps the records in put order.

    What a handler put or published is flushed by the recorder before the next handler
    of the same event runs, so later handlers see it (``trainer.latest``) and record
    subscribers get it first; only when something is pending, and never after the last
    handler (the loops flush at their boundaries, in batches). Records are delivered as
    on any bus: what a record handler puts waits for the next flush."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self._recorder = recorder

    async def deliver(self, entries: tuple[Entry, ...], event: Any) -> None:
        """Deliver ``event`` to precomputed ``entries`` (from :attr:`table`), flushing
        what each handler left pending before the next one runs."""
        recorder = self._recorder
        settle = False
        for fn, is_async, sub in entries:
            if settle and recorder.has_pending:
                await recorder.flush()
            try:
                if is_async:
                    await fn(event)
                else:
                    fn(event)
            except (HandlerError, StopLoop):
                raise
            except Exception as exc:
                raise handler_error(sub.owner, event, exc) from exc
            settle = True
