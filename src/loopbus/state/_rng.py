"""Snapshots of the random number generators a run draws from: Python's, NumPy's (when
NumPy is in use), torch's (CPU, and CUDA when initialised or when the run is on a CUDA
device) and, if asked, a data loader's own. One snapshot serves every caller that puts
generators back: a checkpoint (in plain values, :meth:`RngSnapshot.plain`), an epoch's
order, and tools that run trial steps and leave the run as it was (the learning-rate
and batch-size finders)."""

from __future__ import annotations

import array
import random
import sys
from typing import Any

import torch

__all__ = ["RngSnapshot", "loader_generators", "restore_cuda"]


def loader_generators(data: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a data loader draws its order from (its own, its
    sampler's, its batch sampler's sampler's), without duplicates."""
    found: list[torch.Generator] = []
    sampler = getattr(data, "sampler", None)
    batch_sampler = getattr(data, "batch_sampler", None)
    for owner in (data, sampler, getattr(batch_sampler, "sampler", None)):
        generator = getattr(owner, "generator", None)
        if (
            generator is not None  # before isinstance, which is slow for torch.Generator
            and isinstance(generator, torch.Generator)
            and all(generator is not g for g in found)
        ):
            found.append(generator)
    return found


class RngSnapshot:
    """The generators' states as taken, in the forms that are cheap to take (Python's
    state tuple, NumPy's state tuple, torch's byte tensors), converted to plain values
    only when a checkpoint needs them (:meth:`plain`): an epoch's start takes one and
    nearly always drops it unsaved; :meth:`restore` sets them back.

    ``torch_only`` takes torch's generators alone (an order that depends on nothing
    else); ``device``, the run's device: on a CUDA device CUDA's generators are taken
    even before CUDA is initialised; ``data``: a loader whose own generators are taken
    too (:func:`loader_generators`)."""

    __slots__ = ("cuda", "generators", "numpy", "python", "torch")

    def __init__(
        self, torch_only: bool = False, *, device: torch.device | None = None, data: Any = None
    ) -> None:
        self.python = None if torch_only else random.getstate()
        np = None if torch_only else sys.modules.get("numpy")
        self.numpy = None if np is None else np.random.get_state(legacy=True)
        self.torch = torch.get_rng_state()
        on_cuda = device is not None and device.type == "cuda"
        initialised = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
        self.cuda = (
            list(torch.cuda.get_rng_state_all())
            if torch.cuda.is_available() and (on_cuda or initialised)
            else None
        )
        owned = [] if data is None else loader_generators(data)
        self.generators = [(g, g.get_state()) for g in owned]

    def plain(self) -> dict[str, Any]:
        """The global generators' states as plain values (tensors and Python numbers), as
        a checkpoint stores them."""
        state: dict[str, Any] = {}
        if self.python is not None:
            version, internal, gauss_next = self.python
            # The Mersenne Twister's 625 words as one tensor (not 625 Python ints).
            words = array.array("q", internal)
            state["python"] = {
                "version": version,
                "state": torch.frombuffer(words, dtype=torch.int64).clone(),
                "gauss_next": gauss_next,
            }
        state["torch"] = self.torch
        if self.numpy is not None:
            kind, key, pos, has_gauss, gauss = self.numpy
            state["numpy"] = {
                "kind": str(kind),
                "key": torch.from_numpy(key.astype("int64")),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "gauss": float(gauss),
            }
        if self.cuda is not None:
            state["cuda"] = self.cuda
        return state

    def restore(self) -> None:
        """Set the generators it holds back to the states it took."""
        for generator, state in self.generators:
            generator.set_state(state)
        if self.python is not None:
            random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            restore_cuda(self.cuda)


def restore_cuda(states: list[torch.Tensor]) -> None:
    """Set each CUDA device's generator to its state in ``states`` (those of devices this
    process does not have are left out)."""
    if torch.cuda.is_available():
        for index in range(min(len(states), torch.cuda.device_count())):
            torch.cuda.set_rng_state(states[index], index)
