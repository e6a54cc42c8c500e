"""Preemption for real: a training process (``_preempt_script.py``) gets SIGTERM or
SIGUSR1 from this test while a known batch runs (mid-epoch, inside an accumulation
window), writes a checkpoint there, exits with the documented status, and a new process
resumes from ``last`` to the same final weights as an uninterrupted run, bit for bit.

Each process is a plain ``python`` run of the script, on asyncio or trio, with the steps
inline or in a worker thread; the signal goes from this process to that one."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from loopbus.plugins import read_csv, read_jsonl
from tests.torchrun import env

SCRIPT = Path(__file__).resolve().parent / "_preempt_script.py"
#: The batch the signal lands in: epoch 1, batch 7 (the second of its accumulation
#: window of 3), after 9 optimizer steps.
WAIT_AT = "1:7"
STOP_STEP = 9
FINAL_STEP = 21

pytestmark = [
    pytest.mark.external,
    pytest.mark.skipif(
        not hasattr(signal, "SIGUSR1"), reason="POSIX signals (SIGTERM, SIGUSR1) needed"
    ),
]


def run_script(directory: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--dir", str(directory), *args],
        env=env(),
        capture_output=True,
        text=True,
        timeout=180,
    )


def wait_for(path: Path, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the run ended before {path.name}: {out[-2000:]}{err[-4000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {path.name} after {timeout} s")
        time.sleep(0.01)


def preempt(directory: Path, *args: str, sig: int = signal.SIGTERM) -> tuple[int, float, str]:
    """Start a run, send ``sig`` while batch ``WAIT_AT`` runs; the exit status, the
    seconds from the signal to the exit, and what the run wrote to stderr."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--dir", str(directory), "--wait-at", WAIT_AT, *args],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(directory / "ready", proc)
    start = time.perf_counter()
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, time.perf_counter() - start, err


def final(directory: Path) -> dict[str, Any]:
    return torch.load(directory / "final.pt.rank0", weights_only=True)  # type: ignore[no-any-return]


def assert_same_run(
    resumed: dict[str, Any], reference: dict[str, Any], final_step: int = FINAL_STEP
) -> None:
    """The resumed run's final weights, momentum and step are the uninterrupted one's."""
    assert resumed["global_step"] == reference["global_step"] == final_step
    for name, tensor in reference["module"].items():
        assert torch.equal(resumed["module"][name], tensor), f"weight {name!r} differs"
    for index, state in reference["optimizer"]["state"].items():
        assert torch.equal(
            resumed["optimizer"]["state"][index]["momentum_buffer"], state["momentum_buffer"]
        ), f"momentum buffer {index} differs"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    directory = tmp_path_factory.mktemp("reference")
    proc = run_script(directory)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return final(directory)


def assert_checkpoint_at_the_stop(directory: Path) -> Path:
    """``last`` is a complete checkpoint at the stop step, taken mid-epoch inside an open
    accumulation window; the logs are flushed to that step."""
    last = loopbus.latest_checkpoint(directory / "ckpt")
    assert last is not None
    assert last.name == f"epoch=1-step={STOP_STEP}.ckpt"
    state = loopbus.load_checkpoint(last)
    assert state["run"] == {"step": STOP_STEP, "epoch": 1}
    epoch_loop = state["loops/fit"]["loops"]["epoch_loop"]
    assert epoch_loop["state"]["in_epoch"] is True
    assert epoch_loop["progress"]["current"]["completed"] == 8
    assert any(g is not None for g in state["grads"].values()), "the window's gradients"
    rows = read_csv(directory / "logs" / "metrics.csv")
    assert rows[-1]["step"] == STOP_STEP
    assert len(rows) == 28  # one row per batch trained: 20 + 8
    records = read_jsonl(directory / "logs" / "records.jsonl")
    assert [r.step for r in records][-1] == STOP_STEP
    assert len(records) == 28
    assert not [p for p in (directory / "ckpt").iterdir() if ".tmp-" in p.name]
    return last


