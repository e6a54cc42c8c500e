"""The random number generators a run draws from, as a checkpoint holds them: their
states as plain values (captured through :class:`~loopbus.state.RngSnapshot`, which
lives in ``state/``), and the state a data loader's epoch order comes from."""

from __future__ import annotations

import contextlib
import random
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from ..state._rng import RngSnapshot as RngSnapshot
from ..state._rng import loader_generators as loader_generators
from ..state._rng import restore_cuda

__all__ = [
    "RngSnapshot",
    "capture_epoch_rng",
    "capture_rng",
    "epoch_rng_state",
    "loader_generator_states",
    "loader_generators",
    "order_depends_on_torch_only",
    "restore_epoch_rng",
    "restore_loader_generators",
    "restore_rng",
    "rng_preserved",
]


def capture_rng() -> dict[str, Any]:
    """The states of Python's, NumPy's (when NumPy is in use) and torch's (CPU, and CUDA
    when initialised) global random number generators, as plain values."""
    return RngSnapshot().plain()


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
    if cuda_states:
        restore_cuda(cuda_states)


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


_TORCH_DATA = "torch.utils.data"


def order_depends_on_torch_only(data: Any) -> bool:
    """Whether the order ``iter(data)`` yields batches in can depend on no generator but
    torch's: a list or tuple (no generator at all), or torch's own ``DataLoader`` over a
    map-style dataset with torch's own samplers (they draw their seeds from torch's
    global generator or the loader's). A custom sampler, an iterable dataset or any
    other iterable may draw from Python's or NumPy's generators too."""
    cls = type(data)
    if cls is list or cls is tuple:
        return True
    if not cls.__module__.startswith(_TORCH_DATA) or not hasattr(data, "sampler"):
        return False
    if isinstance(data.dataset, torch.utils.data.IterableDataset):
        return False
    return all(
        part is None or type(part).__module__.startswith(_TORCH_DATA)
        for part in (data.sampler, getattr(data, "batch_sampler", None))
    )


def capture_epoch_rng(data: Any) -> dict[str, Any]:
    """What a plain loader's order depends on, taken right before ``iter(data)``: the
    global generators (torch's alone where nothing else can matter) as an
    :class:`RngSnapshot`, and the loader's own generators. :func:`epoch_rng_state` gives
    its plain form for a checkpoint."""
    return {
        "rng": RngSnapshot(torch_only=order_depends_on_torch_only(data)),
        "generators": loader_generator_states(data),
    }


def epoch_rng_state(snapshot: dict[str, Any] | None) -> dict[str, Any] | None:
    """:func:`capture_epoch_rng`'s snapshot (or one loaded from a checkpoint) in plain
    values, as a checkpoint stores it."""
    if snapshot is None or not isinstance(snapshot["rng"], RngSnapshot):
        return snapshot
    return {**snapshot, "rng": snapshot["rng"].plain()}


def restore_epoch_rng(snapshot: dict[str, Any], data: Any) -> None:
    rng = snapshot["rng"]
    if isinstance(rng, RngSnapshot):
        rng.restore()
    else:
        restore_rng(rng)
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
    snapshot = RngSnapshot()
    try:
        yield
    finally:
        snapshot.restore()
