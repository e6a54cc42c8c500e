"""A process's part of state that may be sharded: what a fault-tolerant replica group
sends a peer behind it, and loads from one (``_ft.py``). Under FSDP a parameter, its
gradient and its optimizer state are DTensors whose local shard is this process's; a
peer process of the same group rank in another replica group holds the same shards, so
the local tensors travel and are laid out again as the receiver's own parameters.

Imports torch.distributed.tensor only when called.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["local_part", "optimizer_part", "optimizer_whole"]


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of ``tensor`` this process holds: a DTensor's local shard (a view of its
    storage: writing it writes the DTensor), any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def optimizer_part(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state dict with its DTensors as this process's shards, and which
    entries they were (``"sharded"``), so a peer of the same group rank rebuilds them."""
    from torch.distributed.tensor import DTensor

    saved = optimizer.state_dict()
    state: dict[Any, dict[str, Any]] = {}
    sharded: list[tuple[Any, str]] = []
    for index, entries in saved["state"].items():
        state[index] = {}
        for key, value in entries.items():
            if isinstance(value, DTensor):
                sharded.append((index, key))
                value = value.to_local()
            state[index][key] = value
    return {"state": state, "param_groups": saved["param_groups"], "sharded": sharded}


def optimizer_whole(optimizer: torch.optim.Optimizer, part: dict[str, Any]) -> dict[str, Any]:
    """The state dict ``optimizer`` loads from a peer's :func:`optimizer_part`: each
    sharded entry a DTensor laid out as its parameter (optimizer state mirrors it)."""
    from torch.distributed.tensor import DTensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {index: dict(entries) for index, entries in part["state"].items()}
    for index, key in part["sharded"]:
        param = params[index]
        state[index][key] = DTensor.from_local(
            state[index][key],
            param.device_mesh,
            param.placements,
            shape=param.shape,
            stride=param.stride(),
            run_check=False,
        )
    return {"state": state, "param_groups": part["param_groups"]}
