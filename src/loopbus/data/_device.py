"""Batches on their way to an accelerator: nested moves, and CUDA side-stream prefetch.

:func:`move_batch` moves any nesting of tensors, tuples, lists, dicts, namedtuples,
dataclasses and objects with a ``.to()`` method, and can collect the device tensors it
made (so the caller can ``record_stream`` each of them: a nested tuple's tensors
included).

:class:`CudaBatchSource` fetches batch *k + 1* from a host source while step *k*
computes:

1. the host batch is pinned if it is not (a worker thread does it when ``prefetch`` is
   on; else it happens here);
2. the copy stream of the device (one per device, for the life of the process: a new
   stream per epoch would grow the reserved memory every epoch) first waits on the
   compute stream, since the allocator may hand the copy memory the compute stream
   freed but has not finished using; then every tensor is copied with
   ``non_blocking=True`` and an event is recorded;
3. when the loop takes the batch, the compute stream waits on that event (on the
   device: the host does not wait) and every device tensor of the batch is
   ``record_stream``-ed on the compute stream, so the allocator does not reuse its
   memory for the next copy while the step still reads it.

Objects whose tensors cannot be reached (an object with a ``.to()``) are moved on the
compute stream instead, correct but not overlapped.

The loader position a checkpoint saves is the one recorded with each host batch, so it
is that of the last batch handed to a step, never of one copied ahead.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = [
    "CudaBatchSource",
    "Readback",
    "Reading",
    "copy_stream",
    "map_batch",
    "move_batch",
    "pin_batch",
    "readback_for",
    "scalar",
]

_Tensor = torch.Tensor

# One copy stream per device for the life of the process.
_COPY_STREAMS: dict[torch.device, Any] = {}


def copy_stream(device: torch.device) -> Any:
    """The long-lived host-to-device copy stream of ``device``."""
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    return stream


def scalar(value: _Tensor) -> _Tensor:
    """A one-element tensor as a 0-d tensor outside autograd, ready to stack with others.
    Only what needs it is reshaped or detached: each of those is a dispatch, several
    times the cost of checking (stacking a tensor that requires grad also builds a
    backward node nobody uses)."""
    if value.requires_grad:
        value = value.detach()
    return value if value.ndim == 0 else value.reshape(())


def _index(device: torch.device) -> int:
    """The index of a CUDA ``device`` (the current device for plain ``cuda``)."""
    return torch.cuda.current_device() if device.index is None else device.index


def _switch_stream(stream: Any) -> Any:
    """Make ``stream`` the current stream of its device; return the one it replaces (to
    hand back to ``torch.cuda.set_stream``). ``torch.cuda.stream(...)`` does the same but
    looks the current device up twice per use: too slow for a per-step path."""
    previous = torch.cuda.current_stream(stream.device_index)
    torch.cuda.set_stream(stream)
    return previous


class _Opaque(Exception):
    """A batch holds an object whose device tensors cannot be reached."""


def map_batch(
    batch: Any, tensor: Callable[[_Tensor], Any], other: Callable[[Any], Any] | None = None
) -> Any:
    """``batch`` rebuilt with ``tensor(t)`` for every tensor ``t`` in it, its structure
    intact: tuples, lists, dicts (any ``Mapping`` type that can be built from pairs),
    namedtuples and dataclasses are walked; any other value goes to ``other`` (kept as
    it is without one)."""

    def walk(value: Any) -> Any:
        if isinstance(value, _Tensor):
            return tensor(value)
        if isinstance(value, tuple):
            items = [walk(v) for v in value]
            if hasattr(value, "_fields"):  # a namedtuple
                return type(value)(*items)
            return type(value)(items)
        if isinstance(value, list):
            return type(value)(walk(v) for v in value)
        if isinstance(value, Mapping):
            pairs = [(k, walk(v)) for k, v in value.items()]
            try:
                return type(value)(pairs)  # type: ignore[call-arg]
            except TypeError:
                return dict(pairs)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            changes = {
                f.name: walk(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init
            }
            return dataclasses.replace(value, **changes)
        return value if other is None else other(value)

    return walk(batch)


def move_batch(
    batch: Any,
    device: torch.device,
    made: list[_Tensor] | None = None,
    *,
    opaque_ok: bool = True,
) -> Any:
    """``batch`` with every tensor moved to ``device`` (``non_blocking=True``), its
    structure intact (see :func:`map_batch`); objects with a ``.to()`` method move
    themselves. The device tensors made are appended to ``made``. With
    ``opaque_ok=False`` an object moved by its own ``.to()`` raises :class:`_Opaque`
    instead (its tensors cannot be collected)."""

    def move(t: _Tensor) -> _Tensor:
        moved = t.to(device, non_blocking=True)
        if made is not None:
            made.append(moved)
        return moved

    def move_object(value: Any) -> Any:
        to = getattr(value, "to", None)
        if not callable(to) or isinstance(value, (str, bytes, type)):
            return value
        if not opaque_ok:
            raise _Opaque
        try:
            return to(device, non_blocking=True)
        except TypeError:  # a .to() without non_blocking
            return to(device)

    return map_batch(batch, move, move_object)


def _pin(t: _Tensor) -> _Tensor:
    return t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t


def pin_batch(batch: Any) -> Any:
    """``batch`` with every CPU tensor in pinned (page-locked) memory; tensors already
    pinned are kept as they are."""
    return map_batch(batch, _pin)


class CudaBatchSource:
    """A batch source (the loops' ``BatchSource`` interface: ``has_next``,
    ``look_ahead``, ``take``, ``position``, ``close``) that keeps up to ``depth``
    batches copied (or being copied) to a CUDA device ahead of the step, on the
    device's copy stream. Wraps the host source (inline or threaded) it takes batches
    from; ``pin=False`` when that source pins them already."""

    __slots__ = (
        "_compute",
        "_copy",
        "_device",
        "_index",
        "_inner",
        "_pin",
        "_ready",
        "_recorded",
        "depth",
    )

    def __init__(
        self, inner: Any, device: torch.device, depth: int = 1, *, pin: bool = True
    ) -> None:
        self._inner = inner
        self._device = device
        self.depth = max(1, int(depth))
        self._pin = pin
        self._copy = copy_stream(device)
        self._index = _index(device)
        self._compute = torch.cuda.current_stream(self._index)
        # (device batch, event, device tensors or None when moved on the compute
        # stream, the loader position as of that batch)
        self._ready: deque[tuple[Any, Any, list[_Tensor] | None, Any]] = deque()
        self._recorded: dict[str, Any] | None = inner.position()

    def _fill(self) -> None:
        inner = self._inner
        ready = self._ready
        while len(ready) < self.depth and inner.has_next():
            host = inner.take()
            position = inner.position()
            if self._pin:
                host = pin_batch(host)
            made: list[_Tensor] = []
            stream = self._copy
            # The copy may get memory the compute stream freed and still reads.
            stream.wait_stream(self._compute)
            previous = _switch_stream(stream)
            try:
                moved = move_batch(host, self._device, made, opaque_ok=False)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
            except _Opaque:
                event = None
            finally:
                torch.cuda.set_stream(previous)
            if event is None:
                # Tensors the copy stream cannot hand over safely: move on the
                # compute stream (ordered with the step, no overlap).
                ready.append((move_batch(host, self._device), None, None, position))
            else:
                ready.append((moved, event, made, position))
            del host

    def has_next(self) -> bool:
        if not self._ready:
            self._fill()
        return bool(self._ready)

    def look_ahead(self) -> bool:
        return self.has_next()

    def take(self) -> Any:
        moved, event, made, position = self._ready.popleft()
        compute = self._compute
        if event is not None:
            compute.wait_event(event)  # on the device; the host goes on
            assert made is not None
            for tensor in made:
                tensor.record_stream(compute)
        self._recorded = position
        # Start the next copies now: they overlap with the step about to run.
        self._fill()
        return moved

    def position(self) -> dict[str, Any] | None:
        return self._recorded

    def exhausted(self) -> bool:
        return not self._ready and self._inner.exhausted()

    def close(self) -> None:
        self._ready.clear()
        self._inner.close()


# ------------------------------------------------------------------ reading put values
class Reading:
    """Values of put tensors on their way to the host: :meth:`ready` says (without
    waiting) whether the copy finished, :meth:`values` returns the Python numbers
    (waiting for the copy if it has not)."""

    __slots__ = ("_event", "_hosts", "_size")

    def __init__(self, hosts: list[tuple[list[int], _Tensor]], event: Any, size: int) -> None:
        self._hosts = hosts
        self._event = event
        self._size = size

    def ready(self) -> bool:
        return bool(self._event.query())

    def values(self) -> list[Any]:
        self._event.synchronize()  # at once when ready() said so
        out: list[Any] = [None] * self._size
        for indices, host in self._hosts:
            for i, number in zip(indices, host.tolist(), strict=True):
                out[i] = number
        return out


class Readback:
    """Reads put tensors of one CUDA device on the host without making the host wait:
    the tensors of each dtype are stacked into one (one kernel), copied device-to-host
    with ``non_blocking=True`` into pinned memory (the caching host allocator recycles
    those buffers once their copy is done: a ring without a fixed size) on a side
    stream that first waits on the compute stream, and an event marks the copy."""

    __slots__ = ("_index", "_stream", "device_type")

    def __init__(self, device: torch.device) -> None:
        self._index = _index(device)
        #: The type of device whose tensors it reads (``"cuda"``).
        self.device_type = device.type
        self._stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

    def start(self, tensors: list[_Tensor]) -> Reading:
        stream = self._stream
        compute = torch.cuda.current_stream(self._index)
        stream.wait_stream(compute)
        groups: dict[Any, list[int]] = {}
        for i, tensor in enumerate(tensors):
            groups.setdefault(tensor.dtype, []).append(i)
        hosts: list[tuple[list[int], _Tensor]] = []
        torch.cuda.set_stream(stream)
        try:
            for dtype, indices in groups.items():
                parts = []
                for i in indices:
                    tensor = tensors[i]
                    # Made on the compute stream, read here: not recycled before that.
                    tensor.record_stream(stream)
                    if tensor.layout is not torch.strided:
                        tensor = tensor.to_dense()
                    parts.append(scalar(tensor))
                stacked = torch.stack(parts)
                host = torch.empty(stacked.shape, dtype=dtype, pin_memory=True)
                host.copy_(stacked, non_blocking=True)
                hosts.append((indices, host))
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record(stream)
        finally:
            torch.cuda.set_stream(compute)
        return Reading(hosts, event, len(tensors))


_READBACKS: dict[torch.device, Readback] = {}


def readback_for(device: torch.device) -> Readback | None:
    """The :class:`Readback` of ``device``, or None where reading a value does not
    make the host wait for a device (the CPU)."""
    if device.type != "cuda":
        return None
    readback = _READBACKS.get(device)
    if readback is None:
        readback = _READBACKS[device] = Readback(device)
    return readback
