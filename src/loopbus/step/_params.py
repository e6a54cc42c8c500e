"""What a step needs to know of a module's parameters: whether they are sharded, and the
module's own class under FSDP's wrapping."""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["has_sharded_parameters", "own_class"]


def own_class(module: object) -> type:
    """The module's own class: under FSDP ``fully_shard`` makes the module an instance
    of a subclass (``FSDP<Name>``) that checkpoints and messages should not show."""
    for cls in type(module).__mro__:
        if not cls.__module__.startswith("torch.distributed.fsdp"):
            return cls
    return type(module)


def has_sharded_parameters(parameters: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``parameters`` (a module's, an optimizer's) is sharded (a DTensor,
    as under FSDP). False where torch is built without ``torch.distributed``."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in parameters)
