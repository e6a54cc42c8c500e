"""``put``: metric records from modules and plugins to their destinations.

``put`` validates at the call site and appends to the trainer's pending list; nothing
is converted or delivered there. The trainer flushes pending records at step and hook
boundaries: it reads tensor values on the host (the step's only sync on CPU; on CUDA the
conversion is meant to move to a batched non-blocking copy), builds :class:`PutRecord`s
and routes each to the subscribers whose role its destinations name.
"""

from __future__ import annotations

import numbers
import time
from collections import deque
from collections.abc import Callable, Generator, Iterable, Mapping
from typing import TYPE_CHECKING, Any, cast

import msgspec
import torch

from loopbus.data import _device

from ..events import DESTINATIONS, CustomEvent, Event, EventBus, PutRecord

if TYPE_CHECKING:
    from loopbus.state._runstate import RunState

__all__ = ["PutMixin", "Publication", "Recorder"]

_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_ALL: tuple[str, ...] = DESTINATIONS
_DEST_CACHE: dict[Any, tuple[str, ...]] = {None: _ALL}
_KNOWN_ROLES: set[str] = set(DESTINATIONS)

Pending = tuple[str, Any, tuple[str, ...], str]


def register_destination(role: str) -> None:
    """Allow ``role`` as a put destination (plugins with a role of their own call this)."""
    if not isinstance(role, str) or not role:
        raise ValueError(
            f"a destination role must be a non-empty str, got {_described(role)}"
        )
    _KNOWN_ROLES.add(role)


def _normalize_destinations(destinations: Any) -> tuple[str, ...]:
    try:
        return _DEST_CACHE[destinations]
    except (KeyError, TypeError):
        pass
    result = _destinations(destinations)
    try:
        _DEST_CACHE[destinations] = result
    except TypeError:
        pass
    return result


def _destinations(destinations: Any) -> tuple[str, ...]:
    """``destinations`` checked and sorted (not cached: what compiled code calls)."""
    items: Iterable[Any] = (destinations,) if isinstance(destinations, str) else destinations
    try:
        result = tuple(sorted(set(items)))
    except TypeError:
        raise TypeError(
            f"put() destinations must be a str or a collection of str from {DESTINATIONS}, "
            f"got {_described(destinations)}."
        ) from None
    for role in result:
        if role not in _KNOWN_ROLES:
            raise ValueError(
                f"put() got unknown destination {_described(role)}; known destinations are "
                f"{sorted(_KNOWN_ROLES)}."
            )
    if not result:
        raise ValueError(
            "put() destinations is empty, so the record would go nowhere; name at least one "
            f"of {DESTINATIONS} or leave destinations=None for all of them."
        )
    return result


#: The integers every consumer can carry: msgpack (the stream) encodes ints from -2**63
#: to 2**64 - 1 and nothing beyond; the loggers agree on that range.
_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1
#: The longest name allowed, in characters: the longest name a stream client can
#: subscribe to exactly (``Subscribe.names`` entries are at most 256 characters), and far
#: below what a CSV reader accepts in a header cell (131072).
_MAX_NAME_LENGTH = 256
#: Names already validated (so that each distinct name is checked once). Cleared when
#: it grows this large, so names made up per step cannot grow it without bound.
_VALID_NAMES: set[str] = set()
_VALID_NAMES_LIMIT = 1 << 16
_STRIDED = torch.strided
#: Tensor dtypes whose ``.item()`` is a Python bool, int (within the 64-bit range) or
#: float. Not: complex, bit-packed and sub-byte dtypes (no ``.item()``).
_TENSOR_DTYPES: frozenset[torch.dtype] = frozenset(
    dtype
    for dtype in (
        getattr(torch, dtype_name, None)
        for dtype_name in (
            "bool",
            "uint8",
            "uint16",
            "uint32",
            "uint64",
            "int8",
            "int16",
            "int32",
            "int64",
            "float16",
            "bfloat16",
            "float32",
            "float64",
            "float8_e4m3fn",
            "float8_e4m3fnuz",
            "float8_e5m2",
            "float8_e5m2fnuz",
            "float8_e8m0fnu",
            "qint8",
            "quint8",
            "qint32",
        )
    )
    if isinstance(dtype, torch.dtype)
)
_NAME_RULES = (
    f"a name is a non-empty str of at most {_MAX_NAME_LENGTH} characters, valid Unicode "
    "(no lone surrogates), without control characters (U+0000-U+001F, U+007F-U+009F) or "
    "line separators (U+2028, U+2029)"
)


