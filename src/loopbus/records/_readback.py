"""Reading put values on the host: tensors read as Python numbers, one read per dtype
(:func:`resolve`), and a flush whose device values are copied to the host without
waiting (:class:`Flushed`, through ``data._device.Readback``)."""

from __future__ import annotations

from typing import Any

import torch

from loopbus.data import _device

from ._checks import STRIDED
from ._entries import PendingEvent, PendingPut

__all__ = ["Flushed", "Routed", "resolve"]

_Tensor = torch.Tensor

#: A pending entry and the record subscribers it goes to: None for a published event
#: (delivered through the bus's dispatch table), ``()`` for a record that follows an
#: earlier one of its name to nobody (so that it is the latest of its name, as put).
Routed = tuple[PendingPut | PendingEvent, Any]


def resolve(values: list[Any]) -> list[Any]:
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


def _value(item: PendingPut | PendingEvent) -> Any:
    """The value of a pending entry as put (None for an event)."""
    return item.value if type(item) is PendingPut else None


class Flushed:
    """The routed entries of one flush, in order, with the step and epoch they carry,
    and their values: read on the host when asked for (:meth:`values`), their copies
    from the device started at once where ``readback`` is given (:meth:`ready` tells
    whether they are done without waiting)."""

    __slots__ = ("_indices", "_reading", "_values", "epoch", "routed", "step")

    def __init__(
        self,
        routed: list[Routed],
        step: int,
        epoch: int,
        readback: _device.Readback | None = None,
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
        """The entries' values as Python numbers (None for the events)."""
        if self._values is not None:
            return self._values
        raw = [_value(item) for item, _ in self.routed]
        reading = self._reading
        if reading is not None:
            for i, number in zip(self._indices, reading.values(), strict=True):
                raw[i] = number
        self._values = resolve(raw)  # CPU tensors, one read per dtype
        return self._values
