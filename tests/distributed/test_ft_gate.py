"""The pieces of fault tolerance that need no torchft process: the pure sample plan, the
committed cursor, the commit-gated step inside a real fit (a gate that aborts chosen
attempts), and the strategy's guards."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from loopbus import Plugin, Strategy, Trainer, on
from loopbus.data._sampler import CommittedCursor, CommittedCursorLoader, Seat, plan_step
from loopbus.distributed import FaultTolerantStrategy
from loopbus.distributed._resolve import resolve_strategy
from loopbus.events import PutRecord, ReplicaLost, StepAborted, TrainBatchStarted
from loopbus.state._runstate import RunState
from tests.helpers import TinyModule, make_loader


def test_a_plan_cuts_the_next_samples_into_one_slice_per_group() -> None:
    order = list(range(100, 120))
    plans = [plan_step(order, 4, 3, Seat(rank, 2)) for rank in (0, 1)]
    assert [p.indices for p in plans if p] == [(104, 105, 106), (107, 108, 109)]
    assert all(p is not None and p.consumed == 6 for p in plans)
    # The epoch's last step shares what is left evenly; past the end there is no plan.
    tail = [plan_step(order, 15, 3, Seat(rank, 2)) for rank in (0, 1)]
    assert [p.indices for p in tail if p] == [(115, 116, 117), (118, 119)]
    assert plan_step(order, 20, 3, Seat(0, 2)) is None
    with pytest.raises(ValueError, match="not among 2 participants"):
        plan_step(order, 0, 3, Seat(2, 2))
    # A replica group of two processes: each reads its own batch of the group's slice.
    seats = [Seat(rank, 2, at, 2) for rank in (0, 1) for at in (0, 1)]
    cut = [plan_step(order, 4, 3, seat) for seat in seats]
    assert [p.indices for p in cut if p] == [
        tuple(range(104 + 3 * k, 107 + 3 * k)) for k in range(4)
    ]
    assert all(p is not None and p.consumed == 12 for p in cut)
    last = [plan_step(order, 14, 3, seat) for seat in seats]  # 6 left: 2 each, then 1, 1
    assert [p.indices for p in last if p] == [(114, 115), (116, 117), (118,), (119,)]
    with pytest.raises(ValueError, match="not among the group's 2"):
        plan_step(order, 0, 3, Seat(0, 2, 2, 2))


def test_the_cursor_moves_only_on_commit_and_any_quorum_covers_the_epoch_once() -> None:
    cursor = CommittedCursor(50, shuffle=True, seed=3)
    seen: list[int] = []
    participants = [2, 2, 1, 3, 1, 2, 2, 3, 3, 3, 3, 3, 3]
    for step, n in enumerate(participants):
        plans = [cursor.plan(4, Seat(rank, n)) for rank in range(n)]
        if plans[0] is None:
            break
        if step % 3 == 1:  # aborted: nothing moves, the same samples are planned again
            assert cursor.plan(4, Seat(0, n)) == plans[0]
            continue
        seen.extend(i for p in plans if p for i in p.indices)
        cursor.commit(plans[0])  # type: ignore[arg-type]
    generator = torch.Generator().manual_seed(3)
    assert seen == torch.randperm(50, generator=generator).tolist()
    saved = cursor.state_dict()
    other = CommittedCursor(50, shuffle=True, seed=3)
    other.load_state_dict(saved)
    assert other.state_dict() == saved
    with pytest.raises(ValueError, match="seed 3 there but 4 here"):
        CommittedCursor(50, shuffle=True, seed=4).load_state_dict(saved)


class _FlakyGate:
    """Aborts the attempts numbered in ``aborts`` (from 1), as a lost replica would."""

    participants = 1

    def __init__(self, loader: CommittedCursorLoader, aborts: set[int]) -> None:
        self.loader, self.aborts, self.attempts = loader, aborts, 0

    def commit(self) -> bool:
        self.attempts += 1
        committed = self.attempts not in self.aborts
        self.loader.settle(committed)
        return committed

    def news(self) -> list[tuple[Any, dict[str, Any]]]:
        return [(ReplicaLost, {"lost": 1, "participants": 1})] if self.attempts == 1 else []

    def retry(self) -> Any:
        return self.loader.next_batch()


class _Flaky(Strategy):
    def __init__(self, aborts: set[int]) -> None:
        self.aborts = aborts

    def prepare_train_data(self, data: Any) -> Any:
        cursor = CommittedCursor(len(data.dataset), shuffle=False)
        self.loader = CommittedCursorLoader(data, cursor, lambda: (0, 1))
        return self.loader

    def step_gate(
        self, module: Any, optimizers: Any, schedulers: Any, state: RunState
    ) -> _FlakyGate:
        self.gate = _FlakyGate(self.loader, self.aborts)
        return self.gate


class _Seen(Plugin):
    def __init__(self) -> None:
        self.records = 0
        self.batches = 0
        self.events: list[Any] = []

    @on(PutRecord)
    def _record(self, record: PutRecord) -> None:
        self.records += 1

    @on(TrainBatchStarted)
    def _batch(self, event: TrainBatchStarted) -> None:
        self.batches += 1

    @on(StepAborted)
    @on(ReplicaLost)
    def _event(self, event: Any) -> None:
        self.events.append(event)


async def test_an_aborted_step_leaves_no_trace() -> None:
    runs = []
    flaky = _Flaky({2, 3, 7})
    for strategy in (None, flaky):
        torch.manual_seed(0)
        module, seen = TinyModule(), _Seen()
        trainer = Trainer(max_epochs=2, plugins=[seen], strategy=strategy or "single")
        await trainer.fit(module, make_loader(n=64, batch_size=16))
        runs.append((module.state_dict(), trainer, seen))
    (plain, plain_trainer, plain_seen), (gated, trainer, seen) = runs
    assert flaky.gate.attempts == 8 + 3
    # The same weights as a run where nothing was aborted: the aborted attempts' gradients
    # and optimizer steps are gone, and their batches were trained again.
    assert all(torch.equal(plain[k], gated[k]) for k in plain)
    # Counters, batches and records count committed steps only.
    assert trainer.global_step == plain_trainer.global_step == 8
    assert seen.batches == plain_seen.batches == 8
    assert seen.records == plain_seen.records == 8
    aborted = [e for e in seen.events if isinstance(e, StepAborted)]
    assert [(e.step, e.dropped_records) for e in aborted] == [(1, 1), (1, 1), (4, 1)]
    assert [e.lost for e in seen.events if isinstance(e, ReplicaLost)] == [1]


def test_min_replicas_defaults_to_a_majority_and_lowering_it_warns() -> None:
    assert FaultTolerantStrategy(lighthouse="http://x:1", replica_groups=4).min_replicas == 3
    with pytest.warns(UserWarning, match="below a majority of the 4 replica groups"):
        strategy = FaultTolerantStrategy(lighthouse="http://x:1", replica_groups=4, min_replicas=2)
    assert strategy.min_replicas == 2
    with pytest.raises(Exception, match="min_replicas must be between 1 and replica_groups=4"):
        FaultTolerantStrategy(replica_groups=4, min_replicas=5)


def test_a_group_of_several_processes_shards_with_fsdp(monkeypatch: Any) -> None:
    """One process per group without a launcher; FSDP2 inside the group (HSDP) when
    torchrun starts several; the group's world is the strategy's."""
    from loopbus.distributed import FSDPStrategy
    from loopbus.distributed._strategy import SingleProcess

    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    alone = FaultTolerantStrategy(lighthouse="http://x:1")
    assert isinstance(alone.group, SingleProcess)
    assert (alone.world_size, alone.global_rank, alone.sharded_state) == (1, 0, False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert isinstance(FaultTolerantStrategy(lighthouse="http://x:1").group, FSDPStrategy)
    mine = FSDPStrategy(reshard_after_forward=False)
    assert FaultTolerantStrategy(group_strategy=mine).group is mine
    with pytest.raises(Exception, match="takes 'fsdp' or an FSDPStrategy"):
        FaultTolerantStrategy(group_strategy="ddp")  # type: ignore[arg-type]
    pytest.importorskip("torchft")  # (set-up asks for it first)
    single = FaultTolerantStrategy(lighthouse="http://x:1", group_strategy="single")
    with pytest.raises(Exception, match="runs replica groups of one process, but WORLD_SIZE=2"):
        single.setup_environment(torch.device("cpu"))


def test_a_rejoining_group_resumes_from_its_newest_checkpoint_unless_told(
    monkeypatch: Any,
) -> None:
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert FaultTolerantStrategy(lighthouse="http://x:1").resume_path() is None
    assert FaultTolerantStrategy(lighthouse="http://x:1", rejoining=True).resume_path() == "last"
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # as torchrun restarts a worker
    assert FaultTolerantStrategy(lighthouse="http://x:1").resume_path() == "last"


def test_ft_is_a_strategy_name_configured_from_the_environment(monkeypatch: Any) -> None:
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "http://lighthouse:29510")
    monkeypatch.setenv("REPLICA_GROUP_ID", "3")
    monkeypatch.setenv("NUM_REPLICA_GROUPS", "5")
    strategy = resolve_strategy("ft", 60.0, 1.0)
    assert isinstance(strategy, FaultTolerantStrategy)
    assert (strategy.lighthouse, strategy.replica_group) == ("http://lighthouse:29510", "3")
    assert (strategy.replica_groups, strategy.min_replicas) == (5, 3)


def test_the_training_data_must_be_a_loader_read_in_this_process() -> None:
    strategy = FaultTolerantStrategy(lighthouse="http://x:1")
    with pytest.raises(Exception, match="num_workers=0"):
        strategy.prepare_train_data(
            torch.utils.data.DataLoader(range(8), batch_size=2, num_workers=1)
        )
    with pytest.raises(Exception, match="must be a torch DataLoader"):
        strategy.prepare_train_data([1, 2, 3])


class _FakeManager:
    def __init__(self, step: int, batches: int) -> None:
        self.state = {"step": step, "batches_committed": batches}

    def current_step(self) -> int:
        return self.state["step"]

    def batches_committed(self) -> int:
        return self.state["batches_committed"]

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.state = dict(state)


def test_a_checkpoint_holds_the_committed_cursor_and_the_managers_count() -> None:
    from loopbus.distributed._ft import _Commits

    managers: list[_FakeManager] = []  # the strategy's manager, once started
    commits = _Commits(lambda: managers[0] if managers else None)
    sampler = CommittedCursor(10, shuffle=False)
    data = DataLoader(range(10), batch_size=2, collate_fn=list)
    loader = CommittedCursorLoader(data, sampler, lambda: (0, 1), commits=commits)
    assert next(iter(loader)) == [0, 1]
    assert loader.state_dict()["cursor"]["cursor"] == 0  # in flight: not yet committed
    loader.settle(True)
    managers.append(_FakeManager(7, 13))
    saved = loader.state_dict()
    assert saved["cursor"]["cursor"] == 2
    assert saved["commits"] == {"step": 7, "batches_committed": 13}

    # Resumed: the cursor at once; the manager's count at its first quorum, where the
    # run's step (loaded from the same checkpoint) puts a fresh manager ahead.
    resumed = _Commits(lambda: None)
    other = CommittedCursorLoader(
        data, CommittedCursor(10, shuffle=False), lambda: (0, 1), commits=resumed
    )
    other.load_state_dict(saved)
    assert other.sampler.cursor == 2
    manager = _FakeManager(0, 0)
    resumed.resume(manager, 7)
    assert manager.state == {"step": 7, "batches_committed": 13}
    resumed.resume(manager, 7)  # later quorums: nothing to apply
    assert manager.state == {"step": 7, "batches_committed": 13}