def _described(value: object) -> str:
    """``repr(value)`` for an error message, cut short; never raises (a value whose
    ``__repr__`` raises, or returns something else than a str, is named by its type)."""
    try:
        text = repr(value)
    except Exception as error:  # the message is about the value, not its repr
        return f"<{type(value).__qualname__} object; its __repr__ raised {type(error).__name__}>"
    if type(text) is not str:
        return f"<{type(value).__qualname__} object>"
    if len(text) > 1000:
        return f"{text[:800]}... ({len(text)} characters)"
    return text


def _shown(name: str) -> str:
    """``repr(name)``, cut short for very long names."""
    if len(name) <= 80:
        return repr(name)
    return f"{name[:60]!r}... ({len(name)} characters)"


def _check_name(name: Any) -> None:
    """Raise unless ``name`` is a name every consumer can carry; remember it if it is."""
    _validate_name(name)
    if len(_VALID_NAMES) >= _VALID_NAMES_LIMIT:
        _VALID_NAMES.clear()
    _VALID_NAMES.add(name)


def _validate_name(name: Any) -> None:
    """Raise unless ``name`` is a name every consumer can carry (remembers nothing: what
    compiled code calls, where a remembered name would be a guard that changes).

    Lone surrogates cannot be encoded as UTF-8 (the stream, the JSON lines and CSV files,
    TensorBoard all need it); control characters and line separators break the one-line
    displays (the progress bar, ``loopbus watch``) and the CSV header, and could smuggle
    terminal escape sequences.
    """
    if type(name) is not str or not name:
        raise TypeError(
            f"put() name must be a non-empty str such as 'train/loss', got {_described(name)}."
        )
    if len(name) > _MAX_NAME_LENGTH:
        raise ValueError(
            f"put() name {_shown(name)} is {len(name)} characters long; names may have at "
            f"most {_MAX_NAME_LENGTH} characters (the longest a stream client can subscribe "
            "to). Use a shorter name."
        )
    if not (name.isascii() and name.isprintable()):
        for index, char in enumerate(name):
            code = ord(char)
            if 0xD800 <= code <= 0xDFFF:
                raise ValueError(
                    f"put() name {_shown(name)} is not valid Unicode text: it has the lone "
                    f"surrogate {char!r} at index {index}, which cannot be encoded as UTF-8 "
                    "(as the loggers and the stream must). This usually comes from bytes "
                    "decoded with errors='surrogateescape'; decode them with "
                    "errors='replace' or fix the name. Rule: " + _NAME_RULES + "."
                )
            if code < 0x20 or 0x7F <= code <= 0x9F or code == 0x2028 or code == 0x2029:
                raise ValueError(
                    f"put() name {_shown(name)} has the control character {char!r} at index "
                    f"{index}; names are shown on one line (progress bar, CSV header, "
                    "loopbus watch), so control characters and line breaks are not allowed. "
                    "Replace it, for example with ' ' or '_'. Rule: " + _NAME_RULES + "."
                )


def _int_out_of_range(name: str, value: int) -> ValueError:
    return ValueError(
        f"put({_shown(name)}, ...) got the int {value!r}, outside the 64-bit range "
        "[-2**63, 2**64 - 1] that every consumer (the stream's msgpack, the loggers) can "
        "carry. Put a number in that range, or float(value) if an approximate value will do."
    )


def _check_int(name: str, value: int) -> int:
    if not _INT_MIN <= value <= _INT_MAX:
        raise _int_out_of_range(name, value)
    return value


