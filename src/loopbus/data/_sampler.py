"""The distributed sampler loopbus shards a training loader with, and its checkpoint part:
the position in an epoch is kept as the number of samples the ranks consumed together,
so a run resumes mid-epoch at the same or at another world size.

The order is torch's ``DistributedSampler``'s: a permutation of the whole dataset drawn
from ``seed + epoch``, rank ``r`` of ``W`` taking every ``W``-th index from ``r``. After
``c`` batches of ``B`` samples on every rank the ranks consumed exactly the first
``W * c * B`` indices of that permutation, whatever ``W`` is. A resumed epoch skips that
prefix and splits the rest over the ranks it now has (``W'``): no sample is trained
twice in the epoch and none is left out. At the same world size this is the same split
as the uninterrupted run's, index for index (padding included).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DistributedSampler

__all__ = ["ElasticDistributedSampler", "SamplerPart"]


class ElasticDistributedSampler(DistributedSampler[int]):
    """``DistributedSampler`` that can start an epoch after a prefix of its permutation.

    Without :meth:`resume` it is ``DistributedSampler`` itself. ``resume(epoch, consumed,
    batches_done)`` makes the next iteration of ``epoch`` skip the first ``consumed``
    indices of the epoch's permutation and split the rest over ``num_replicas`` ranks:
    padded (``drop_last=False``: with indices from the permutation's start, as
    ``DistributedSampler`` pads) or cut (``drop_last=True``) to a multiple of the ranks.
    ``batches_done`` is the number of batches the resumed epoch counts as done already,
    so that :meth:`consumed` keeps counting from there."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: tuple[int, int, int] | None = None
        #: Where the current iteration started in the permutation, and the batches the
        #: epoch had done by then.
        self._offset = 0
        self._base = 0

    def resume(self, epoch: int, consumed: int, batches_done: int) -> None:
        self._pending = (int(epoch), int(consumed), int(batches_done))

    def _resumes_now(self) -> tuple[int, int, int] | None:
        pending = self._pending
        return pending if pending is not None and pending[0] == self.epoch else None

    def _order(self) -> list[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            return torch.randperm(n, generator=generator).tolist()
        return list(range(n))

    def _rest(self, order: list[int], start: int) -> list[int]:
        rest = order[start:]
        ranks = self.num_replicas
        if self.drop_last:
            return rest[: len(rest) - len(rest) % ranks]
        pad = (-len(rest)) % ranks
        if pad and order:
            rest += (order * math.ceil(pad / len(order)))[:pad]
        return rest

    def __iter__(self) -> Iterator[int]:
        pending = self._resumes_now()
        self._pending = None
        if pending is None:
            self._offset = self._base = 0
            return super().__iter__()
        _, self._offset, self._base = pending
        rest = self._rest(self._order(), self._offset)
        return iter(rest[self.rank :: self.num_replicas])

    def __len__(self) -> int:
        pending = self._resumes_now()
        if pending is None:
            return self.num_samples
        n = len(self.dataset)  # type: ignore[arg-type]
        left = max(n - pending[1], 0)
        ranks = self.num_replicas
        return left // ranks if self.drop_last else math.ceil(left / ranks)

    def consumed(self, batches_done: int, batch_size: int) -> int:
        """The samples the ranks consumed in the current epoch together, when each has
        done ``batches_done`` batches of ``batch_size`` in it (as the epoch counts)."""
        done = self._offset + self.num_replicas * batch_size * max(batches_done - self._base, 0)
        return min(done, len(self.dataset))  # type: ignore[arg-type]


class SamplerPart:
    """The checkpoint part of a training loader that loopbus sharded with an
    :class:`ElasticDistributedSampler`: the epoch and the samples consumed in it (all
    ranks together). Loading positions the sampler, so the resumed epoch skips no
    batches by iterating; the loops read that from the plan (``sampler_positioned``)."""

    #: Checkpoints of runs whose loader was sharded otherwise lack it.
    optional = True

    def __init__(
        self,
        sampler: ElasticDistributedSampler,
        batch_size: int,
        batches_done: Callable[[], int],
    ) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.batches_done = batches_done

    def state_dict(self) -> dict[str, Any]:
        sampler = self.sampler
        return {
            "epoch": sampler.epoch,
            "consumed": sampler.consumed(self.batches_done(), self.batch_size),
            "world_size": sampler.num_replicas,
            "dataset_size": len(sampler.dataset),  # type: ignore[arg-type]
            "shuffle": sampler.shuffle,
            "seed": sampler.seed,
            "drop_last": sampler.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.resume(int(state["epoch"]), int(state["consumed"]), self.batches_done())

    def explain_mismatch(self, saved: Any) -> list[Any]:
        from loopbus.state._stateful import Problem

        if not isinstance(saved, Mapping) or not isinstance(saved.get("consumed"), int):
            return [Problem("mismatched", "the checkpoint's entry is not a sampler position")]
        mine = self.state_dict()
        changed = [
            f"{key} {saved.get(key)!r} in the checkpoint but {mine[key]!r} now"
            for key in ("dataset_size", "shuffle", "seed", "drop_last")
            if saved.get(key) != mine[key]
        ]
        if changed:
            return [
                Problem(
                    "mismatched",
                    "the training data is not the one the checkpoint's position counts in "
                    f"({'; '.join(changed)})",
                )
            ]
        return []
