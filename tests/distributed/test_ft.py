"""Fault-tolerant data parallelism (``strategy="ft"``, torchft), with real processes:
a Lighthouse started by ``loopbus lighthouse`` and two replica groups of one process
each running ``ft_script.py``; one group SIGKILLed (by pid, by itself) before, during
and after the cross-group all-reduce and restarted each time; a restarted group with no
live peer; and the whole job (both groups) SIGKILLed and relaunched from its newest
checkpoints.
"""

from __future__ import annotations

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
    launch_group,
    newest_step,
    read_lines,
    replay_committed,
    saved_steps,
    slice_of,
)

pytest.importorskip("torchft")

pytestmark = [pytest.mark.external, pytest.mark.slow, pytest.mark.timeout(150)]


def test_a_lost_group_rejoins_and_every_sample_trains_once(tmp_path: Path, lighthouse: str) -> None:
    survivor = launch_group(tmp_path, lighthouse, 0)
    started = tmp_path / "ledger-0.jsonl"
    deadline = time.monotonic() + 90
    while not (started.exists() and started.read_text().strip()):  # it trains first
        assert survivor.poll() is None
        assert time.monotonic() < deadline
        time.sleep(0.1)
    victim = launch_group(tmp_path, lighthouse, 1, kill="12:before")
    for kill in ("12:during", "12:after", None):
        assert victim.wait(timeout=90) == -9, (tmp_path / "stderr-1.txt").read_text()[-3000:]
        victim = launch_group(tmp_path, lighthouse, 1, kill=kill, restarted=True)
    assert victim.wait(timeout=90) == 0, (tmp_path / "stderr-1.txt").read_text()[-3000:]
    assert survivor.wait(timeout=90) == 0, (tmp_path / "stderr-0.txt").read_text()[-3000:]

    kills = read_lines(tmp_path / "kills.jsonl")
    assert [k["phase"] for k in kills] == ["before", "during", "after"]
    ledger = read_lines(tmp_path / "ledger-0.jsonl")
    rejoined = read_lines(tmp_path / "ledger-1.jsonl")
    summary = json.loads((tmp_path / "summary-0.json").read_text())

    # The survivor never stopped: one process, every step from the first to the last.
    assert {e["pid"] for e in ledger} == {summary["pid"]}
    assert [e["step"] for e in ledger] == list(range(1, summary["step"] + 1))

    # Contiguous commits from the committed cursor: the steps' global batches cover the
    # epoch's order exactly once.
    batch, order = ft_script.BATCH, epoch_order()
    cursor = 0
    for entry in ledger:
        assert entry["cursor"] == cursor
        assert entry["consumed"] == min(entry["participants"] * batch, len(order) - cursor)
        cursor += entry["consumed"]
    assert cursor == ft_script.N_SAMPLES
    assert any(e["participants"] == 1 for e in ledger)
    assert any(e["participants"] == 2 for e in ledger)

    # Each group read its slice of each committed step it logged; no sample was read in
    # two committed steps. Samples nobody logged belong to the killed group's slice of a
    # step that committed with it counted: certainly the one it died in after the
    # all-reduce ("after"); the one it died in during it, if its part arrived.
    by_step = {e["step"]: e for e in ledger}
    trained: Counter[int] = Counter()
    for entry in ledger + rejoined:
        plan = by_step[entry["step"]]
        assert (entry["cursor"], entry["participants"]) == (plan["cursor"], plan["participants"])
        assert entry["ids"] == slice_of(
            order, entry["cursor"], entry["participants"], entry["rank"]
        )
        trained.update(entry["ids"])
    assert max(trained.values()) == 1
    missing = set(range(ft_script.N_SAMPLES)) - set(trained)

    def lost_slice(kill: dict[str, Any]) -> set[int]:
        step = by_step[kill["step"] + 1]  # the step in flight when it died
        if step["participants"] != 2:
            return set()
        return set(slice_of(order, step["cursor"], 2, 1 - step["rank"]))

    assert lost_slice(kills[2]) <= missing <= lost_slice(kills[2]) | lost_slice(kills[1])
    assert lost_slice(kills[2])

    # The restarted group healed from the live one each time.
    events = read_lines(tmp_path / "events-1.jsonl")
    healed = [e for e in events if e["type"] == "ReplicaHealed"]
    assert len({e["pid"] for e in healed}) >= 3
    assert all(e["sources"] == ["0"] and e["healed_step"] > 0 for e in healed)
    survivor_events = read_lines(tmp_path / "events-0.jsonl")
    aborted = [e for e in survivor_events if e["type"] == "StepAborted"]
    assert aborted
    assert all(e["dropped_records"] == 1 for e in aborted)
    assert sum(e["type"] == "ReplicaLost" for e in survivor_events) >= 3
    # Aborted steps left no record: one "loss" record per committed step.
    assert summary["loss_records"] == summary["step"]

    # The LR schedule stepped once per committed step.
    for entry in ledger + rejoined:
        assert entry["lr"] == pytest.approx(ft_script.lr_at(entry["step"]), rel=1e-12)
    assert summary["lr"] == json.loads((tmp_path / "summary-1.json").read_text())["lr"]

    # Both groups end with the same weights, those of a one-process replay of the
    # committed steps (to float32 rounding: atol 1e-6).
    final = [torch.load(tmp_path / f"final-{g}.pt", weights_only=True) for g in (0, 1)]
    replay = replay_committed(ledger, order)
    for name, value in final[0].items():
        assert torch.equal(value, final[1][name]), name
        torch.testing.assert_close(value, replay[name], atol=1e-6, rtol=1e-5)


