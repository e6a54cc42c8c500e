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
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import torch
from torch.utils.data import DataLoader, DistributedSampler

if TYPE_CHECKING:
    from loopbus.state._stateful import Stateful

__all__ = [
    "CommittedCursor",
    "CommittedCursorLoader",
    "ElasticDistributedSampler",
    "SamplerPart",
    "StepPlan",
    "plan_step",
]


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


class StepPlan(msgspec.Struct, frozen=True, kw_only=True):
    """The samples of one fault-tolerant step, planned after its quorum: the epoch and
    the committed global ``cursor`` it starts from, the ``participants`` (replica groups)
    and this group's ``replica_rank`` among them, this process's ``group_rank`` among the
    ``group_size`` processes of its group, and the dataset ``indices`` this process
    reads. The step consumes ``consumed`` samples of the epoch's order if it commits."""

    epoch: int
    cursor: int
    participants: int
    replica_rank: int
    consumed: int
    indices: tuple[int, ...]
    group_rank: int = 0
    group_size: int = 1


class Seat(NamedTuple):
    """Where a process sits in one fault-tolerant step: its replica group's
    ``replica_rank`` among the step's ``participants`` (from the step's quorum), and its
    ``group_rank`` among the ``group_size`` processes of its group."""

    replica_rank: int
    participants: int
    group_rank: int = 0
    group_size: int = 1


def plan_step(order: list[int], cursor: int, batch_size: int, seat: Seat) -> StepPlan | None:
    """A pure plan: the next ``participants * group_size * batch_size`` samples of
    ``order`` after the committed ``cursor``, cut into contiguous slices of
    ``batch_size``, one per process of the step in order (replica group by replica group,
    each group's processes by group rank); this process's slice is that of
    ``replica_rank * group_size + group_rank``. The epoch's last step shares what is left
    evenly (the first processes one more); a process left with nothing reads the order's
    first sample (padding, as ``DistributedSampler`` pads), which the step counts as
    consumed by nobody. None: the epoch is over."""
    replica_rank, participants, group_rank, group_size = seat
    left = len(order) - cursor
    if left <= 0:
        return None
    if not 0 <= replica_rank < participants:
        raise ValueError(f"replica rank {replica_rank} is not among {participants} participants")
    if not 0 <= group_rank < group_size:
        raise ValueError(f"group rank {group_rank} is not among the group's {group_size}")
    workers, worker = participants * group_size, replica_rank * group_size + group_rank
    consumed = min(left, workers * batch_size)
    per, extra = divmod(consumed, workers)
    start = cursor + worker * per + min(worker, extra)
    size = per + (1 if worker < extra else 0)
    indices = tuple(order[start : start + size]) if size else (order[0],)
    return StepPlan(
        epoch=-1,
        cursor=cursor,
        participants=participants,
        replica_rank=replica_rank,
        consumed=consumed,
        indices=indices,
        group_rank=group_rank,
        group_size=group_size,
    )


