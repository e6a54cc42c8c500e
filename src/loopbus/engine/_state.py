"""The one protocol every stateful component follows."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

__all__ = ["Stateful"]


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict() -> dict`` and ``load_state_dict(dict) -> None``:
    loops, the module, optimizers, schedulers, plugins, the precision's grad scaler,
    stateful data loaders. A checkpoint is the union of their state dicts."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...