def test_a_restarted_group_without_a_live_peer_refuses_to_start_afresh(
    tmp_path: Path, lighthouse: str
) -> None:
    # Restarted and given no ckpt_path, it looks for its newest checkpoint (as
    # ckpt_path="last"): none saved (with one it resumes, see the whole-job test below).
    extra = ("--ckpt", str(tmp_path / "ckpt"))
    group = launch_group(tmp_path, lighthouse, 1, restarted=True, extra=extra)
    assert group.wait(timeout=90) != 0
    said = (tmp_path / "stderr-1.txt").read_text()
    assert "rejoins the run" in said, said[-3000:]
    assert "found no live replica group" in said
    assert "Checkpoint plugin's folder" in said
    assert not (tmp_path / "ledger-1.jsonl").read_text().strip()


def test_a_whole_job_killed_resumes_from_its_newest_checkpoint(
    tmp_path: Path, lighthouse: str
) -> None:
    first, second, ckpt = tmp_path / "first", tmp_path / "second", tmp_path / "ckpt"
    first.mkdir()
    second.mkdir()
    samples = 800  # 100 steps with both groups
    saving = ("--ckpt", str(ckpt), "--every", "10", "--sleep-s", "0.05", "--samples", str(samples))
    groups = [launch_group(first, lighthouse, g, extra=saving) for g in (0, 1)]
    deadline = time.monotonic() + 90
    # Both groups saved (step 20 or later) and trained on: kill -9 every group, by pid.
    while max(newest_step(ckpt / f"group-{g}") for g in (0, 1)) < 20:
        assert all(g.poll() is None for g in groups), (first / "stderr-0.txt").read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for group in groups:
        os.kill(group.pid, signal.SIGKILL)
    assert [g.wait(timeout=30) for g in groups] == [-9, -9]
    saved = max(newest_step(ckpt / f"group-{g}") for g in (0, 1))
    # One writer: each checkpoint was saved by the group of replica rank 0 alone.
    assert not saved_steps(ckpt / "group-0") & saved_steps(ckpt / "group-1")

    # The relaunch: every group restarted (as torchrun tells a restarted worker), none
    # with a live peer, none given a ckpt_path; each loads its newest checkpoint by
    # itself, the one behind heals from the other, and a step commits only with both
    # (min_replicas=2).
    resuming = (*saving, "--min-replicas", "2", "--sleep-s", "0")
    groups = [launch_group(second, lighthouse, g, restarted=True, extra=resuming) for g in (0, 1)]
    for g, group in enumerate(groups):
        assert group.wait(timeout=90) == 0, (second / f"stderr-{g}.txt").read_text()[-3000:]
    summary = json.loads((second / "summary-0.json").read_text())
    end = summary["step"]

    # Steps 1..saved from the killed run, saved+1..end from the relaunch: contiguous
    # commits whose global batches cover the epoch's order exactly once.
    before, after = (
        committed_plans(first, range(1, saved + 1)),
        committed_plans(second, range(saved + 1, end + 1)),
    )
    assert sorted(before) == list(range(1, saved + 1))
    assert sorted(after) == list(range(saved + 1, end + 1))
    assert min(e["step"] for e in read_lines(second / "ledger-0.jsonl")) == saved + 1
    ledger = [{**before, **after}[s] for s in range(1, end + 1)]
    batch, order, cursor = ft_script.BATCH, epoch_order(samples), 0
    for entry in ledger:
        assert entry["cursor"] == cursor
        assert entry["consumed"] == min(entry["participants"] * batch, len(order) - cursor)
        cursor += entry["consumed"]
    assert cursor == samples

    # The samples the groups logged: each its step's slice, none twice; those missing
    # are the slices of the checkpoint's step a group was killed before logging.
    trained: Counter[int] = Counter()
    logged: set[tuple[int, int]] = set()
    for out, plans in ((first, before), (second, after)):
        for group in (0, 1):
            for entry in read_lines(out / f"ledger-{group}.jsonl"):
                if entry["step"] not in plans:
                    continue
                plan = plans[entry["step"]]
                ids = slice_of(order, plan["cursor"], plan["participants"], entry["rank"])
                assert entry["ids"] == ids
                assert entry["lr"] == pytest.approx(ft_script.lr_at(entry["step"]), rel=1e-12)
                trained.update(ids)
                logged.add((entry["step"], entry["rank"]))
    assert max(trained.values()) == 1
    last = before[saved]
    unlogged = {
        i
        for rank in range(last["participants"])
        if (saved, rank) not in logged
        for i in slice_of(order, last["cursor"], last["participants"], rank)
    }
    assert set(range(samples)) - set(trained) == unlogged

    # The LR schedule stepped once per committed step; both groups end with the weights
    # of a one-process replay of the committed steps (to float32 rounding: atol 1e-6).
    assert summary["lr"] == pytest.approx(ft_script.lr_at(end), rel=1e-12)
    final = [torch.load(second / f"final-{g}.pt", weights_only=True) for g in (0, 1)]
    replay = replay_committed(ledger, order)
    for name, value in final[0].items():
        assert torch.equal(value, final[1][name]), name
        torch.testing.assert_close(value, replay[name], atol=1e-6, rtol=1e-5)
