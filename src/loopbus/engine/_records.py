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
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ..events import DESTINATIONS, EventBus, PutRecord

if TYPE_CHECKING:
    from ._trainer import Trainer

__all__ = ["PutMixin", "Recorder"]

_Tensor = torch.Tensor
_ALL: tuple[str, ...] = DESTINATIONS
_DEST_CACHE: dict[Any, tuple[str, ...]] = {None: _ALL}
_KNOWN_ROLES: set[str] = set(DESTINATIONS)

Pending = tuple[str, Any, tuple[str, ...], str]


def register_destination(role: str) -> None:
    """Allow ``role`` as a put destination (plugins with a role of their own call this)."""
    if not isinstance(role, str) or not role:
        raise ValueError(f"a destination role must be a non-empty str, got {role!r}")
    _KNOWN_ROLES.add(role)


def _normalize_destinations(destinations: Any) -> tuple[str, ...]:
    try:
        return _DEST_CACHE[destinations]
    except (KeyError, TypeError):
        pass
    items: Iterable[Any] = (destinations,) if isinstance(destinations, str) else destinations
    try:
        result = tuple(sorted(set(items)))
    except TypeError:
        raise TypeError(
            f"put() destinations must be a str or a collection of str from {DESTINATIONS}, "
            f"got {destinations!r}."
        ) from None
    for role in result:
        if role not in _KNOWN_ROLES:
            raise ValueError(
                f"put() got unknown destination {role!r}; known destinations are "
                f"{sorted(_KNOWN_ROLES)}."
            )
    if not result:
        raise ValueError(
            "put() destinations is empty, so the record would go nowhere; name at least one "
            f"of {DESTINATIONS} or leave destinations=None for all of them."
        )
    try:
        _DEST_CACHE[destinations] = result
    except TypeError:
        pass
    return result


def _coerce(name: str, value: Any) -> float | int | bool:
    if isinstance(value, (bool, int, float)):
        return value
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        value = value.item()  # numpy scalars and 0-d arrays
        if isinstance(value, (bool, int, float)):
            return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, (str, bytes)):
        raise TypeError(
            f"put({name!r}, ...) got text {value!r}; put takes numbers (int, float, bool) "
            "or one-element tensors. To publish text, define and publish a custom event."
        )
    raise TypeError(
        f"put({name!r}, ...) got a value of type {type(value).__name__}: {value!r}. put takes "
        "numbers (int, float, bool) or one-element tensors; for a torchmetrics Metric, put "
        "metric.compute()."
    )


class PutMixin:
    """Gives ``put`` and ``put_dict`` to modules and plugins."""

    _loopbus_recorder: Recorder | None = None
    _loopbus_source: str = ""

    def put(self, name: str, value: Any, destinations: Any = None) -> None:
        """Publish ``value`` under ``name`` to ``destinations`` (default: all of
        ``"callbacks"``, ``"loggers"``, ``"progress_bar"`` and ``"external"``).

        ``value`` is a Python number or a one-element tensor (detached here; it is read
        on the host later, off the step's critical path). Nothing is aggregated: use
        torchmetrics for running means and cross-rank reduction.
        """
        if type(name) is not str or not name:
            raise TypeError(
                f"put() name must be a non-empty str such as 'train/loss', got {name!r}."
            )
        cls = type(value)
        if cls is _Tensor or isinstance(value, _Tensor):
            if value.ndim and value.numel() != 1:
                raise ValueError(
                    f"put({name!r}, ...) needs a single number, got a tensor of shape "
                    f"{tuple(value.shape)}. Reduce it first (for example .mean()), or put "
                    "each element under its own name."
                )
            if value.dtype.is_complex:
                raise TypeError(f"put({name!r}, ...) got a complex tensor; put a real number.")
            if value.requires_grad:
                value = value.detach()
        elif cls is not float and cls is not int and cls is not bool:
            value = _coerce(name, value)
        if destinations is not None:
            destinations = _normalize_destinations(destinations)
        else:
            destinations = _ALL
        recorder = self._loopbus_recorder
        if recorder is None:
            raise RuntimeError(
                f"{type(self).__name__}.put({name!r}, ...) was called outside a Trainer stage; "
                "call it from a step or an event handler while fit/validate/test/predict runs."
            )
        recorder.pending.append((name, value, destinations, self._loopbus_source))

    def put_dict(self, values: Mapping[str, Any], destinations: Any = None) -> None:
        """``put`` every item of ``values``."""
        if not isinstance(values, Mapping):
            raise TypeError(f"put_dict() needs a mapping of name -> value, got {values!r}.")
        for name, value in values.items():
            self.put(name, value, destinations)


def bind_recorder(obj: object, recorder: Recorder | None, source: str) -> None:
    """Point ``obj.put`` at ``recorder`` (bypassing ``nn.Module.__setattr__``)."""
    object.__setattr__(obj, "_loopbus_recorder", recorder)
    object.__setattr__(obj, "_loopbus_source", source)


class Recorder:
    """The trainer's pending put records and the latest value of each name."""

    __slots__ = ("bus", "latest", "pending", "trainer")

    def __init__(self, trainer: Trainer, bus: EventBus) -> None:
        self.trainer = trainer
        self.bus = bus
        self.pending: list[Pending] = []
        self.latest: dict[str, PutRecord | tuple[Any, ...]] = {}

    async def flush(self) -> None:
        """Convert and deliver the pending records, in the order they were put."""
        pending = self.pending
        if not pending:
            return
        self.pending = []
        trainer = self.trainer
        step = trainer.global_step
        epoch = trainer.current_epoch
        now = 0.0
        route = self.bus.route
        deliver = self.bus.deliver
        latest = self.latest
        for name, value, destinations, source in pending:
            entries = route(destinations)
            if not entries:
                latest[name] = (name, value, step, epoch, source, destinations)
                continue
            if type(value) is _Tensor or isinstance(value, _Tensor):
                value = value.item()
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

    def latest_records(self) -> dict[str, PutRecord]:
        """The last record of each name (values read on the host now if still pending)."""
        out: dict[str, PutRecord] = {}
        for name, item in self.latest.items():
            if isinstance(item, PutRecord):
                out[name] = item
                continue
            _, value, step, epoch, source, destinations = item
            if isinstance(value, _Tensor):
                value = value.item()
            record = PutRecord(
                name=name,
                value=value,
                step=step,
                epoch=epoch,
                time=time.time(),
                source=source,
                destinations=destinations,
            )
            self.latest[name] = record
            out[name] = record
        return out
