"""Moving nested batches to a device (the structure every batch source relies on), and
the trainer's choice of batch source. The CUDA side-stream copies themselves are tested
in test_cuda_data_gpu.py."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple
from typing import Any

import pytest
import torch

from loopbus import MisconfigurationError, Trainer
from loopbus.data._device import move_batch

META = torch.device("meta")
Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass(frozen=True)
class Frozen:
    image: torch.Tensor
    label: int


@dataclasses.dataclass
class WithDerived:
    values: torch.Tensor
    scale: float = 1.0
    total: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.total = self.values.sum()


class HasTo:
    """An object that moves itself, as graph or tokenizer batches do."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t
        self.calls: list[tuple[Any, bool]] = []

    def to(self, device: Any, non_blocking: bool = False) -> HasTo:
        moved = HasTo(self.t.to(device))
        moved.calls = [*self.calls, (device, non_blocking)]
        return moved


class HasPlainTo:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t

    def to(self, device: Any) -> HasPlainTo:
        return HasPlainTo(self.t.to(device))


def test_every_nesting_arrives_intact_on_the_device() -> None:
    batch = {
        "pair": Pair(torch.ones(2), (torch.zeros(3), [torch.ones(1), "text", 7])),
        "frozen": Frozen(torch.ones(2, 2), 3),
        "derived": WithDerived(torch.arange(4.0)),
        "ordered": OrderedDict(a=torch.ones(1)),
        "self_moving": HasTo(torch.ones(5)),
        "plain_to": HasPlainTo(torch.ones(6)),
        "none": None,
    }
    made: list[torch.Tensor] = []
    out = move_batch(batch, META, made)
    assert type(out) is dict
    assert out.keys() == batch.keys()
    assert type(out["pair"]) is Pair
    assert out["pair"].x.device == META
    assert type(out["pair"].y) is tuple
    assert out["pair"].y[0].device == META
    assert type(out["pair"].y[1]) is list
    assert out["pair"].y[1][0].device == META
    assert out["pair"].y[1][1:] == ["text", 7]
    assert type(out["frozen"]) is Frozen
    assert out["frozen"].image.device == META
    assert out["frozen"].label == 3
    assert type(out["derived"]) is WithDerived
    assert out["derived"].values.device == META
    assert type(out["ordered"]) is OrderedDict
    assert out["ordered"]["a"].device == META
    assert out["self_moving"].t.device == META
    assert out["self_moving"].calls == [(META, True)]  # asked for a non-blocking move
    assert out["plain_to"].t.device == META
    assert out["none"] is None
    # Every tensor the move made is collected (for record_stream), nested ones too:
    # pair.x, pair.y[0], pair.y[1][0], frozen.image, derived.values, ordered.a.
    assert len(made) == 6
    assert all(t.device == META for t in made)


def test_unreachable_tensors_are_reported_when_they_must_be_collected() -> None:
    from loopbus.data._device import _Opaque

    with pytest.raises(_Opaque):
        move_batch([torch.ones(1), HasTo(torch.ones(1))], META, [], opaque_ok=False)


def test_device_prefetch_is_validated() -> None:
    with pytest.raises(MisconfigurationError, match="device_prefetch"):
        Trainer(device_prefetch=-1, plugins=[])
    with pytest.raises(MisconfigurationError, match="device_prefetch"):
        Trainer(device_prefetch="1", plugins=[])  # type: ignore[arg-type]


async def test_on_cpu_no_device_source_is_chosen() -> None:
    from loopbus import Module

    class Tiny(Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Linear(1, 1)
            self.batches: list[Any] = []

        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            self.batches.append(batch)
            return self.w(batch).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Tiny()
    data = [torch.ones(1, 1)]
    await Trainer(max_steps=1, plugins=[], device="cpu", prefetch=1).fit(module, data)
    # Neither moved, nor pinned, nor copied: the very batch the loader made.
    assert module.batches[0] is data[0]
