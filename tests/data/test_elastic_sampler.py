"""``ElasticDistributedSampler``: DistributedSampler's order, and an epoch resumed after
a consumed prefix at the same or another world size (no process group needed: the
ranks are simulated by building one sampler per rank)."""

from __future__ import annotations

from itertools import chain

import pytest
import torch
from torch.utils.data import DistributedSampler, TensorDataset

from loopbus import ElasticDistributedSampler
from loopbus.data._sampler import SamplerPart


def _data(n: int) -> TensorDataset:
    return TensorDataset(torch.arange(n))


def _ranks(cls: type, n: int, world: int, epoch: int = 3, **options: bool) -> list[list[int]]:
    out = []
    for rank in range(world):
        sampler = cls(_data(n), num_replicas=world, rank=rank, seed=7, **options)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


@pytest.mark.parametrize("n", [64, 70])
@pytest.mark.parametrize("drop_last", [False, True])
def test_without_a_resume_it_is_distributed_sampler(n: int, drop_last: bool) -> None:
    for shuffle in (True, False):
        options = {"drop_last": drop_last, "shuffle": shuffle}
        assert _ranks(ElasticDistributedSampler, n, 4, **options) == _ranks(
            DistributedSampler, n, 4, **options
        )


def _resumed(
    n: int, world: int, consumed: int, epoch: int = 3, drop_last: bool = False
) -> list[list[int]]:
    out = []
    for rank in range(world):
        sampler = ElasticDistributedSampler(
            _data(n), num_replicas=world, rank=rank, seed=7, drop_last=drop_last
        )
        sampler.set_epoch(epoch)
        sampler.resume(epoch, consumed, batches_done=5)
        length = len(sampler)
        indices = list(sampler)
        assert len(indices) == length
        out.append(indices)
    return out


@pytest.mark.parametrize("n", [64, 70])
def test_at_the_same_world_size_the_rest_of_each_rank_is_unchanged(n: int) -> None:
    # 2 ranks, 3 batches of 4 each: the first 24 indices of the permutation.
    full = _ranks(DistributedSampler, n, 2)
    assert _resumed(n, 2, consumed=24) == [ranks[12:] for ranks in full]


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4), (2, 3)])
def test_at_another_world_size_every_sample_comes_once(before: int, after: int) -> None:
    n = 96
    order = torch.randperm(n, generator=torch.Generator().manual_seed(7 + 3)).tolist()
    consumed = before * 4 * 3  # 3 batches of 4 on every rank
    first = order[:consumed]
    rest = list(chain.from_iterable(_resumed(n, after, consumed)))
    assert sorted(rest) == sorted(order[consumed:])
    assert sorted(first + rest) == list(range(n))


def test_the_resume_applies_to_its_epoch_only() -> None:
    sampler = ElasticDistributedSampler(_data(32), num_replicas=2, rank=0, seed=1)
    sampler.set_epoch(4)
    sampler.resume(3, 16, batches_done=2)  # the checkpoint's epoch had ended
    assert len(list(sampler)) == 16
    sampler.resume(4, 16, batches_done=2)
    assert len(list(sampler)) == 8
    assert len(list(sampler)) == 16  # the next pass starts afresh


def test_the_part_counts_samples_consumed_by_all_ranks() -> None:
    sampler = ElasticDistributedSampler(_data(96), num_replicas=4, rank=1, seed=0)
    sampler.set_epoch(0)
    done = [0]
    part = SamplerPart(sampler, batch_size=4, batches_done=lambda: done[0])
    iter(sampler)
    done[0] = 3
    assert part.state_dict()["consumed"] == 4 * 4 * 3
    # Resumed on 2 ranks after those 48 samples, with 3 batches counted as done: two
    # more batches of 4 on each of the 2 ranks make 48 + 16.
    other = ElasticDistributedSampler(_data(96), num_replicas=2, rank=0, seed=0)
    other.set_epoch(0)
    resumed = SamplerPart(other, batch_size=4, batches_done=lambda: done[0])
    resumed.load_state_dict(part.state_dict())
    iter(other)
    done[0] = 5
    assert resumed.state_dict()["consumed"] == 48 + 16
    assert resumed.explain_mismatch(part.state_dict()) == []
    changed = dict(part.state_dict(), seed=9)
    (problem,) = resumed.explain_mismatch(changed)
    assert "seed 9 in the checkpoint but 0 now" in problem.message
