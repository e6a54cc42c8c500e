"""The random number generators a run draws from: capture and restore their states as
plain values (for checkpoints), and the state a data loader's epoch order comes from."""

from __future__ import annotations

import contextlib
import random
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "capture_epoch_rng",
    "capture_rng",
    "loader_generator_states",
    "loader_generators",
    "restore_epoch_rng",
    "restore_loader_generators",
    "restore_rng",
    "rng_preserved",
]


def capture_rng() -> dict[str, Any]:
    """The states of Python's, NumPy's (when NumPy is in use) and torch's (CPU, and CUDA
    when initialised) global random number generators, as plain values."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        # The Mersenne Twister's 625 words as one tensor (not 625 Python ints).
        "python": {
            "version": version,
            "state": torch.tensor(internal, dtype=torch.int64),
            "gauss_next": gauss_next,
        },
        "torch": torch.get_rng_state(),
    }
    np = sys.modules.get("numpy")
    if np is not None:
        kind, key, pos, has_gauss, gauss = np.random.get_state(legacy=True)
        state["numpy"] = {
            "kind": str(kind),
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set the global generators to a state from :func:`capture_rng`."""
    python = state.get("python")
    if python is not None:
        random.setstate(
            (int(python["version"]), tuple(python["state"].tolist()), python["gauss_next"])
        )
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    numpy_state = state.get("numpy")
    if numpy_state is not None:
        import numpy as np

        np.random.set_state(
            (
                numpy_state["kind"],
                numpy_state["key"].numpy().astype(np.uint32),
                int(numpy_state["pos"]),
                int(numpy_state["has_gauss"]),
                float(numpy_state["gauss"]),
            )
        )
    cuda_states = state.get("cuda")
    if cuda_states and torch.cuda.is_available():
        count = min(len(cuda_states), torch.cuda.device_count())
        for index in range(count):
            torch.cuda.set_rng_state(cuda_states[index], index)


def loader_generators(data: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a data loader draws its order from (its own, its
    sampler's, its batch sampler's sampler's), without duplicates."""
    found: list[torch.Generator] = []
    sampler = getattr(data, "sampler", None)
    batch_sampler = getattr(data, "batch_sampler", None)
    for owner in (data, sampler, getattr(batch_sampler, "sampler", None)):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and all(generator is not g for g in found):
            found.append(generator)
    return found


def set_sampler_epoch(data: Any, epoch: int) -> None:
    """Call ``set_epoch(epoch)`` on the sampler of ``data`` (or of its batch sampler) that
    has one, such as a ``DistributedSampler``: its order depends on the epoch."""
    for sampler in (
        getattr(data, "sampler", None),
        getattr(getattr(data, "batch_sampler", None), "sampler", None),
    ):
        set_epoch = getattr(sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
            return


def capture_epoch_rng(data: Any) -> dict[str, Any]:
    """What a plain loader's order depends on, taken right before ``iter(data)``."""
    return {
        "rng": capture_rng(),
        "generators": loader_generator_states(data),
    }


def restore_epoch_rng(snapshot: dict[str, Any], data: Any) -> None:
    restore_rng(snapshot["rng"])
    _set_generator_states(data, snapshot.get("generators", []), "the resumed epoch")


def loader_generator_states(data: Any) -> list[torch.Tensor]:
    """The current states of the generators a loader draws its order from."""
    return [g.get_state() for g in loader_generators(data)]


def restore_loader_generators(data: Any, states: list[torch.Tensor] | None) -> None:
    """Set a stateful loader's generators to :func:`loader_generator_states` as taken
    with its position; call after ``load_state_dict`` and building the restored iterator.

    Restoring the position alone does not: torchdata's ``StatefulDataLoader`` saves the
    generator's state from when the epoch's sampler iterator was made, and on restore
    sets it back and draws the permutation again. Without workers that iterator is made
    before the loader draws its base seed from the same generator, so the restored
    generator is that draw behind the interrupted run, and the next epoch is shuffled
    differently. ``None`` (a checkpoint without the states) leaves them as they are."""
    if states is not None:
        _set_generator_states(data, states, "the epochs after the resumed one")


def _set_generator_states(data: Any, saved: list[torch.Tensor], what: str) -> None:
    generators = loader_generators(data)
    if len(saved) != len(generators):
        warnings.warn(
            f"the data loader draws its order from {len(generators)} torch.Generator(s), but "
            f"the checkpoint recorded {len(saved)}: the shuffling order of {what} "
            "may differ from the interrupted run. Build the loader the same way as then.",
            UserWarning,
            stacklevel=4,
        )
        return
    for generator, state in zip(generators, saved, strict=True):
        generator.set_state(state)


@contextlib.contextmanager
def rng_preserved() -> Iterator[None]:
    """Run a block without letting it move the global generators."""
    state = capture_rng()
    try:
        yield
    finally:
        restore_rng(state)