def _check_tensor(name: str, value: torch.Tensor) -> None:
    """Raise unless ``value`` is a one-element tensor that can be read as a Python number."""
    if value.ndim and value.numel() != 1:
        raise ValueError(
            f"put({_shown(name)}, ...) needs a single number, got a tensor of shape "
            f"{tuple(value.shape)}. Reduce it first (for example .mean()), or put each "
            "element under its own name."
        )
    dtype = value.dtype
    if dtype.is_complex:
        raise TypeError(
            f"put({_shown(name)}, ...) got a complex tensor ({dtype}); put a real number, "
            "for example its .abs() or .real."
        )
    if dtype not in _TENSOR_DTYPES:
        raise TypeError(
            f"put({_shown(name)}, ...) got a tensor of dtype {dtype}, which cannot be read "
            "as a Python number; put a bool, integer or floating-point tensor (for example "
            "value.float())."
        )
    if value.is_meta:
        raise ValueError(
            f"put({_shown(name)}, ...) got a tensor on the meta device, which holds no "
            "value; put a tensor with data (on the CPU or an accelerator)."
        )
    layout = value.layout
    if layout is not torch.strided and layout is not torch.sparse_coo:
        raise TypeError(
            f"put({_shown(name)}, ...) got a tensor with layout {layout}, which cannot be "
            "read as a Python number; put value.to_dense()."
        )


