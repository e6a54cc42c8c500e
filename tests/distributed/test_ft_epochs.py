"""Fault-tolerant data parallelism across epochs: a replica group lost in the first
epoch rejoins while the survivor is two epochs further on, heals into the survivor's
epoch, and both finish the run together; in every epoch each sample is trained once.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.distributed import ft_script
from tests.distributed.ft_helpers import (
    epoch_order,
    launch_group,
    read_lines,
    replay_committed,
    slice_of,
)

pytest.importorskip("torchft")

pytestmark = [pytest.mark.external, pytest.mark.slow, pytest.mark.timeout(150)]

SAMPLES = 96  # 12 steps an epoch with both groups, 24 with one
EPOCHS = 8  # a slow restart still finds the survivor training (4 s an epoch alone)


def test_a_group_lost_in_one_epoch_heals_into_a_later_one(tmp_path: Path, lighthouse: str) -> None:
    run = ("--samples", str(SAMPLES), "--epochs", str(EPOCHS), "--alone-sleep-s", "0.15")
    survivor = launch_group(tmp_path, lighthouse, 0, extra=run)
    ledger_0 = tmp_path / "ledger-0.jsonl"

    def survivor_reached(epoch: int) -> bool:
        entries = read_lines(ledger_0) if ledger_0.exists() else []
        return any(e["epoch"] >= epoch for e in entries)

    deadline = time.monotonic() + 90
    while not survivor_reached(0):  # it trains first
        assert survivor.poll() is None, (tmp_path / "stderr-0.txt").read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # Group 1 joins, and dies three steps on, after the all-reduce: that step commits
    # with its slice counted (and never trained: the samples a kill there loses).
    victim = launch_group(tmp_path, lighthouse, 1, kill="3:after", extra=run)
    assert victim.wait(timeout=90) == -9, (tmp_path / "stderr-1.txt").read_text()[-3000:]
    while not survivor_reached(2):  # the survivor, alone, goes on into epoch 2
        assert survivor.poll() is None, (tmp_path / "stderr-0.txt").read_text()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # Restarted with no checkpoint: it heals from the survivor, two epochs ahead.
    victim = launch_group(tmp_path, lighthouse, 1, restarted=True, extra=run)
    assert victim.wait(timeout=90) == 0, (tmp_path / "stderr-1.txt").read_text()[-3000:]
    assert survivor.wait(timeout=90) == 0, (tmp_path / "stderr-0.txt").read_text()[-3000:]

    ledger = read_lines(ledger_0)
    joined = read_lines(tmp_path / "ledger-1.jsonl")
    kills = read_lines(tmp_path / "kills.jsonl")
    summaries = [json.loads((tmp_path / f"summary-{g}.json").read_text()) for g in (0, 1)]
    orders = {epoch: epoch_order(SAMPLES, epoch) for epoch in range(EPOCHS)}

    # The survivor never stopped, and its run epoch is the plan's.
    end = summaries[0]["step"]
    assert [e["step"] for e in ledger] == list(range(1, end + 1))
    assert {e["pid"] for e in ledger} == {summaries[0]["pid"]}
    assert all(e["run_epoch"] == e["epoch"] for e in ledger + joined)

    # Per epoch, contiguous commits from cursor 0 cover the epoch's order exactly once.
    by_epoch: dict[int, list[dict]] = {}
    for entry in ledger:
        by_epoch.setdefault(entry["epoch"], []).append(entry)
    assert sorted(by_epoch) == list(range(EPOCHS))
    for entries in by_epoch.values():
        cursor = 0
        for entry in entries:
            assert entry["cursor"] == cursor
            cursor += entry["consumed"]
        assert cursor == SAMPLES

    # The rejoined group's first step is in a later epoch than the one it died in, and it
    # then trained every committed step to the end, with the survivor's plans.
    by_step = {e["step"]: e for e in ledger}
    lost_step = by_step[kills[0]["step"] + 1]  # the step in flight when it died
    rejoined = [e for e in joined if e["pid"] != kills[0]["pid"]]
    assert rejoined[0]["epoch"] >= max(2, lost_step["epoch"] + 1)
    assert [e["step"] for e in rejoined] == list(range(rejoined[0]["step"], end + 1))
    healed = [e for e in read_lines(tmp_path / "events-1.jsonl") if e["type"] == "ReplicaHealed"]
    assert healed
    assert healed[-1]["sources"] == ["0"]
    assert healed[-1]["healed_step"] > 0

    # Each process read its slice of each committed step; within each epoch no sample
    # was trained twice, and the only ones never trained are the dead group's slice of
    # the step that committed with it counted.
    trained: dict[int, Counter[int]] = {epoch: Counter() for epoch in range(EPOCHS)}
    for entry in ledger + joined:
        plan = by_step[entry["step"]]
        assert (entry["epoch"], entry["cursor"], entry["participants"]) == (
            plan["epoch"],
            plan["cursor"],
            plan["participants"],
        )
        ids = slice_of(orders[plan["epoch"]], plan["cursor"], plan["participants"], entry["rank"])
        assert entry["ids"] == ids
        assert entry["lr"] == pytest.approx(ft_script.lr_at(entry["step"]), rel=1e-12)
        trained[plan["epoch"]].update(ids)
    assert lost_step["participants"] == 2
    order = orders[lost_step["epoch"]]
    lost = set(slice_of(order, lost_step["cursor"], 2, 1 - lost_step["rank"]))
    assert lost
    for epoch, counts in trained.items():
        assert max(counts.values()) == 1
        assert set(range(SAMPLES)) - set(counts) == (lost if epoch == lost_step["epoch"] else set())

    # Both groups end together (the same step and epoch: the healed group ran no epoch
    # twice), with the same LR and weights, those of a one-process replay.
    assert (summaries[1]["step"], summaries[1]["epoch"]) == (end, summaries[0]["epoch"])
    assert summaries[1]["lr"] == summaries[0]["lr"]
    assert summaries[0]["loss_records"] == end
    final = [torch.load(tmp_path / f"final-{g}.pt", weights_only=True) for g in (0, 1)]
    replay = replay_committed(ledger, orders)
    for name, value in final[0].items():
        assert torch.equal(value, final[1][name]), name
        torch.testing.assert_close(value, replay[name], atol=1e-6, rtol=1e-5)
