"""Preemption under ``torchrun`` (2 ranks, gloo, CPU): SIGTERM to the torchrun agent,
which forwards it to every worker; both ranks stop at the same step, one consistent
checkpoint is written, and a relaunch with ``ckpt_path="last"`` ends bit-identical to an
uninterrupted job. And ``--max-restarts=1`` with a worker SIGKILLed: the group restarts
from ``last`` and ends bit-identical too. And under FSDP, a SIGTERM inside a gradient-
accumulation window: the window is finished before the save, bit-identical again."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from tests.stage.test_preemption import SCRIPT, assert_same_run, env, final, wait_for
from tests.torchrun import free_port

pytestmark = [
    pytest.mark.external,
    pytest.mark.skipif(
        not torch.distributed.is_available(), reason="torch.distributed is not available"
    ),
    pytest.mark.slow,
]

#: 160 samples, 2 ranks, batches of 8, windows of 3: 4 optimizer steps an epoch, 3 epochs.
FINAL_STEP = 12


def torchrun(directory: Path, *args: str, launcher: tuple[str, ...] = ()) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        *(launcher or (f"--master_port={free_port()}",)),
        str(SCRIPT),
        "--dir",
        str(directory),
        *args,
    ]


def launch(directory: Path, *args: str, launcher: tuple[str, ...] = (), **extra_env: str) -> None:
    proc = subprocess.run(
        torchrun(directory, *args, launcher=launcher),
        env={**env(), **extra_env},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def same_run(directory: Path, reference: dict[str, Any]) -> None:
    assert_same_run(final(directory), reference, FINAL_STEP)


@pytest.fixture(scope="module")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("ddp-reference")
    launch(directory)
    return final(directory)


@pytest.mark.parametrize("layout", ["file", "sharded"])
def test_sigterm_to_torchrun_stops_both_ranks_at_one_step_and_resumes_exactly(
    tmp_path: Path, ddp_reference: dict[str, Any], layout: str
) -> None:
    # "sharded": every rank writes its shards of the checkpoint (DCP, asynchronous); the
    # process exits only once the checkpoint is complete.
    extra = ("--sharded",) if layout == "sharded" else ()
    proc = subprocess.Popen(
        torchrun(tmp_path, "--wait-at", "1:7", *extra),
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(tmp_path / "ready", proc)
    proc.send_signal(signal.SIGTERM)  # to the agent; it forwards SIGTERM to the workers
    _, err = proc.communicate(timeout=120)
    reports = [json.loads((tmp_path / f"preempted_rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["code"] for r in reports] == [143, 143], err[-6000:]
    step = reports[0]["step"]
    assert reports[1]["step"] == step
    assert 0 < step < FINAL_STEP
    for rank in (0, 1):
        events = json.loads((tmp_path / f"events_rank{rank}.json").read_text())
        assert [e["event"] for e in events] == ["PreemptionRequested", "Teardown"]
        assert events[0]["signal"] == "SIGTERM"
        assert events[0]["step"] == step
        assert (events[1]["reason"], events[1]["step"]) == ("stopped", step)
    last = loopbus.latest_checkpoint(tmp_path / "ckpt")
    assert last is not None
    assert loopbus.is_sharded_checkpoint(last) == (layout == "sharded")
    state = loopbus.load_checkpoint(last)
    assert state["run"]["step"] == step
    assert not [p for p in (tmp_path / "ckpt").iterdir() if ".tmp-" in p.name]

    launch(tmp_path, "--resume", *extra)
    same_run(tmp_path, ddp_reference)


def test_max_restarts_after_a_sigkilled_worker_resumes_exactly(
    tmp_path: Path, ddp_reference: dict[str, Any]
) -> None:
    # Rank 1 is SIGKILLed after step 6 of the first attempt (a checkpoint every 5 steps);
    # torchrun restarts the group, which resumes from the last checkpoint.
    launch(
        tmp_path,
        "--resume",
        "--kill-rank1-at-step",
        "6",
        launcher=(
            # A rendezvous of rounds (c10d): the restarted group meets afresh.
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            "--max-restarts=1",
            "--monitor-interval=0.1",
        ),
        # torch's agent shares its store with the workers, and a restarted group can
        # then read the dead group's addresses (pytorch/pytorch#135712): not shared.
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    assert (tmp_path / "attempts").read_text() == "0\n1\n"  # the group was restarted
    same_run(tmp_path, ddp_reference)


#: FSDP with windows of 4 micro-batches: 10 batches a rank an epoch (windows 0-3, 4-7 and
#: 8-9), 3 optimizer steps an epoch, 9 in all; a checkpoint every 4 steps. The stop is
#: checked at every boundary (``stop_check_interval_s=0``), so a signal while batch 5 of
#: epoch 1 runs (the window's second micro-batch) is agreed after batch 6: three
#: micro-batches into the window that starts after step 4.
FSDP_WINDOW = (
    "--strategy", "fsdp", "--accumulate", "4", "--every-n-steps", "4",
    "--stop-check-interval", "0",
)  # fmt: skip
FSDP_FINAL_STEP = 9


def _epoch_position(checkpoint: Path) -> tuple[int, int]:
    """A checkpoint's optimizer step and the batches of its epoch trained."""
    state = loopbus.load_checkpoint(checkpoint)
    progress = state["loops/fit"]["loops"]["epoch_loop"]["progress"]["current"]
    return state["run"]["step"], progress["completed"]


def test_sigterm_inside_an_fsdp_accumulation_window_finishes_it_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    # FSDP keeps a window's gradients unsharded, to itself: no checkpoint can hold them.
    # The ranks run the window's last micro-batch and its optimizer step, then save and
    # stop; the checkpoint of the window's start is left as it was.
    reference_dir = tmp_path / "reference"
    preempted_dir = tmp_path / "preempted"
    # The uninterrupted run, meanwhile.
    reference = subprocess.Popen(
        torchrun(reference_dir, *FSDP_WINDOW),
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        proc = subprocess.Popen(
            torchrun(preempted_dir, "--wait-at", "1:5", *FSDP_WINDOW),
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for(preempted_dir / "ready", proc)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        out, ref_err = reference.communicate(timeout=240)
    finally:
        if reference.poll() is None:  # the test failed meanwhile
            reference.terminate()  # the agent forwards it to its workers
            reference.communicate(timeout=60)
    assert reference.returncode == 0, out[-3000:] + ref_err[-6000:]

    reports = [json.loads((preempted_dir / f"preempted_rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["code"], r["step"]) for r in reports] == [(143, 5), (143, 5)], err[-6000:]
    for rank in (0, 1):
        events = json.loads((preempted_dir / f"events_rank{rank}.json").read_text())
        assert [(e["event"], e["step"]) for e in events] == [
            ("PreemptionRequested", 5),
            ("Teardown", 5),
        ]
    directory = preempted_dir / "ckpt"
    assert sorted(p.name for p in directory.iterdir()) == [
        "epoch=1-step=4.ckpt",
        "epoch=1-step=5.ckpt",
        "last.json",
    ]
    # The window's start (4 batches of epoch 1 trained), untouched; the stop at its end.
    assert _epoch_position(directory / "epoch=1-step=4.ckpt") == (4, 4)
    last = loopbus.latest_checkpoint(directory)
    assert last == directory / "epoch=1-step=5.ckpt"
    assert loopbus.is_sharded_checkpoint(last)
    assert _epoch_position(last) == (5, 8)

    launch(preempted_dir, "--resume", *FSDP_WINDOW)
    assert_same_run(final(preempted_dir), final(reference_dir), FSDP_FINAL_STEP)
