"""Kill tests: a training process is SIGKILLed, a new process resumes from ``last``, and
its final weights are bit-identical to an uninterrupted run's.

The training processes are forked from a server process that imported torch and the
scenario once (``multiprocessing``'s forkserver), so each starts in milliseconds; all
processes of a phase run side by side. The random kill steps come from
``LOOPBUS_KILL_SEED`` when set, else from the clock; the seed is in every failure
message, so a failure can be replayed.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from tests.ckpt_scenario import BATCH, EPOCHS, EVERY_N_STEPS, N_TRAIN, VAL_EVERY, run_scenario

STEPS = EPOCHS * (N_TRAIN // BATCH)
SEED = int(os.environ.get("LOOPBUS_KILL_SEED", time.time_ns() % 1_000_000))
_rng = random.Random(SEED)


@dataclass
class Case:
    name: str
    loader: str
    kill: str
    background: bool = False
    killed_rc: int | None = None
    resumed_rc: int | None = None
    dirpath: Path = field(default_factory=Path)


def _case_list() -> list[Case]:
    per_epoch = N_TRAIN // BATCH
    return [
        # Mid-epoch, somewhere in the run (not on a checkpoint step, so work is redone).
        Case("plain-random-step", "plain", f"step:{_rng.randrange(9, STEPS - 5)}"),
        # Right after the second validation (the checkpoint it triggers is never written).
        Case("plain-after-validation", "plain", "val:2"),
        # At an epoch boundary, right after the epoch's checkpoint.
        Case("plain-epoch-end", "plain", "epoch:0"),
        # Background saves; killed right after a save was handed to the writer thread.
        Case("plain-background", "plain", f"step:{7 * _rng.randrange(2, STEPS // 7)}", True),
        Case(
            "stateful-random-step", "stateful", f"step:{_rng.randrange(per_epoch + 1, STEPS - 5)}"
        ),
        # After the batch whose validation just ran and whose deferred save was written.
        Case("stateful-after-validation", "stateful", f"step:{2 * VAL_EVERY}"),
        # A loader with a generator of its own, killed in the first epoch: the resumed
        # run crosses the epoch boundaries, whose shuffling depends on that generator.
        Case(
            "stateful-generator-epoch-boundary",
            "stateful-generator",
            f"step:{_rng.randrange(EVERY_N_STEPS + 1, per_epoch - 1)}",
        ),
    ]


CASES = _case_list()


def _run_all(context: Any, jobs: list[dict[str, Any]]) -> list[int]:
    procs = [context.Process(target=run_scenario, kwargs=job) for job in jobs]
    for proc in procs:
        proc.start()
    codes = []
    for proc in procs:
        proc.join(timeout=240)
        codes.append(proc.exitcode)
    return codes


@pytest.fixture(scope="module")
def kill_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("kill")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tests.ckpt_scenario"])
    refs = {
        kind: base / f"ref-{kind}.pt" for kind in ("plain", "stateful", "stateful-generator")
    }
    jobs = [
        {"dirpath": str(base / f"ref-{kind}-ckpt"), "out": str(out), "loader": kind}
        for kind, out in refs.items()
    ]
    for case in CASES:
        case.dirpath = base / case.name
        jobs.append(
            {
                "dirpath": str(case.dirpath),
                "out": str(base / f"{case.name}-killed.pt"),
                "loader": case.loader,
                "kill": case.kill,
                "background": case.background,
            }
        )
    codes = _run_all(context, jobs)
    assert codes[: len(refs)] == [0] * len(refs), f"a reference run failed: {codes}"
    for case, code in zip(CASES, codes[len(refs) :], strict=True):
        case.killed_rc = code
    resumed = [
        {
            "dirpath": str(case.dirpath),
            "out": str(base / f"{case.name}-resumed.pt"),
            "loader": case.loader,
            "background": case.background,
            "resume": True,
        }
        for case in CASES
    ]
    for case, code in zip(CASES, _run_all(context, resumed), strict=True):
        case.resumed_rc = code
    return {
        "refs": {kind: torch.load(path, weights_only=True) for kind, path in refs.items()},
        "base": base,
    }


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_resume_after_sigkill_is_bit_identical(case: Case, kill_runs: dict[str, Any]) -> None:
    where = f"(case {case.name}, kill {case.kill}, LOOPBUS_KILL_SEED={SEED})"
    assert case.killed_rc == -signal.SIGKILL, f"the run was not killed {where}: rc={case.killed_rc}"
    assert not (kill_runs["base"] / f"{case.name}-killed.pt").exists()
    assert case.resumed_rc == 0, f"the resumed run failed {where}: rc={case.resumed_rc}"
    reference = kill_runs["refs"][case.loader]
    resumed = torch.load(kill_runs["base"] / f"{case.name}-resumed.pt", weights_only=True)
    assert resumed["global_step"] == reference["global_step"] == STEPS
    for name, tensor in reference["module"].items():
        assert torch.equal(resumed["module"][name], tensor), f"weight {name!r} differs {where}"
    for index, state in reference["optimizer"]["state"].items():
        assert torch.equal(
            resumed["optimizer"]["state"][index]["momentum_buffer"], state["momentum_buffer"]
        ), f"momentum buffer {index} differs {where}"
    assert resumed["optimizer"]["param_groups"] == reference["optimizer"]["param_groups"]
    assert reference["warnings"] == []
    # The documented fallback warns, once, when a plain loader resumes mid-epoch; a
    # stateful loader resumes without replaying anything, as does an epoch boundary.
    skipped = [w for w in resumed["warnings"] if "resuming mid-epoch by skipping" in w]
    if case.kill.startswith("epoch"):
        assert resumed["resumed_mid_epoch"] is False, where
    if case.kill.startswith("val") or case.name.endswith("after-validation"):
        assert resumed["resumed_mid_epoch"] is True, where
    mid_epoch_plain = case.loader == "plain" and resumed["resumed_mid_epoch"]
    assert len(skipped) == (1 if mid_epoch_plain else 0), f"{resumed['warnings']} {where}"
    assert [w for w in resumed["warnings"] if w not in skipped] == [], where
    # Whatever the kill interrupted, the directory holds only complete checkpoints.
    last = loopbus.latest_checkpoint(case.dirpath)
    assert last is not None
    assert last.exists()
    assert not [p for p in case.dirpath.iterdir() if ".tmp-" in p.name]
    loopbus.load_checkpoint(last)