def _coerce(name: str, value: Any) -> float | int | bool:
    """``value`` as an exact ``bool``, ``int`` (in the 64-bit range) or ``float``, or
    raise saying why it cannot be put."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        value = value.item()  # numpy scalars and 0-d arrays
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):  # int subclasses (IntEnum, ...) as plain ints
        return _check_int(name, int(value))
    if isinstance(value, float):  # float subclasses (numpy.float64, ...) as plain floats
        return float(value)
    if isinstance(value, numbers.Integral):
        return _check_int(name, int(value))
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:
            raise ValueError(
                f"put({_shown(name)}, ...) got {_described(value)}, which is too large for a "
                "float (the loggers and the stream carry 64-bit floats). Put a smaller number."
            ) from None
    if isinstance(value, (str, bytes)):
        raise TypeError(
            f"put({_shown(name)}, ...) got text {_described(value)}; put takes numbers (int, float, "
            "bool) or one-element tensors. To publish text, define and publish a custom event."
        )
    raise TypeError(
        f"put({_shown(name)}, ...) got a value of type {type(value).__name__}: "
        f"{_described(value)}. put "
        "takes numbers (int, float, bool) or one-element tensors; for a torchmetrics Metric, "
        "put metric.compute()."
    )


class PutMixin:
    """Gives ``put`` and ``put_dict`` to modules and plugins.

    Where records go is bound explicitly: the trainer calls :meth:`bind_recorder` on the
    module and on each plugin when a stage starts (and with None when it ends)."""

    _loopbus_recorder: Recorder | None = None
    _loopbus_source: str = ""

    def bind_recorder(self, recorder: Recorder | None, source: str = "") -> None:
        """Send this object's ``put`` records to ``recorder`` with ``source`` as their
        source (None: outside a stage, where ``put`` raises). Called by the trainer when
        a stage starts and ends."""
        # Its own attributes, set past nn.Module.__setattr__ (not parameters or buffers).
        object.__setattr__(self, "_loopbus_recorder", recorder)
        object.__setattr__(self, "_loopbus_source", source)

    def put(self, name: str, value: Any, destinations: Any = None) -> None:
        """Publish ``value`` under ``name`` to ``destinations`` (default: all of
        ``"callbacks"``, ``"loggers"``, ``"progress_bar"`` and ``"external"``).

        ``value`` is a Python number or a one-element tensor (detached here; it is read
        on the host later, off the step's critical path). Nothing is aggregated: use
        torchmetrics for running means and cross-rank reduction.

        What every consumer (loggers, the stream, the progress bar) can carry is checked
        here, and anything else raises here rather than in a consumer later: ``name`` is
        a non-empty str of at most 256 characters, valid Unicode (no lone surrogates),
        without control characters or line separators; an int is within
        ``[-2**63, 2**64 - 1]``; a tensor has one element and a bool, integer or
        floating-point dtype. NaN and infinite floats are fine.

        In a stage with ``Trainer(compile=...)`` put takes a path compiled code can trace
        without a graph break or a changing guard: the same checks, nothing remembered
        (they run once, when the step is traced), and during a step the entry appended
        to the recorder's step buffer (always empty when a step starts), which compiled
        code does after its graph has run (the tensors are the graph's outputs). The
        recorder moves them to the pending records when the step returns
        (:meth:`Recorder.run_compiled`), and the step boundary flushes them as in eager
        mode.
        """
        recorder = self._loopbus_recorder
        if recorder is not None and recorder.compiled:
            recorder.buffer.append(_traced_entry(name, value, destinations, self._loopbus_source))
            return
        if type(name) is not str or name not in _VALID_NAMES:
            _check_name(name)
        cls = type(value)
        if cls is _Tensor or isinstance(value, _Tensor):
            # Compressed sparse and mkldnn layouts cannot be 0-d: a 0-d tensor skips that.
            if (
                (value.ndim and (value.numel() != 1 or value.layout is not _STRIDED))
                or value.dtype not in _TENSOR_DTYPES
                or value.is_meta
            ):
                _check_tensor(name, value)
            if value.requires_grad:
                value = value.detach()
        elif cls is int:
            if not _INT_MIN <= value <= _INT_MAX:
                raise _int_out_of_range(name, value)
        elif cls is not float and cls is not bool:
            value = _coerce(name, value)
        if destinations is not None:
            destinations = _normalize_destinations(destinations)
        else:
            destinations = _ALL
        if recorder is None:
            raise RuntimeError(
                f"{type(self).__name__}.put({name!r}, ...) was called outside a Trainer stage; "
                "call it from a step or an event handler while fit/validate/test/predict runs."
            )
        recorder.pending.append((name, value, destinations, self._loopbus_source))

    def put_dict(self, values: Mapping[str, Any], destinations: Any = None) -> None:
        """``put`` every item of ``values``: all of them, or (when one is refused) none."""
        if not isinstance(values, Mapping):
            raise TypeError(
                f"put_dict() needs a mapping of name -> value, got {_described(values)}."
            )
        recorder = self._loopbus_recorder
        if recorder is not None and recorder.compiled:
            # Every entry checked before any is appended: nothing reads the pending list
            # (whose length would be a guard of compiled code).
            source = self._loopbus_source
            entries = [
                _traced_entry(name, value, destinations, source) for name, value in values.items()
            ]
            recorder.buffer.extend(entries)
            return
        pending = recorder.pending if recorder is not None else None
        mark = len(pending) if pending is not None else 0
        try:
            for name, value in values.items():
                self.put(name, value, destinations)
        except BaseException:
            if pending is not None:
                del pending[mark:]  # the items put before the refused one
            raise


def _traced_entry(name: Any, value: Any, destinations: Any, source: str) -> Pending:
    """The pending entry of ``put(name, value, destinations)`` with every check of the
    eager path but no cache (see :meth:`PutMixin.put`); tensors always detached.

    While compiled code traces it, the value is also copied: a graph output that is a
    view of another output or of an input (the loss that the step also returns, an
    element of a parameter) is rebuilt by torch's runtime after every call of the
    compiled step, in Python; a one-element copy is a store in a kernel the compiler
    generates anyway."""
    _validate_name(name)
    if isinstance(value, _Tensor):
        _check_tensor(name, value)
        value = value.detach()
        if _is_compiling():
            value = value.clone()
    elif type(value) is int:
        _check_int(name, value)
    elif type(value) is not float and type(value) is not bool:
        value = _coerce(name, value)
    return (name, value, _ALL if destinations is None else _destinations(destinations), source)


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
        if len(indices) == 1 or layout is not _STRIDED:
            for i in indices:
                out[i] = values[i].item()
            continue
        numbers = torch.stack([_device.scalar(values[i]) for i in indices]).tolist()
        for i, number in zip(indices, numbers, strict=True):
            out[i] = number
    return out


#: The destinations of a pending entry that is an event published with
#: ``trainer.publish`` (its value), not a record: delivered in put order by ``flush``.
EVENT_ENTRY: tuple[str, ...] = ("\x00event",)


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
        routed: list[tuple[Pending, Any]],
        step: int,
        epoch: int,
        readback: _device.Readback | None,
    ) -> None:
        self.routed = routed
        self.step = step
        self.epoch = epoch
        self._values: list[Any] | None = None
        self._reading: _device.Reading | None = None
        # The items whose values are read back from the device.
        self._indices = (
            []
            if readback is None
            else [
                i
                for i, ((_, value, _, _), _) in enumerate(routed)
                if isinstance(value, _Tensor) and value.device.type == readback.device_type
            ]
        )
        if readback is not None and self._indices:
            self._reading = readback.start([routed[i][0][1] for i in self._indices])

    def ready(self) -> bool:
        reading = self._reading
        return reading is None or reading.ready()

    def values(self) -> list[Any]:
        """The items' values as Python numbers (events as they are)."""
        if self._values is not None:
            return self._values
        raw = [item[1] for item, _ in self.routed]
        reading = self._reading
        if reading is not None:
            for i, number in zip(self._indices, reading.values(), strict=True):
                raw[i] = number
        self._values = _resolve(raw)  # CPU tensors, one read per dtype
        return self._values


class Recorder:
    """The trainer's pending put records (and published events), and the latest record
    of each name.

    ``latest`` holds the records of the running (or last) stage; ``earlier`` those of
    earlier stages whose names this stage has not put (yet). A stage's start moves
    ``latest`` into ``earlier``; :meth:`latest_records` is both, so a name keeps its last
    value across stages until a record of the same name replaces it.
    """

    __slots__ = (
        "_delivering",
        "bus",
        "compiled",
        "earlier",
        "inflight",
        "lag",
        "latest",
        "pending",
        "readback",
        "state",
        "stepping",
        "traced",
    )

    def __init__(self, state: RunState, bus: EventBus, lag: int = 4) -> None:
        #: The run state whose step and epoch the records carry.
        self.state = state
        self.bus = bus
        self.pending: list[Pending] = []
        self.latest: dict[str, PutRecord | tuple[Any, ...]] = {}
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
        #: the length of a list it appends to; this one's never varies).
        self.stepping = False
        self.traced: list[Pending] = []

    def use_device(self, device: Any, compiled: bool = False) -> None:
        """Set the stage's device (on CUDA, :meth:`flush_step` reads put values back
        without making the host wait) and whether its steps are compiled (``put`` then
        takes the path compiled code traces without a graph break)."""
        self.readback = _device.readback_for(device)
        self.compiled = compiled

    @property
    def buffer(self) -> list[Pending]:
        """Where what is put or published now goes: the pending records, or while a
        compiled step runs its step buffer (:attr:`traced`, see :meth:`run_compiled`)."""
        return self.traced if self.stepping else self.pending

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
                self.pending += traced
                traced.clear()

    def reset(self) -> None:
        """Start a stage: nothing pending; the last records so far become earlier ones
        (they stay until a record of the same name replaces them)."""
        self.pending.clear()
        self.inflight.clear()
        if self.latest:
            earlier = self.earlier
            for name, record in self.stage_records().items():
                earlier.pop(name, None)  # keep the order in which names were last put
                earlier[name] = record
            self.latest.clear()

    def discard_pending(self) -> None:
        """Drop what was put or published but not flushed (a cancelled or failed stage)."""
        self.pending.clear()
        self.inflight.clear()

    async def flush_pending(self) -> None:
        """:meth:`flush` if anything waits (a rare boundary: an epoch's or a pass's end)."""
        if self.pending or self.inflight:
            await self.flush()

    def publish(self, event: Event) -> Publication:
        """``trainer.publish``: check ``event``, stamp a :class:`CustomEvent` left with
        ``step``/``epoch`` at -1 with the run's, and queue it (see :meth:`queue_event`).
        Raises :class:`RuntimeError` while no stage runs, where nothing would deliver it."""
        if not isinstance(event, Event):
            raise TypeError(
                f"trainer.publish() takes an event (an instance of a loopbus.Event "
                f"subclass), got {_described(event)}."
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
        self.buffer.append(("", event, EVENT_ENTRY, ""))
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
        latest = self.latest
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
        pending = self.pending
        if not pending:
            return
        self.pending = []
        state = self.state
        routed = self._route(pending, state.step, state.epoch)
        if routed:
            values = _resolve([item[1] for item, _ in routed])
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
        pending = self.pending
        readback = self.readback
        if pending:
            self.pending = []
            state = self.state
            step, epoch = state.step, state.epoch
            routed = self._route(pending, step, epoch)
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
        """Read the values of the waiting step flushes into ``latest`` (not delivered:
        their handlers still get them, in order, at the next flush)."""
        latest = self.latest
        for batch in self.inflight:
            for ((name, _, destinations, source), entries), value in zip(
                batch.routed, batch.values(), strict=True
            ):
                if entries is not None:
                    latest[name] = (name, value, batch.step, batch.epoch, source, destinations)

    def _route(self, pending: list[Pending], step: int, epoch: int) -> list[tuple[Pending, Any]]:
        """The entries each pending item goes to; records nobody listens to are kept
        unread in ``latest`` (read when someone asks: :meth:`latest_records`)."""
        bus = self.bus
        routes = bus.routes
        latest = self.latest
        routed: list[tuple[Pending, Any]] = []
        for item in pending:
            destinations = item[2]
            try:  # a subscript, not routes.get: no call where the route is cached
                entries = routes[destinations]
            except KeyError:
                entries = bus.route(destinations)
            if entries:
                routed.append((item, entries))
            elif destinations is EVENT_ENTRY:
                routed.append((item, None))
            elif routed and any(earlier[0] == item[0] for earlier, _ in routed):
                # A record of this name goes out first (to other destinations): this
                # one follows it to nobody, so the latest is this one, as put.
                routed.append((item, ()))
            else:  # nobody listens: kept unread until someone asks (latest_records)
                name, value, _, source = item
                latest[name] = (name, value, step, epoch, source, destinations)
        return routed

    async def _deliver(
        self, routed: list[tuple[Pending, Any]], values: list[Any], step: int, epoch: int
    ) -> None:
        now = 0.0
        bus = self.bus
        deliver = bus.deliver_record
        latest = self.latest
        for ((name, _, destinations, source), entries), value in zip(routed, values, strict=True):
            if entries is None:  # an event from trainer.publish
                await bus.publish(value)
                continue
            if not now:
                now = time.time()
            record = PutRecord(
                name=name,
                value=value,
                step=step,
                epoch=epoch,
                time=now,
                source=source,
                destinations=destinations,
            )
            latest[name] = record
            await deliver(entries, record)

    def last_value(self, name: str) -> Any:
        """The value last put under ``name`` (None: never), including one put in the
        running step and not delivered yet (a tensor is read on the host: on an
        accelerator, a sync). For a step-interval scheduler that monitors a record the
        step puts."""
        for item in reversed(self.pending):
            if item[0] == name and item[2] is not EVENT_ENTRY:
                value = item[1]
                return value.item() if isinstance(value, _Tensor) else value
        self._settle_inflight()  # values on their way from the device, read now
        record = self.latest_records().get(name)
        return None if record is None else record.value

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
        latest = self.latest
        unread = [item for item in latest.values() if not isinstance(item, PutRecord)]
        if unread:
            now = time.time()
            values = _resolve([item[1] for item in unread])
            for (name, _, step, epoch, source, destinations), value in zip(
                unread, values, strict=True
            ):
                latest[name] = PutRecord(
                    name=name,
                    value=value,
                    step=step,
                    epoch=epoch,
                    time=now,
                    source=source,
                    destinations=destinations,
                )
        return cast("dict[str, PutRecord]", dict(latest))
