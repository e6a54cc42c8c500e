"""Precision: how the step runs forward (autocast) and backward (grad scaling).

The engine calls these through :class:`Precision`; the default is full fp32 with no
context manager and no scaler, so the plain path costs nothing. Mixed precision lives in
``loopbus.plugins`` and registers its names here (``Trainer(precision="bf16-mixed")``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from .._exceptions import MisconfigurationError

__all__ = ["Precision", "register_precision", "resolve_precision"]


class Precision:
    """Full precision: no autocast, no scaler. Subclass to change both."""

    #: A zero-argument factory of the forward's context manager, or None for none.
    autocast: Callable[[], AbstractContextManager[Any]] | None = None
    #: The grad scaler, or None.
    scaler: Any = None
    name: str = "32"
    #: The dtype a sharding strategy computes with its gathered parameters in (FSDP's
    #: ``MixedPrecisionPolicy.param_dtype``; gradients are reduced in fp32), or None for
    #: the parameters' own.
    param_dtype: torch.dtype | None = None

    def setup(self, device: torch.device) -> None:
        """Called when a stage starts, with the device the module runs on."""

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        loss.backward(**kwargs)  # type: ignore[no-untyped-call]

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Make the gradients of ``optimizer`` true gradients (before clipping)."""

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


_REGISTRY: dict[str, Callable[[], Precision]] = {"32": Precision, "32-true": Precision}


def register_precision(name: str, factory: Callable[[], Precision]) -> None:
    """Make ``Trainer(precision=name)`` build ``factory()``."""
    _REGISTRY[name] = factory


def resolve_precision(value: str | int | Precision | None) -> Precision:
    if value is None:
        return Precision()
    if isinstance(value, Precision):
        return value
    key = str(value)
    factory = _REGISTRY.get(key)
    if factory is None:
        raise MisconfigurationError(
            f"unknown precision {value!r}; choose one of {sorted(_REGISTRY)} or pass a "
            "loopbus Precision instance. (Mixed precision names are registered when "
            "loopbus.plugins is imported, which `import loopbus` does.)"
        )
    return factory()