class CommittedCursor:
    """Where an epoch of fault-tolerant training stands: the epoch's order (a
    permutation of the dataset drawn from ``seed + epoch``, as ``DistributedSampler``
    draws it, or the dataset's order) and the committed global sample ``cursor`` in it.
    The cursor moves only when a step commits (:meth:`commit`), so an aborted step's
    samples are planned again. It is the sampler of a :class:`CommittedCursorLoader`
    (the loops call :meth:`set_epoch`), and Stateful: the cursor travels in a healed
    replica group's state and in checkpoints."""

    def __init__(self, size: int, *, shuffle: bool, seed: int = 0) -> None:
        self.size = int(size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.cursor = 0
        self._order: list[int] | None = None

    def set_epoch(self, epoch: int) -> None:
        """A new epoch starts from its first sample (the loops call this; a healed or
        loaded state sets the epoch and cursor itself)."""
        if int(epoch) != self.epoch:
            self.epoch = int(epoch)
            self.cursor = 0
            self._order = None

    def order(self) -> list[int]:
        if self._order is None:
            if self.shuffle:
                generator = torch.Generator()
                generator.manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(self.size, generator=generator).tolist()
            else:
                self._order = list(range(self.size))
        return self._order

    def plan(self, batch_size: int, seat: Seat) -> StepPlan | None:
        plan = plan_step(self.order(), self.cursor, batch_size, seat)
        return None if plan is None else msgspec.structs.replace(plan, epoch=self.epoch)

    def commit(self, plan: StepPlan) -> None:
        """``plan``'s step committed: its samples are consumed."""
        if plan.epoch != self.epoch or plan.cursor != self.cursor:
            raise RuntimeError(
                f"a step planned at epoch {plan.epoch}, cursor {plan.cursor} committed, but "
                f"the cursor is at epoch {self.epoch}, cursor {self.cursor}"
            )
        self.cursor += plan.consumed

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "dataset_size": self.size,
            "shuffle": self.shuffle,
            "seed": self.seed,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        mine = self.state_dict()
        changed = [
            f"{key} {state.get(key)!r} there but {mine[key]!r} here"
            for key in ("dataset_size", "shuffle", "seed")
            if state.get(key) != mine[key]
        ]
        if changed:
            raise ValueError(
                "the sample cursor comes from another training set or order "
                f"({'; '.join(changed)}); every replica group must read the same data."
            )
        epoch, cursor = state["epoch"], state["cursor"]
        if not (isinstance(epoch, int) and isinstance(cursor, int) and 0 <= cursor <= self.size):
            raise ValueError(f"not a sample cursor: epoch {epoch!r}, cursor {cursor!r}")
        self.epoch, self.cursor, self._order = epoch, cursor, None


class CommittedCursorLoader:
    """The training data of a fault-tolerant run: each batch is planned when the step
    asks for it, after the step's quorum (``begin_step()`` returns this group's
    ``(replica_rank, participants)``), from the committed cursor, and read from
    ``data``'s dataset with its batch size and collate function in this process; a group
    of several processes (``group``: this one's ``(rank, size)`` in it) cuts its slice
    between them. :attr:`plan` is the plan of the step in flight; :meth:`next_batch`
    plans (and reads) it again after an abort.

    It is Stateful, so a checkpoint holds it as the training loader's position: the
    committed cursor and, under ``"commits"``, the state of ``commits`` (the strategy's
    count of committed steps)."""

    def __init__(
        self,
        data: DataLoader[Any],
        sampler: CommittedCursor,
        begin_step: Callable[[], tuple[int, int]],
        commits: Stateful | None = None,
        group: tuple[int, int] = (0, 1),
    ) -> None:
        if data.batch_size is None:
            raise ValueError("a committed-cursor loader needs a DataLoader with a batch_size")
        self.dataset = data.dataset
        self.batch_size = int(data.batch_size)
        self.collate_fn = data.collate_fn
        self.group_rank, self.group_size = (int(g) for g in group)
        self.sampler = sampler
        self.begin_step = begin_step
        self.commits = commits
        #: The plan of the step in flight (None between steps).
        self.plan: StepPlan | None = None

    def __len__(self) -> int:
        """Batches of ``batch_size`` left in the epoch (with one replica group)."""
        per_step = self.batch_size * self.group_size
        return math.ceil((self.sampler.size - self.sampler.cursor) / per_step)

    def next_batch(self) -> Any:
        """The batch of the next step (None: the epoch is over): a quorum, then the plan."""
        if self.plan is not None:
            raise RuntimeError(
                "a fault-tolerant step's batch was asked for before the step in flight "
                "committed or aborted: its samples depend on that outcome. Run with "
                "prefetch=0 and accumulate_grad_batches=1."
            )
        if self.sampler.cursor >= self.sampler.size:
            return None
        rank, participants = self.begin_step()
        seat = Seat(rank, participants, self.group_rank, self.group_size)
        plan = self.sampler.plan(self.batch_size, seat)
        if plan is None:  # a healed state put the cursor at the epoch's end
            return None
        self.plan = plan
        return self.collate_fn([self.dataset[i] for i in plan.indices])

    def settle(self, committed: bool) -> StepPlan:
        """The step in flight committed (its samples are consumed) or aborted (they will
        be planned again); the plan it ran."""
        plan = self.plan
        if plan is None:
            raise RuntimeError("no fault-tolerant step is in flight")
        if committed:
            self.sampler.commit(plan)
        self.plan = None
        return plan

    def __iter__(self) -> Iterator[Any]:
        while (batch := self.next_batch()) is not None:
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The committed cursor and the commit state (see the class docstring). A step
        in flight has not committed: its samples are not counted, so a resumed run
        plans them again."""
        state: dict[str, Any] = {"cursor": self.sampler.state_dict()}
        if self.commits is not None:
            state["commits"] = self.commits.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the cursor now, the commit state through
        ``commits``."""
        self.sampler.load_state_dict(state["cursor"])
        self.plan = None
        if self.commits is not None and state.get("commits") is not None:
            self.commits.load_state_dict(state["commits"])
