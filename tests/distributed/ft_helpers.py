"""What the fault-tolerance tests share: launching replica groups of ``ft_script.py``
(one process, or two FSDP2 processes under torchrun), reading what they logged, the
epoch's order and a process's slice of a step, and a one-process replay of the committed
steps. The groups a test starts are registered here (:func:`spawned`); the
``stop_started_groups`` fixture in this package's ``conftest.py`` stops them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from loopbus import latest_checkpoint
from tests.distributed import ft_script
from tests.helpers import ROOT
from tests.torchrun import env, torchrun

SCRIPT = ROOT / "tests" / "distributed" / "ft_script.py"

#: The groups a test started, stopped when it ends (a failed test leaves none running).
STARTED: list[subprocess.Popen[str]] = []


def spawned(proc: subprocess.Popen[str]) -> subprocess.Popen[str]:
    STARTED.append(proc)
    return proc


def launch_group(
    out: Path,
    lighthouse: str,
    group: int,
    *,
    kill: str | None = None,
    restarted: bool = False,
    extra: tuple[str, ...] = (),
) -> subprocess.Popen[str]:
    env = dict(os.environ, TORCHFT_LIGHTHOUSE=lighthouse, RUST_LOG="warn")
    env.pop("TORCHELASTIC_RESTART_COUNT", None)
    if restarted:  # as torchrun --max-restarts tells a worker it restarted
        env["TORCHELASTIC_RESTART_COUNT"] = "1"
    args = [
        sys.executable,
        str(SCRIPT),
        "--group",
        str(group),
        "--out",
        str(out),
        "--sleep-s",
        "0.02",
        "--alone-sleep-s",
        "0.08",
    ]
    if kill:
        args += ["--kill", kill]
    args += extra  # later flags win
    with open(out / f"stderr-{group}.txt", "a") as log:
        return spawned(
            subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        )


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def epoch_order(samples: int = ft_script.N_SAMPLES, epoch: int = 0) -> list[int]:
    """The order of an epoch's samples (as ``DistributedSampler`` draws it: seed + epoch)."""
    generator = torch.Generator().manual_seed(ft_script.SEED + epoch)
    return torch.randperm(samples, generator=generator).tolist()


def slice_of(
    order: list[int], cursor: int, participants: int, rank: int, group: int = 1, at: int = 0
) -> list[int]:
    """A process's samples of a step: the next ``participants * group`` batches after
    the cursor, one per process of the step in order (group by group, each group's
    ``group`` processes by rank); this one is group rank ``at`` of replica rank ``rank``.
    The epoch's last step shares what is left evenly."""
    workers, worker = participants * group, rank * group + at
    size = min(len(order) - cursor, workers * ft_script.BATCH)
    per, extra = divmod(size, workers)
    start = cursor + worker * per + min(worker, extra)
    return order[start : start + per + (worker < extra)]


def replay_committed(
    ledger: list[dict[str, Any]], order: list[int] | dict[int, list[int]], group: int = 1
) -> dict[str, torch.Tensor]:
    """The committed steps again in one process (``order``: the epoch's order, or each
    epoch's by number, for steps logged with their ``epoch``): each step's global batch
    cut into the processes' slices, their gradients averaged in the order the all-reduces do (FSDP's
    within each group, then the manager's across the groups), one optimizer and one
    scheduler step. The order matters: a few hundred SGD steps with momentum turn the
    last-bit difference of another order into 1e-4."""
    x, y, _ = ft_script.dataset().tensors
    net = ft_script.network()
    optimizer = ft_script.optimizer_of(net.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: ft_script.DECAY**s)
    params = list(net.parameters())
    for entry in ledger:
        cursor, n = entry["cursor"], entry["participants"]
        ordered = order[entry["epoch"]] if isinstance(order, dict) else order
        total = None
        for rank in range(n):
            within = None
            for at in range(group):
                ids = slice_of(ordered, cursor, n, rank, group, at)
                net.zero_grad(set_to_none=True)
                ft_script.loss_of(net, x[ids], y[ids]).backward()
                flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
                within = flat if within is None else within + flat
            assert within is not None
            within = within / group if group > 1 else within
            total = within if total is None else total + within
        assert total is not None
        total /= n
        offset = 0
        for p in params:
            p.grad = total[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        optimizer.step()
        schedule.step()
    return net.state_dict()


def newest_step(folder: Path) -> int:
    """The step of the checkpoint a restarted group resumes from (``ckpt_path="last"``'s:
    the one ``last.json`` names, which a kill between a save's marker and its pointer
    leaves at the save before) in a group's folder (0: none)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a save in flight is passed over, with a warning
        found = latest_checkpoint(folder) if folder.is_dir() else None
    return 0 if found is None else int(found.name.split("step=")[1].split(".")[0])


def saved_steps(folder: Path) -> set[int]:
    """The steps of the checkpoints in a group's folder (files or sharded directories,
    published under their names once written)."""
    names = [p.name for p in folder.glob("*step=*.ckpt")] if folder.is_dir() else []
    return {int(name.split("step=")[1].split(".")[0]) for name in names}


def committed_plans(
    out: Path, steps: range, tags: tuple[str, ...] = ("0", "1")
) -> dict[int, dict[str, Any]]:
    """Each committed step's plan (cursor, participants) in ``steps``, as the processes
    logged it in ``out`` (``ledger-<tag>.jsonl``; they agree)."""
    plans: dict[int, dict[str, Any]] = {}
    for tag in tags:
        for entry in read_lines(out / f"ledger-{tag}.jsonl"):
            if entry["step"] in steps:
                plan = {k: entry[k] for k in ("step", "cursor", "participants", "consumed")}
                assert plans.setdefault(entry["step"], plan) == plan
    return plans


def launch_hsdp_group(
    out: Path,
    lighthouse: str,
    group: int,
    *,
    kills: tuple[str, ...] = (),
    extra: tuple[str, ...] = (),
) -> subprocess.Popen[str]:
    """A replica group of two processes sharding the module with FSDP2 (HSDP), launched
    by torchrun; with ``kills``, torchrun restarts it after each (``AFTER:PHASE:RANK``),
    as a job's launcher replaces a lost group. ``extra``: more flags (later ones win)."""
    variables = dict(env(), TORCHFT_LIGHTHOUSE=lighthouse, RUST_LOG="warn")
    variables.pop("TORCHELASTIC_RESTART_COUNT", None)
    launcher = torchrun(
        "--standalone",
        "--nproc_per_node=2",
        f"--max-restarts={len(kills)}",
        "--monitor-interval=0.2",
    )
    args = [*launcher, str(SCRIPT), "--group", str(group), "--out", str(out)]
    args += ["--sleep-s", "0.02", "--alone-sleep-s", "0.4"]
    if kills:
        args += ["--kill-per-restart", ",".join(kills)]
    args += extra
    with open(out / f"stderr-{group}.txt", "a") as log:
        return spawned(
            subprocess.Popen(args, env=variables, stdout=log, stderr=subprocess.STDOUT, text=True)
        )
