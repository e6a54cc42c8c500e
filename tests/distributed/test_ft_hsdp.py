"""Fault-tolerant data parallelism with replica groups of two FSDP2 processes (HSDP),
each group launched by torchrun: a process of one group SIGKILLed before, during and
after the cross-group all-reduce, torchrun restarting the group each time; and the
whole job (every worker) SIGKILLed and relaunched from its sharded checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.distributed import ft_script
from tests.distributed.ft_helpers import (
    committed_plans,
    epoch_order,
    launch_hsdp_group,
    newest_step,
    read_lines,
    replay_committed,
    saved_steps,
    slice_of,
)

pytest.importorskip("torchft")

pytestmark = [pytest.mark.external, pytest.mark.slow, pytest.mark.timeout(150)]


@pytest.mark.timeout(400)
def test_a_lost_hsdp_group_rejoins_and_every_sample_trains_once(
    tmp_path: Path, lighthouse: str
) -> None:
    """Two replica groups of two FSDP processes; one process of group 1 SIGKILLed before,
    during and after the cross-group all-reduce (rank 1, rank 0, rank 1), torchrun
    restarting the group each time."""
    survivor = launch_hsdp_group(tmp_path, lighthouse, 0)
    started = tmp_path / "ledger-0.0.jsonl"
    deadline = time.monotonic() + 120
    while not (started.exists() and started.read_text().strip()):  # it trains first
        assert survivor.poll() is None, (tmp_path / "stderr-0.txt").read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    victim = launch_hsdp_group(
        tmp_path, lighthouse, 1, kills=("12:before:1", "12:during:0", "12:after:1")
    )
    assert victim.wait(timeout=300) == 0, (tmp_path / "stderr-1.txt").read_text()[-3000:]
    assert survivor.wait(timeout=120) == 0, (tmp_path / "stderr-0.txt").read_text()[-3000:]

    kills = read_lines(tmp_path / "kills.jsonl")
    assert [k["phase"] for k in kills] == ["before", "during", "after"]
    ledgers = {
        (g, r): read_lines(tmp_path / f"ledger-{g}.{r}.jsonl") for g in (0, 1) for r in (0, 1)
    }
    summary = json.loads((tmp_path / "summary-0.0.json").read_text())

    # The survivor's processes never stopped and agree on every committed step's plan.
    plans = ledgers[0, 0]
    for r in (0, 1):
        assert len({e["pid"] for e in ledgers[0, r]}) == 1
        assert [e["step"] for e in ledgers[0, r]] == list(range(1, summary["step"] + 1))
        assert [(e["cursor"], e["participants"]) for e in ledgers[0, r]] == [
            (e["cursor"], e["participants"]) for e in plans
        ]

    # Contiguous commits covering the epoch's order once; each process read its slice.
    batch, order, cursor = ft_script.BATCH, epoch_order(), 0
    for entry in plans:
        assert entry["cursor"] == cursor
        assert entry["consumed"] == min(entry["participants"] * 2 * batch, len(order) - cursor)
        cursor += entry["consumed"]
    assert cursor == ft_script.N_SAMPLES
    assert {e["participants"] for e in plans} == {1, 2}
    by_step = {e["step"]: e for e in plans}
    trained: Counter[int] = Counter()
    for (_, r), ledger in ledgers.items():
        for entry in ledger:
            plan = by_step[entry["step"]]
            assert (entry["cursor"], entry["participants"]) == (
                plan["cursor"],
                plan["participants"],
            )
            assert (entry["group_rank"], entry["group_size"]) == (r, 2)
            ids = slice_of(order, plan["cursor"], plan["participants"], entry["rank"], 2, r)
            assert entry["ids"] == ids
            trained.update(ids)
    assert max(trained.values()) == 1

    # Samples nobody logged: group 1's slices of a step that committed with it counted
    # while one of its processes died (certainly the killed rank's, after the all-reduce).
    def lost(kill: dict[str, Any], ranks: tuple[int, ...] = (0, 1)) -> set[int]:
        step = by_step[kill["step"] + 1]
        if step["participants"] != 2:
            return set()
        rank = 1 - step["rank"]
        return {i for r in ranks for i in slice_of(order, step["cursor"], 2, rank, 2, r)}

    missing = set(range(ft_script.N_SAMPLES)) - set(trained)
    assert lost(kills[2], (1,)) <= missing <= lost(kills[1]) | lost(kills[2])
    assert lost(kills[2], (1,))

    # Every restart healed from the live group, each process from its peer of the same
    # group rank; the survivor saw the losses and aborted steps without their records.
    for r in (0, 1):
        healed = [
            e for e in read_lines(tmp_path / f"events-1.{r}.jsonl") if e["type"] == "ReplicaHealed"
        ]
        assert len({e["pid"] for e in healed}) >= 3
        assert all(e["sources"] == ["0"] and e["healed_step"] > 0 for e in healed)
        events = read_lines(tmp_path / f"events-0.{r}.jsonl")
        assert [e for e in events if e["type"] == "StepAborted"]
        assert sum(e["type"] == "ReplicaLost" for e in events) >= 3
        assert (
            json.loads((tmp_path / f"summary-0.{r}.json").read_text())["loss_records"]
            == (summary["step"])
        )
    for ledger in ledgers.values():
        for entry in ledger:
            assert entry["lr"] == pytest.approx(ft_script.lr_at(entry["step"]), rel=1e-12)

    # Both groups end with the same weights, those of a one-process replay of the
    # committed steps (bit for bit here; atol 1e-6 allows another platform's rounding).
    final = [torch.load(tmp_path / f"final-{g}.pt", weights_only=True) for g in (0, 1)]
    replay = replay_committed(plans, order, group=2)
    for name, value in final[0].items():
        assert torch.equal(value, final[1][name]), name
        torch.testing.assert_close(value, replay[name], atol=1e-6, rtol=1e-5)


def _pids(out: Path, group: int) -> set[int]:
    """The worker processes of an HSDP group, as they logged themselves."""
    return {e["pid"] for r in (0, 1) for e in read_lines(out / f"ledger-{group}.{r}.jsonl")}


@pytest.mark.timeout(400)
def test_a_whole_hsdp_job_killed_resumes_from_its_newest_sharded_checkpoints(
    tmp_path: Path, lighthouse: str
) -> None:
    """Two groups of two FSDP2 processes saving sharded checkpoints, every worker
    SIGKILLed, then both groups relaunched with ``ckpt_path="last"`` and
    ``min_replicas=2``."""
    first, second, ckpt = tmp_path / "first", tmp_path / "second", tmp_path / "ckpt"
    first.mkdir()
    second.mkdir()
    samples = 800  # 50 steps with both groups (16 samples a step)
    saving = ("--ckpt", str(ckpt), "--every", "10", "--samples", str(samples))
    groups = [
        launch_hsdp_group(first, lighthouse, g, extra=(*saving, "--sleep-s", "0.05"))
        for g in (0, 1)
    ]
    deadline = time.monotonic() + 200
    while max(newest_step(ckpt / f"group-{g}") for g in (0, 1)) < 20:
        for g, group in enumerate(groups):
            assert group.poll() is None, (first / f"stderr-{g}.txt").read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # Every worker SIGKILLed, by pid (torchrun starts them in sessions of their own).
    for pid in _pids(first, 0) | _pids(first, 1):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    assert all(group.wait(timeout=60) != 0 for group in groups)
    saved = max(newest_step(ckpt / f"group-{g}") for g in (0, 1))
    # One writer: each checkpoint was saved by the group of replica rank 0 alone.
    assert not saved_steps(ckpt / "group-0") & saved_steps(ckpt / "group-1")

    resuming = (*saving, "--resume", "--min-replicas", "2", "--sleep-s", "0")
    groups = [launch_hsdp_group(second, lighthouse, g, extra=resuming) for g in (0, 1)]
    for g, group in enumerate(groups):
        assert group.wait(timeout=240) == 0, (second / f"stderr-{g}.txt").read_text()[-3000:]
    end = json.loads((second / "summary-0.0.json").read_text())["step"]

    # Steps 1..saved from the killed run, saved+1..end from the relaunch: contiguous
    # commits of four processes' slices covering the epoch's order exactly once.
    tags = tuple(f"{g}.{r}" for g in (0, 1) for r in (0, 1))
    before = committed_plans(first, range(1, saved + 1), tags)
    after = committed_plans(second, range(saved + 1, end + 1), tags)
    assert sorted(before) == list(range(1, saved + 1))
    assert sorted(after) == list(range(saved + 1, end + 1))
    for tag in tags:
        assert min(e["step"] for e in read_lines(second / f"ledger-{tag}.jsonl")) == saved + 1
    plans = [{**before, **after}[s] for s in range(1, end + 1)]
    batch, order, cursor = ft_script.BATCH, epoch_order(samples), 0
    for plan in plans:
        assert plan["cursor"] == cursor
        assert plan["consumed"] == min(plan["participants"] * 2 * batch, samples - cursor)
        cursor += plan["consumed"]
    assert cursor == samples

    # Each process read its slice; none twice; the only samples missing are the slices
    # of step `saved` that a process was killed before logging.
    trained: Counter[int] = Counter()
    logged: set[tuple[int, int, int]] = set()
    for out, steps in ((first, before), (second, after)):
        for tag in tags:
            at = int(tag.split(".")[1])
            for entry in read_lines(out / f"ledger-{tag}.jsonl"):
                if entry["step"] not in steps:
                    continue
                plan = steps[entry["step"]]
                ids = slice_of(order, plan["cursor"], plan["participants"], entry["rank"], 2, at)
                assert entry["ids"] == ids
                assert entry["lr"] == pytest.approx(ft_script.lr_at(entry["step"]), rel=1e-12)
                trained.update(ids)
                logged.add((entry["step"], entry["rank"], at))
    assert max(trained.values()) == 1
    last = before[saved]
    unlogged = {
        i
        for rank in range(last["participants"])
        for at in (0, 1)
        if (saved, rank, at) not in logged
        for i in slice_of(order, last["cursor"], last["participants"], rank, 2, at)
    }
    assert set(range(samples)) - set(trained) == unlogged

    # Both groups end with the same weights, those of the replay of the committed steps.
    final = [torch.load(second / f"final-{g}.pt", weights_only=True) for g in (0, 1)]
    replay = replay_committed(plans, order, group=2)
    for name, value in final[0].items():
        assert torch.equal(value, final[1][name]), name
        torch.testing.assert_close(value, replay[name], atol=1e-6, rtol=1e-5)
