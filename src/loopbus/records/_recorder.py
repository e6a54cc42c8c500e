"""The recorder: the trainer's pending put records (and published events), their flush
to the subscribers, and the latest record of each name.

Records flow one way, from ``put`` to the subscribers, through parts of one concern
each: ``put`` queues a typed entry (``_entries``) with the pending entries
(``_pending``, which also holds a compiled step's puts while it runs); a flush, at step
and hook boundaries, routes them (``_routes``: the subscribers each record's
destinations name, resolved once per destinations, and the records nobody listens to
kept unread), reads their values on the host (``_readback``: one read per dtype; on
CUDA a step's values are copied to the host without blocking and delivered a few steps
later, see :meth:`Recorder.flush_step`), and hands each :class:`PutRecord` to its
subscribers through the bus's one delivery loop, keeping it as the latest of its name
(``_latest``).

The bus holds the subscriptions and never calls the recorder: a trainer's bus is the
recorder's own :class:`RecordingBus`, whose inline delivery flushes what a handler put
before the next handler of the same event runs.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Generator, Sized
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from loopbus.data import _device

from ..events import CustomEvent, Event, EventBus, PutRecord
from ._checks import described
from ._entries import PendingEvent, PendingPut, record_of
from ._latest import Latest
from ._pending import Pending
from ._readback import Flushed, Routed, resolve
from ._routes import Routes

if TYPE_CHECKING:
    from loopbus.state._runstate import RunState

__all__ = ["Publication", "Recorder", "RecordingBus"]

_Tensor = torch.Tensor


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


class Recorder:
    """The trainer's pending put records (and published events), their flush to the
    subscribers, and the latest record of each name.

    What is pending is the recorder's own: ``put`` queues through :attr:`enqueue`,
    compiled code through :attr:`queue_put`, ``trainer.publish`` through
    :meth:`queue_event`; others read :attr:`has_pending` (and tests :meth:`peek`).

    The latest records of the running (or last) stage are :meth:`stage_records`;
    ``earlier`` holds those of earlier stages whose names this stage has not put (yet). A
    stage's start moves the stage's records into ``earlier``; :meth:`latest_records` is
    both, so a name keeps its last value across stages until a record of the same name
    replaces it. Whoever reads them gets :class:`PutRecord` s, values read on the host.
    """

    __slots__ = (
        "_delivering",
        "bus",
        "compiled",
        "enqueue",
        "inflight",
        "lag",
        "latest_of",
        "pending",
        "queue_put",
        "readback",
        "route",
        "routes",
        "run_compiled",
        "state",
    )

    def __init__(self, state: RunState, bus: EventBus | None = None, lag: int = 4) -> None:
        #: The run state whose step and epoch the records carry.
        self.state = state
        #: What was put or published since the last flush, and a compiled step's puts.
        self.pending = Pending()
        #: What the records and published events are delivered through: ``bus``, or
        #: without one a :class:`RecordingBus` of this recorder's (a trainer's bus).
        self.bus: EventBus = RecordingBus(self) if bus is None else bus
        #: Queue a pending entry (what the eager ``put`` calls): the pending list's own
        #: ``append``, so a put costs no Python frame of the recorder's.
        self.enqueue = self.pending.enqueue
        #: Queue a checked put (what the compiled ``put`` calls): see Pending.queue_put.
        self.queue_put = self.pending.queue_put
        #: Run a compiled step, its puts kept apart meanwhile: see Pending.run_compiled.
        self.run_compiled = self.pending.run_compiled
        #: The latest record of each name (this stage's, and earlier stages').
        self.latest_of = Latest()
        #: Where pending records go (see Routes).
        self.routes = Routes(self.bus.table, self.pending.entries, self.latest_of.stage, state)
        #: Take what is pending and route it (what a step boundary calls; see
        #: Routes.route): the entries to hand to :meth:`deliver`, the records nobody
        #: listens to kept as the latest of their name.
        self.route = self.routes.route
        #: How many step flushes whose device values are still being copied to the
        #: host may wait before the oldest is read anyway (waiting for its copy).
        self.lag = lag
        #: Step flushes waiting for their device values, oldest first (see flush_step).
        self.inflight: deque[Flushed] = deque()
        self._delivering = 0
        #: How this stage's device reads put values without waiting (None: the CPU,
        #: where reading is immediate); see :meth:`use_device`.
        self.readback: _device.Readback | None = None
        #: Whether this stage's steps are compiled (``put`` then takes its traceable path).
        self.compiled = False

    if TYPE_CHECKING:

        @property
        def has_pending(self) -> Sized:
            """Truthy while something is pending: the pending list itself, the same
            object for the recorder's life (not to be changed)."""
            ...

    else:
        #: Truthy while something is pending: what the step boundary and the recording
        #: bus read, every step; a getter without a Python frame.
        has_pending = property(attrgetter("pending.entries"))

    @property
    def earlier(self) -> dict[str, PutRecord]:
        """The latest records of earlier stages whose names this stage has not put."""
        return self.latest_of.earlier

    @property
    def stepping(self) -> bool:
        """Whether a compiled step runs (see :meth:`Pending.run_compiled`)."""
        return self.pending.stepping

    @property
    def traced(self) -> list[Any]:
        """What the puts of the compiled step running now handed out."""
        return self.pending.traced

    @property
    def pending_count(self) -> int:
        """How many entries are pending (``put_dict`` marks where its items start)."""
        return len(self.pending.entries)

    def retract(self, count: int) -> None:
        """Drop the pending entries after the first ``count`` (the items a ``put_dict``
        put before one of its items was refused)."""
        self.pending.retract(count)

    def peek(self) -> list[Any]:
        """What is pending, in order, for inspection: each put as its ``(name, value,
        destinations, source)`` tuple, each published event as itself. A new list:
        changing it changes nothing."""
        return self.pending.peek()

    def use_device(self, device: Any, compiled: bool = False) -> None:
        """Set the stage's device (on CUDA, :meth:`flush_step` reads put values back
        without making the host wait) and whether its steps are compiled (``put`` then
        takes the path compiled code traces without a graph break)."""
        self.readback = _device.readback_for(device)
        self.compiled = compiled

    def reset(self) -> None:
        """Start a stage: nothing pending; the last records so far become earlier ones
        (they stay until a record of the same name replaces them)."""
        self.discard_pending()
        self.latest_of.new_stage()

    def discard_pending(self) -> None:
        """Drop what was put or published but not flushed (a cancelled or failed stage)."""
        self.pending.entries.clear()
        self.inflight.clear()

    async def flush_pending(self) -> None:
        """:meth:`flush` if anything waits (a rare boundary: an epoch's or a pass's end)."""
        if self.pending.entries or self.inflight:
            await self.flush()

    @torch.compiler.disable  # (in a compiled step: run as is, where the step breaks)
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
        self.pending.queue_event(event)
        return Publication(self)

    # The latest records are part of a checkpoint (a resumed run's monitors see them).
    def state_dict(self) -> dict[str, Any]:
        # Records still on their way from the device belong to the state saved now.
        self.latest_of.keep(self.inflight)
        return self.latest_of.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.latest_of.load_state_dict(state)

    async def flush(self) -> None:
        """Convert and deliver the pending records and published events, in the order
        they were put or published, after the step flushes still waiting for their
        device values (reading those now, waiting for their copies if need be)."""
        inflight = self.inflight
        if inflight and not self._delivering:
            while inflight:
                await self.deliver(inflight.popleft())
        if self.pending.entries:
            routed = self.route()
            if routed:
                await self.deliver(routed)

    async def flush_step(self) -> None:
        """The flush at a step boundary. Where put values live on a device whose reads
        make the host wait (CUDA), their copies to the host start now and the records
        are delivered once the copies are done, checked without waiting at every step
        boundary, and at the latest when more than :attr:`lag` step flushes wait (then
        the oldest is read, waiting for its copy). Any other flush delivers everything
        first, so records always arrive in the order they were put, with the step and
        epoch of their step. On the CPU this is :meth:`flush`."""
        inflight = self.inflight
        if self.pending.entries:
            routed = self.route()
            if routed:
                state = self.state
                inflight.append(Flushed(routed, state.step, state.epoch, self.readback))
        while inflight and (len(inflight) > self.lag or inflight[0].ready()):
            await self.deliver(inflight.popleft())

    async def deliver(self, routed: list[Routed] | Flushed) -> None:
        """Deliver routed entries (what :attr:`route` returned, flushed now, or a step
        flush whose values were on their way from the device), in order: each record,
        its value read on the host, to its subscribers, and kept as the latest of its
        name; each event through the bus's dispatch table."""
        if type(routed) is Flushed:
            step, epoch, values = routed.step, routed.epoch, routed.values()
            routed = routed.routed
        else:
            state = self.state
            step, epoch = state.step, state.epoch
            values = resolve(
                [item.value if type(item) is PendingPut else None for item, _ in routed]
            )
        bus = self.bus
        latest = self.latest_of.stage
        now = 0.0
        self._delivering += 1
        try:
            for (item, entries), value in zip(routed, values, strict=True):
                if type(item) is PendingEvent:  # an event from trainer.publish
                    await bus.publish(item.event)
                    continue
                if not now:
                    now = time.time()
                record = latest[item.name] = record_of(item, value, step, epoch, now)
                if entries:
                    await bus.deliver(entries, record, settle=False)
        finally:
            self._delivering -= 1

    def last_value(self, name: str) -> Any:
        """The value last put under ``name`` (None: never), including one put in the
        running step and not delivered yet (a tensor is read on the host: on an
        accelerator, a sync). For a step-interval scheduler that monitors a record the
        step puts."""
        value = self.pending.last_value(name)
        if value is not None:
            return value.item() if isinstance(value, _Tensor) else value
        self.latest_of.keep(self.inflight)  # values on their way from the device, read now
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
        return self.latest_of.latest_records()

    def stage_records(self) -> dict[str, PutRecord]:
        """The last record of each name put during the running (or last) stage (values
        still unread are read on the host now: one read per dtype)."""
        return self.latest_of.stage_records()


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
        # Between two handlers of one event (see EventBus.deliver): flush what is pending.
        self._unsettled = recorder.has_pending
        self._settle = recorder.flush
