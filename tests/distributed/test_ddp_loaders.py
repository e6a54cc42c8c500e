"""How the DDP strategy shards a training loader it is given (no process group needed:
the rank and world size are set here): torchdata's StatefulDataLoader stays stateful and
keeps shuffling, a plain loader keeps its options, a loader that shards already is left
alone, and a loader with its own batch_sampler is refused with a way out."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    TensorDataset,
)

from loopbus import MisconfigurationError
from loopbus.distributed._ddp import DDPStrategy

pytest.importorskip("torchdata")
from torchdata.stateful_dataloader import StatefulDataLoader

DATA = TensorDataset(torch.arange(64).float())


def strategy(monkeypatch: pytest.MonkeyPatch, rank: int, world: int = 2) -> DDPStrategy:
    monkeypatch.setattr(DDPStrategy, "world_size", property(lambda self: world))
    monkeypatch.setattr(DDPStrategy, "global_rank", property(lambda self: rank))
    return DDPStrategy()


def stateful(**options: Any) -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "'set_vital' is deprecated")
        return StatefulDataLoader(DATA, **options)


def values(loader: Any) -> list[int]:
    return [int(v) for (batch,) in loader for v in batch]


@pytest.mark.parametrize("shuffle", [True, False])
def test_a_stateful_loader_stays_stateful_and_is_sharded(
    monkeypatch: pytest.MonkeyPatch, shuffle: bool
) -> None:
    seen = []
    for rank in (0, 1):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "'set_vital' is deprecated")
            loader = strategy(monkeypatch, rank).prepare_train_data(
                stateful(batch_size=8, shuffle=shuffle, snapshot_every_n_steps=3)
            )
        assert type(loader) is StatefulDataLoader
        assert loader.snapshot_every_n_steps == 3
        assert isinstance(loader.sampler, DistributedSampler)
        assert loader.sampler.shuffle is shuffle
        assert (loader.sampler.num_replicas, loader.sampler.rank) == (2, rank)
        seen.append(values(loader))
    assert sorted(seen[0] + seen[1]) == list(range(64))  # the ranks split the data
    assert (seen[0] != sorted(seen[0])) is shuffle


def test_the_stateful_loader_resumes_where_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    ddp = strategy(monkeypatch, 1)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "'set_vital' is deprecated")
        loader = ddp.prepare_train_data(stateful(batch_size=4, shuffle=True))
        loader.sampler.set_epoch(3)
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = loader.state_dict()
        rest = [int(v) for (batch,) in it for v in batch]
        again = ddp.prepare_train_data(stateful(batch_size=4, shuffle=True))
        again.sampler.set_epoch(3)
        again.load_state_dict(state)
        assert values(again) == rest


def test_a_plain_loader_keeps_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    source = DataLoader(DATA, batch_size=5, shuffle=True, drop_last=True)
    loader = strategy(monkeypatch, 0).prepare_train_data(source)
    assert type(loader) is DataLoader
    assert isinstance(loader.sampler, DistributedSampler)
    assert loader.sampler.shuffle
    assert (loader.batch_size, loader.drop_last) == (5, True)
    assert all(len(batch) == 5 for (batch,) in loader)


def test_a_sharded_loader_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    source = DataLoader(DATA, batch_size=4, sampler=DistributedSampler(DATA, 2, 0))
    assert strategy(monkeypatch, 0).prepare_train_data(source) is source


def test_a_loader_with_its_own_batch_sampler_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    source = DataLoader(DATA, batch_sampler=BatchSampler(RandomSampler(DATA), 4, False))
    with pytest.raises(
        MisconfigurationError, match=r"own batch_sampler \(BatchSampler\).*DistributedSampler"
    ):
        strategy(monkeypatch, 0).prepare_train_data(source)
