"""Interrupted runs on the 2D mesh (dp=2, tp=2), for real: ``tests/distributed/tp_script.py
--scenario job`` under ``torchrun`` (4 ranks, gloo, CPU), shuffled data, gradient clipping,
a sharded checkpoint every 4 steps.

* kill -9: every rank SIGKILLed at step 6 (mid-epoch, after the checkpoint of step 4); a
  relaunch with ``ckpt_path="last"`` ends with full weights and AdamW state bit-identical
  to an uninterrupted run's.
* SIGTERM to the launcher, which forwards it to every worker (preemption): every rank
  stops at one step mid-epoch, ``Checkpoint`` saves there, the job exits 143; a relaunch
  with ``ckpt_path="last"`` ends bit-identical too.
* The uninterrupted run's mid-epoch checkpoint (step 4) resumed on (dp=1, tp=4) and on
  HSDP (4 replicas, no tp): the replicas read each remaining sample of the epoch once.

Two launches are interrupted (``_interrupt``, side by side); the uninterrupted run and the
four resumes share one launch after them.
"""

from __future__ import annotations

import json
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from tests.distributed.test_model_parallel import HSDP, SCRIPT, TP_4, WORLD, MESH_2x2
from tests.stage.test_preemption import wait_for
from tests.torchrun import Scenarios, env, free_port, launch, torchrun

pytestmark = [
    pytest.mark.external,
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.distributed.is_available(), reason="torch.distributed is not available"
    ),
]

#: 128 samples, a global batch of 16: 8 optimizer steps an epoch, 2 epochs. Enough for a
#: checkpoint (step 4) and an interruption after it in the middle of the first epoch, and
#: a whole second epoch after the resume (each step is rounds of collectives on 4 ranks).
N_TRAIN = 128
STEPS_PER_EPOCH = 8
FINAL_STEP = 16
JOB = ["--scenario", "job", "--every", "4", "--n-train", str(N_TRAIN)]
KILL_AT = 6
#: The batch rank 0 holds until the SIGTERM has asked for a stop (the 6th of epoch 0);
#: the stop is agreed at a boundary after it (checked at every boundary here).
WAIT_AT = 5
MIDEPOCH_CKPT = "reference/ckpt/epoch=0-step=4.ckpt"


def _interrupt(root: Path) -> None:
    """The two interrupted jobs, before the launch that resumes them: their exit status,
    the end of their output and what their last checkpoint was (the resumed runs save
    into the same folders) in ``<dir>/launch.json``. They share nothing, so they run side
    by side."""
    with ThreadPoolExecutor(2) as pool:
        for done in [pool.submit(_killed, root), pool.submit(_preempted, root)]:
            done.result()


def _killed(root: Path) -> None:
    killed = root / "killed"
    proc = launch(
        killed, *JOB, *MESH_2x2, "--kill-at", str(KILL_AT), nproc=WORLD, script=SCRIPT, timeout=300
    )
    _report(killed, proc.returncode, proc.stderr)