@pytest.mark.parametrize("executor", ["inline", "thread"])
@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_sigterm_mid_epoch_saves_exits_143_and_resumes_bit_identical(
    tmp_path: Path, backend: str, executor: str, reference: dict[str, Any]
) -> None:
    options = ("--backend", backend, "--executor", executor)
    rc, _, err = preempt(tmp_path, *options)
    assert rc == 128 + signal.SIGTERM == 143, err[-4000:]
    assert "stopped at step 9 on SIGTERM; exiting with status 143" in err
    report = json.loads((tmp_path / "preempted_rank0.json").read_text())
    assert report["code"] == 143
    assert report["signal"] == "SIGTERM"
    assert report["step"] == report["global_step"] == STOP_STEP
    assert report["handler_restored"] is True  # back to the default action
    last = assert_checkpoint_at_the_stop(tmp_path)
    assert report["last"] == str(last)
    events = json.loads((tmp_path / "events_rank0.json").read_text())
    assert events[0]["event"] == "PreemptionRequested"
    assert (events[0]["signal"], events[0]["step"], events[0]["epoch"]) == ("SIGTERM", 9, 1)
    assert events[0]["deadline"] is None
    assert events[-1]["event"] == "Teardown"
    assert (events[-1]["reason"], events[-1]["step"]) == ("stopped", STOP_STEP)

    resumed = run_script(tmp_path, *options, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert_same_run(final(tmp_path), reference)


def test_sigusr1_saves_exits_138_and_resumes_bit_identical(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    rc, _, err = preempt(tmp_path, "--backend", "trio", sig=signal.SIGUSR1)
    assert rc == 128 + signal.SIGUSR1 == 138, err[-4000:]
    report = json.loads((tmp_path / "preempted_rank0.json").read_text())
    assert report["signal"] == "SIGUSR1"
    assert_checkpoint_at_the_stop(tmp_path)
    resumed = run_script(tmp_path, "--backend", "trio", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert_same_run(final(tmp_path), reference)


def test_exit_status_for_requeue_is_configurable(tmp_path: Path) -> None:
    rc, _, err = preempt(tmp_path, "--exit-code", "75", sig=signal.SIGUSR1)
    assert rc == 75, err[-4000:]
    assert_checkpoint_at_the_stop(tmp_path)


def test_second_sigterm_during_the_save_leaves_only_complete_checkpoints(
    tmp_path: Path, reference: dict[str, Any]
) -> None:
    # The run's checkpoint writer sends itself SIGTERM again between writing the file
    # and renaming it, then waits: the second signal ends the process at once.
    rc, _, err = preempt(tmp_path, "--second-during-save")
    assert rc == 143, err[-4000:]
    assert (
        "a second preemption signal; exiting now" in err
    )  # ended by it, not after the writer's wait
    assert not (tmp_path / "preempted_rank0.json").exists()  # ended before the stage did
    directory = tmp_path / "ckpt"
    assert not (directory / f"epoch=1-step={STOP_STEP}.ckpt").exists()
    last = loopbus.latest_checkpoint(directory)
    assert last is not None
    assert last.name == "epoch=0-step=5.ckpt"
    for path in directory.glob("*.ckpt"):
        loopbus.load_checkpoint(path)  # complete, or it raises
    resumed = run_script(tmp_path, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert not [p for p in directory.iterdir() if ".tmp-" in p.name]  # cleaned on start
    assert_same_run(final(tmp_path), reference)


def test_grace_period_ends_a_run_whose_step_hangs(tmp_path: Path) -> None:
    # The step goes on for 60 s after the signal; the grace period ends the process.
    rc, _, err = preempt(tmp_path, "--grace", "0.5")
    assert rc == 143, err[-4000:]
    assert "preemption grace period over; exiting now" in err
    assert not (tmp_path / "preempted_rank0.json").exists()  # the stage never ended


def test_the_host_handler_runs_after_ours_and_is_restored(tmp_path: Path) -> None:
    rc, _, err = preempt(tmp_path, "--host-handler", "--executor", "thread")
    assert rc == 143, err[-4000:]
    assert (tmp_path / "host-handler").read_text() == "SIGTERM\n"
    report = json.loads((tmp_path / "preempted_rank0.json").read_text())
    assert report["handler_restored"] is True
    assert_checkpoint_at_the_stop(tmp_path)
