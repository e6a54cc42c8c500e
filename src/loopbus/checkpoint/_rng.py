"""The random number generators a run draws from: capture and restore their states as
plain values (for checkpoints), and the state a data loader's epoch order comes from."""

from __future__ import annotations

import array
import contextlib
import random
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch

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


class RngSnapshot:
    """The global generators' states as taken, in the forms that are cheap to take
    (Python's state tuple, NumPy's state tuple, torch's byte tensors), and converted to
    plain values (:func:`capture_rng`'s form) only when a checkpoint needs them: an
    epoch's start takes one and nearly always drops it unsaved. ``torch_only`` takes
    torch's generators alone (see :func:`order_depends_on_torch_only`)."""

    __slots__ = ("cuda", "numpy", "python", "torch")

    def __init__(self, torch_only: bool = False) -> None:
        self.python = None if torch_only else random.getstate()
        np = None if torch_only else sys.modules.get("numpy")
        self.numpy = None if np is None else np.random.get_state(legacy=True)
        self.torch = torch.get_rng_state()
        self.cuda = (
            list(torch.cuda.get_rng_state_all())
            if torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
            else None
        )

    def plain(self) -> dict[str, Any]:
        """The states as :func:`capture_rng` returns them."""
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
        if self.python is not None:
            random.setstate(self.python)
        if self.numpy is not None:
            sys.modules["numpy"].random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            _restore_cuda(self.cuda)


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
        _restore_cuda(cuda_states)


def _restore_cuda(states: list[torch.Tensor]) -> None:
    if torch.cuda.is_available():
        for index in range(min(len(states), torch.cuda.device_count())):
            torch.cuda.set_rng_state(states[index], index)


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