def _preempted(root: Path) -> None:
    preempted = root / "preempted"
    preempted.mkdir()
    launcher = [f"--nproc_per_node={WORLD}", f"--master_port={free_port()}"]
    options = [*JOB, *MESH_2x2, "--wait-at", str(WAIT_AT), "--stop-check-interval", "0"]
    running = subprocess.Popen(
        [*torchrun(*launcher, str(SCRIPT)), "--out", str(preempted), *options],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(preempted / "ready", running, timeout=240)
    running.send_signal(signal.SIGTERM)  # to the launcher: it forwards it to the workers
    _, err = running.communicate(timeout=180)
    _report(preempted, running.returncode, err)


def _report(directory: Path, returncode: int, err: str) -> None:
    last = loopbus.latest_checkpoint(directory / "ckpt")
    report = {
        "returncode": returncode,
        "stderr": err[-6000:],
        "sharded": last is not None and loopbus.is_sharded_checkpoint(last),
        "last": None if last is None else loopbus.checkpoint_info(last),
    }
    (directory / "launch.json").write_text(json.dumps(report))


RUNS = Scenarios(
    SCRIPT,
    {
        "reference": [*JOB, *MESH_2x2],
        "resume-killed": [*JOB, *MESH_2x2, "--resume", "--ckpt-dir", "killed/ckpt"],
        "resume-preempted": [*JOB, *MESH_2x2, "--resume", "--ckpt-dir", "preempted/ckpt"],
        "midepoch-tp4": [*JOB, *TP_4, "--epochs", "1", "--ckpt", MIDEPOCH_CKPT],
        "midepoch-hsdp": [*JOB, *HSDP, "--epochs", "1", "--ckpt", MIDEPOCH_CKPT],
    },
    nproc=WORLD,
    timeout_s=180,
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Scenarios:
    return RUNS.run_once(tmp_path_factory, "tp-resume", prepare=_interrupt)


def _final(directory: Path) -> dict[str, Any]:
    return torch.load(directory / "final.pt", weights_only=True)  # type: ignore[no-any-return]


def _assert_bit_identical(resumed: dict[str, Any], reference: dict[str, Any]) -> None:
    assert resumed["model"].keys() == reference["model"].keys()
    for name, tensor in reference["model"].items():
        assert torch.equal(resumed["model"][name], tensor), f"weight {name!r} differs"
    assert resumed["optim"].keys() == reference["optim"].keys()
    for name, entry in reference["optim"].items():
        for key, tensor in entry.items():
            assert torch.equal(resumed["optim"][name][key], tensor), f"{name} {key} differs"


def _samples(directory: Path) -> list[list[dict[str, Any]]]:
    """What each rank trained: one entry (epoch, step, sample indices) per batch."""
    return [
        [
            json.loads(line)
            for line in (directory / f"samples_rank{r}.jsonl").read_text().splitlines()
        ]
        for r in range(WORLD)
    ]


def _per_replica(directory: Path) -> list[list[dict[str, Any]]]:
    """What each data-parallel replica trained (one rank's record per replica, once the
    tensor-parallel peers are checked to have trained the same batches)."""
    records = _samples(directory)
    replicas: dict[int, list[dict[str, Any]]] = {}
    for r in range(WORLD):
        summary = json.loads((directory / f"job_rank{r}.json").read_text())
        replica = summary["data_parallel"][1]
        assert replicas.setdefault(replica, records[r]) == records[r], f"rank {r}'s peers"
    return [replicas[i] for i in sorted(replicas)]


def _indices(replicas: list[list[dict[str, Any]]], epoch: int, steps: range) -> list[int]:
    return [
        i
        for records in replicas
        for entry in records
        if entry["epoch"] == epoch and entry["step"] in steps
        for i in entry["idx"]
    ]


def test_the_uninterrupted_run(runs: Scenarios) -> None:
    reference = runs.out("reference")
    replicas = _per_replica(reference)
    assert len(replicas) == 2
    for epoch in (0, 1):
        steps = range(epoch * STEPS_PER_EPOCH, (epoch + 1) * STEPS_PER_EPOCH)
        assert sorted(_indices(replicas, epoch, steps)) == list(range(N_TRAIN))
    assert _final(reference)["optim"]  # AdamW state, by parameter name


def test_a_job_killed_mid_epoch_resumes_bit_identical(runs: Scenarios) -> None:
    reference, resumed = runs.out("reference"), runs.out("resume-killed")
    killed = resumed.parent / "killed"
    report = json.loads((killed / "launch.json").read_text())
    assert report["returncode"] != 0
    assert "Signal 9 (SIGKILL)" in report["stderr"]
    assert report["sharded"]
    info = report["last"]
    assert (info["global_step"], info["world_size"]) == (4, WORLD)
    # Every rank trained up to step 6, then died; the relaunch went on from step 4.
    assert [r[-1]["step"] for r in _samples(killed)] == [KILL_AT - 1] * WORLD
    assert [r[0]["step"] for r in _samples(resumed)] == [4] * WORLD
    assert json.loads((resumed / "job_rank0.json").read_text())["step"] == FINAL_STEP
    _assert_bit_identical(_final(resumed), _final(reference))


def test_a_job_preempted_by_sigterm_mid_epoch_resumes_bit_identical(runs: Scenarios) -> None:
    reference, resumed = runs.out("reference"), runs.out("resume-preempted")
    preempted = resumed.parent / "preempted"
    launch_report = json.loads((preempted / "launch.json").read_text())
    reports = [
        json.loads((preempted / f"preempted_rank{r}.json").read_text()) for r in range(WORLD)
    ]
    assert [r["code"] for r in reports] == [143] * WORLD, launch_report["stderr"]
    assert {r["signal"] for r in reports} == {"SIGTERM"}
    step = reports[0]["step"]
    assert all(r["step"] == step for r in reports)  # one step on every rank
    assert WAIT_AT < step < STEPS_PER_EPOCH  # mid-epoch
    assert launch_report["sharded"]
    info = launch_report["last"]
    assert (info["global_step"], info["epoch"]) == (step, 0)  # saved at the stop
    assert [r[0]["step"] for r in _samples(resumed)] == [step] * WORLD
    assert json.loads((resumed / "job_rank0.json").read_text())["step"] == FINAL_STEP
    _assert_bit_identical(_final(resumed), _final(reference))


@pytest.mark.parametrize(("sid", "replicas"), [("midepoch-tp4", 1), ("midepoch-hsdp", 4)])
def test_a_2x2_mid_epoch_checkpoint_resumed_on_another_mesh_reads_each_sample_once(
    runs: Scenarios, sid: str, replicas: int
) -> None:
    reference = _per_replica(runs.out("reference"))
    resumed = _per_replica(runs.out(sid))
    assert len(resumed) == replicas
    # The checkpoint of step 4 holds the first 4 global batches (64 samples) of epoch 0;
    # the resumed run trains the other 64, each once, on its own replicas: the samples
    # the uninterrupted run trained after step 4.
    before = _indices(reference, 0, range(4))
    after = _indices(resumed, 0, range(4, STEPS_PER_EPOCH))
    assert len(before) == 64
    assert sorted(after) == sorted(_indices(reference, 0, range(4, STEPS_PER_EPOCH)))
    assert sorted(before + after) == list(range(N_TRAIN))
    assert _indices(resumed, 0, range(4)) == []
    assert all(e["epoch"] == 0 for records in resumed for e in records)
    assert json.loads((runs.out(sid) / "job_rank0.json").read_text())["step"] == STEPS_PER_EPOCH
