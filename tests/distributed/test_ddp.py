"""DDP for real: ``tests/distributed/ddp_script.py`` run under ``torchrun`` (gloo, CPU) in
subprocesses, and single-process with plain ``python``.

The runs that train to their end and are judged by what they wrote share one launch
(``RUNS``, one scenario each); runs that fail, hang, are killed or resumed, or test the
launcher itself get launches of their own."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import loopbus
from loopbus import MisconfigurationError, Trainer
from loopbus.distributed._strategy import SingleProcess
from loopbus.plugins import Checkpoint
from loopbus.storage import host_tag as _host_tag
from loopbus.storage import temporary_for as _temp_path
from tests.torchrun import (
    DDP_SCRIPT,
    Scenarios,
    env,
    free_port,
    launch,
    ok,
    same,
    summary,
    torchrun,
    weights,
)

#: Above any pid_max: no process has this id on this host.
DEAD_PID = 999_999_999
# What gloo says when a collective outlives the group's timeout (a receive that waited,
# or a connection it closed for that reason).
TIMED_OUT = ("Timed out waiting", "Application timeout caused pair closure")

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)

STOPS = {
    # Checked at every boundary (stop_check_interval_s=0): asked by a handler after
    # step 10, sent at boundary 10, read at boundary 11.
    "in-a-handler": 11,
    # Asked inside step 11: sent at boundary 11, read at boundary 12.
    "in-the-step": 12,
    # Asked by a validation handler inside the epoch: the blocking exchange after
    # validation stops every rank at once.
    "at-validation": 10,
}
_STOP_IN = {"in-a-handler": "handler", "in-the-step": "step", "at-validation": "validation"}
#: The DDP sharded-checkpoint run that is refused when run again into its folder.
RERUN = ("--epochs", "1", "--ckpt", "8", "--sharded", "--timeout", "600")
#: The runs that the kill-and-resume tests are compared with, never killed.
KILLED_JOB = ("--epochs", "2", "--ckpt", "10")
#: One launch, a scenario each (compiled ones last: what dynamo caches stays behind).
RUNS = Scenarios(
    DDP_SCRIPT,
    {
        "two-ranks": ["--csv", "--ckpt", "20"],
        **{
            f"stop-{where}": [
                "--epochs", "2", "--stop-rank", "1", "--stop-at", "10",
                "--stop-in", _STOP_IN[where], "--stop-check-interval", "0",
            ]
            for where in STOPS
        },
        "stop-default-interval": ["--epochs", "2", "--stop-rank", "1", "--stop-at", "10"],
        "accumulate": ["--epochs", "1", "--accumulate", "3"],
        "rerun-first": list(RERUN),
        "uninterrupted": list(KILLED_JOB),
        "uninterrupted-stateful": [*KILLED_JOB, "--loader", "stateful"],
        "plain-one-epoch": ["--epochs", "1"],
        "compiled": ["--epochs", "2", "--compile", "aot_eager"],
        "compiled-forward": [
            "--epochs", "1", "--compile", "aot_eager", "--compile-target", "forward"
        ],
    },
    timeout_s=300,
)  # fmt: skip
#: Where the two-ranks run finds temporaries that a dead writer of this host left, in
#: each rank's checkpoint directory: only rank 0, the writer, cleans up.
_STALE = [f"ckpt_rank{r}/.old.ckpt.tmp-{DEAD_PID}-abcd1234" for r in (0, 1)]


def _plant_stale_temporaries(root: Path) -> None:
    for name in _STALE:
        path = root / "two-ranks" / name
        path.parent.mkdir(parents=True)
        path.write_bytes(b"partial")


@pytest.fixture(scope="session")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> Scenarios:
    return RUNS.run_once(tmp_path_factory, "ddp-runs", prepare=_plant_stale_temporaries)


def test_two_ranks_train_one_model(ddp_runs: Scenarios) -> None:
    out = ddp_runs.out("two-ranks")
    stale = [out / name for name in _STALE]
    s0, s1 = summary(out, 0), summary(out, 1)
    assert (s0["strategy"], s0["world_size"], s1["world_size"]) == ("ddp", 2, 2)
    # Each rank trains on half of the 512 samples: 16 batches of 16 per epoch.
    assert s0["step"] == s1["step"] == 4 * 16
    assert s0["accuracy"] >= 0.9
    assert same(weights(out, 0), weights(out, 1))
    # torchmetrics synchronises on compute(): every rank validated all 256 samples, so
    # the synced count is both ranks' and the synced accuracy is each rank's own.
    assert s0["val_seen"] == s1["val_seen"] == 2 * 256
    assert s0["val_acc"] == pytest.approx(s0["accuracy"])
    assert s1["val_acc"] == pytest.approx(s0["accuracy"])
    # Loggers and checkpoint writing act on rank 0 only.
    assert (out / "logs_rank0" / "metrics.csv").is_file()
    assert not (out / "logs_rank1").exists()
    assert list((out / "ckpt_rank0").glob("*.ckpt"))
    assert [p.name for p in (out / "ckpt_rank1").iterdir()] == [stale[1].name]
    assert not stale[0].exists()
    # The checkpoint holds both ranks' generators.
    state = loopbus.load_checkpoint(out / "ckpt_rank0")
    assert len(state["rng"]["ranks"]) == 2


@pytest.mark.external
def test_same_script_single_process(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(DDP_SCRIPT), "--out", str(tmp_path), "--epochs", "2"],
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    ok(proc)
    s0 = summary(tmp_path, 0)
    assert (s0["strategy"], s0["world_size"], s0["step"]) == ("single", 1, 64)
    assert s0["val_seen"] == 256


@pytest.mark.external
def test_two_nodes_on_one_machine(tmp_path: Path) -> None:
    port = free_port()
    procs = [
        subprocess.Popen(
            torchrun(
                "--nnodes=2",
                f"--node_rank={node}",
                "--nproc_per_node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=loopbus-test",
                str(DDP_SCRIPT),
                "--out",
                str(tmp_path),
                "--epochs",
                "2",
            ),
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for p, output in zip(procs, outputs, strict=True):
        assert p.returncode == 0, output[-8000:]
    assert summary(tmp_path, 0)["world_size"] == 2
    assert same(weights(tmp_path, 0), weights(tmp_path, 1))


@pytest.mark.parametrize(("where", "stopped_at"), list(STOPS.items()), ids=list(STOPS))
def test_stop_on_one_rank_stops_all_at_the_same_step(
    ddp_runs: Scenarios, where: str, stopped_at: int
) -> None:
    out = ddp_runs.out(f"stop-{where}")
    s0, s1 = summary(out, 0), summary(out, 1)
    assert s0["step"] == s1["step"] == stopped_at
    assert s1["stop_reason"] == "rank 1 asked at step 10"
    assert s0["stop_reason"] == "rank 1 asked at step 10 (on rank 1)"
    assert same(weights(out, 0), weights(out, 1))


def test_with_the_default_interval_a_stop_lands_at_one_step_on_every_rank(
    ddp_runs: Scenarios,
) -> None:
    # Checks about every 50 ms: where the stop lands depends on the pace, but it is the
    # same step on both ranks, after the request and at the latest at the end of the
    # epoch (16 steps a rank), whose blocking exchange reads what is in flight.
    out = ddp_runs.out("stop-default-interval")
    s0, s1 = summary(out, 0), summary(out, 1)
    assert s0["step"] == s1["step"]
    assert 10 <= s0["step"] <= 16
    assert s0["stop_reason"] == "rank 1 asked at step 10 (on rank 1)"
    assert same(weights(out, 0), weights(out, 1))


@pytest.mark.external
def test_manual_optimization_is_refused_clearly(tmp_path: Path) -> None:
    proc = launch(tmp_path, "--epochs", "1", "--manual")
    assert proc.returncode != 0
    assert "uses manual optimization, which strategy='ddp' does not support yet" in (
        proc.stdout + proc.stderr
    )


def test_accumulation_keeps_ranks_in_sync(ddp_runs: Scenarios) -> None:
    out = ddp_runs.out("accumulate")
    s0 = summary(out, 0)
    assert s0["step"] == 6  # 16 batches: 5 full windows and the epoch's last batch
    assert same(weights(out, 0), weights(out, 1))


def test_a_compiled_step_trains_under_ddp(ddp_runs: Scenarios) -> None:
    # The DDP wrapper's forward compiled (its graph split at the gradient buckets).
    out = ddp_runs.out("compiled")
    s0, s1 = summary(out, 0), summary(out, 1)
    assert s0["step"] == s1["step"] == 2 * 16
    assert s0["accuracy"] >= 0.9
    trained = weights(out, 0)
    assert same(trained, weights(out, 1))
    assert not [key for key in trained if "_orig_mod" in key or "module." in key]


def test_a_compiled_forward_target_trains_as_eager_under_ddp(ddp_runs: Scenarios) -> None:
    # compile={"target": "forward"}: the module's call compiled inside the DDP wrapper,
    # the step, the loss and the optimizer step eager.
    target, plain = ddp_runs.out("compiled-forward"), ddp_runs.out("plain-one-epoch")
    compiled = weights(target, 0)
    assert same(compiled, weights(target, 1))
    assert not [key for key in compiled if "_orig_mod" in key or "module." in key]
    for key, value in weights(plain, 0).items():
        torch.testing.assert_close(compiled[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_rerun_into_a_shared_checkpoint_folder_is_refused_on_every_rank(
    ddp_runs: Scenarios, tmp_path: Path
) -> None:
    # The ranks' shards share one folder: a second run that does not resume from it is
    # refused (not allowed to overwrite the first run's checkpoints), on every rank, and
    # the job comes down at once rather than when a collective times out. (The first
    # run's folder is copied: the fixture's stays as it was made.)
    out = tmp_path / "rerun"
    shutil.copytree(ddp_runs.out("rerun-first"), out, symlinks=True)
    before = sorted(p.relative_to(out) for p in (out / "ckpt_sharded").rglob("*"))
    proc = launch(out, *RERUN, timeout=120)
    assert proc.returncode != 0
    assert "exist_ok=True" in proc.stdout + proc.stderr
    assert sorted(p.relative_to(out) for p in (out / "ckpt_sharded").rglob("*")) == before


@pytest.mark.external
def test_a_failing_rank_brings_the_job_down(tmp_path: Path) -> None:
    # The process group's timeout is longer than the launch's deadline: a job that came
    # down only once the other rank's collective timed out would miss the deadline. The
    # failure is passed on, not waited out.
    proc = launch(tmp_path, "--raise-rank", "1", "--raise-at", "5", "--timeout", "600", timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "boom on rank 1 at step 5" in output
    assert not any(text in output for text in TIMED_OUT), output[-4000:]
    assert not (tmp_path / "summary_rank0.json").exists()


@pytest.mark.external
@pytest.mark.slow
def test_a_hung_rank_times_the_others_out(tmp_path: Path) -> None:
    proc = launch(tmp_path, "--hang-rank", "1", "--hang-at", "5", "--timeout", "5", timeout=90)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "rank 1 hangs at step 5" in output
    # Rank 0 waited in a collective for process_group_timeout_s, failed, and torchrun then
    # stopped the hung rank.
    assert any(text in output for text in TIMED_OUT), output[-4000:]
    assert not (tmp_path / "summary_rank0.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "kill_at",
    [
        pytest.param("25", id="mid-second-epoch"),
        # Resumes from step 10, in the first epoch of 16 steps: across the boundary.
        pytest.param("13", id="across-the-epoch-boundary"),
    ],
)
def test_killed_job_resumes_bit_identical(
    ddp_runs: Scenarios, tmp_path: Path, kill_at: str
) -> None:
    _kill_and_resume(ddp_runs.out("uninterrupted"), tmp_path, kill_at)


@pytest.mark.slow
def test_killed_job_with_a_stateful_loader_resumes_bit_identical(
    ddp_runs: Scenarios, tmp_path: Path
) -> None:
    """torchdata's StatefulDataLoader stays stateful under DDP (sharded by loopbus): the
    checkpoint holds its position, and the resumed job continues from there."""
    pytest.importorskip("torchdata")
    full = ddp_runs.out("uninterrupted-stateful")
    _kill_and_resume(full, tmp_path, "25", "--loader", "stateful")
    (last,) = (tmp_path / "killed" / "ckpt_rank0").glob("*.ckpt")
    assert loopbus.load_checkpoint(last)["data/train"]["position"] is not None


def _kill_and_resume(full: Path, tmp_path: Path, kill_at: str, *options: str) -> None:
    """Kill the job at step ``kill_at``, resume it from its last checkpoint: it ends with
    the weights of ``full``, the same job never killed (run in ``RUNS``)."""
    killed = tmp_path / "killed"
    common = (*KILLED_JOB, *options)
    proc = launch(killed, *common, "--kill-at", kill_at)
    assert proc.returncode != 0
    assert not (killed / "summary_rank0.json").exists()
    ok(launch(killed, *common, "--resume"))
    for rank in (0, 1):
        assert same(weights(full, rank), weights(killed, rank))
    assert summary(killed, 0)["step"] == summary(full, 0)["step"] == 32


def test_strategy_is_validated() -> None:
    with pytest.raises(MisconfigurationError, match="strategy"):
        Trainer(strategy="horovod", plugins=[])  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationError, match="process_group_timeout"):
        Trainer(process_group_timeout_s=0, plugins=[])
    trainer = Trainer(plugins=[])
    assert trainer.strategy.name == "single"
    assert (trainer.world_size, trainer.global_rank, trainer.is_global_zero) == (1, 0, True)


def test_ddp_outside_a_launcher_explains(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MASTER_ADDR", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    if torch.distributed.is_initialized():
        pytest.skip("a process group is already initialised")
    with pytest.raises(MisconfigurationError, match="torchrun"):
        Trainer(strategy="ddp", device="cpu", plugins=[])


# ---------------------------------------------------------------- stale temporaries


def _other_host() -> str:
    return "another-host" if _host_tag() != "another-host" else "yet-another-host"


def test_a_temporary_names_its_writer_and_host(tmp_path: Path) -> None:
    name = _temp_path(tmp_path / "epoch=0-step=3.ckpt").name
    assert name.startswith(f".epoch=0-step=3.ckpt.tmp-{os.getpid()}-")
    assert name.endswith(f"@{_host_tag()}")


def test_host_tags_are_safe_short_and_distinct(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket as socket_module

    monkeypatch.setattr(socket_module, "gethostname", lambda: "gpu-7.cluster@example.org")
    assert _host_tag() == "gpu-7_cluster_example_org"
    tags = set()
    for suffix in ("a", "b"):
        long_name = "node-" + "x" * 60 + suffix + ".example.org"
        monkeypatch.setattr(socket_module, "gethostname", lambda n=long_name: n)
        tag = _host_tag()
        assert len(tag) <= 32
        assert not set(tag) & set(".@/"), tag
        tags.add(tag)
    assert len(tags) == 2


def test_stale_temporaries_of_another_host_are_left_alone(tmp_path: Path) -> None:
    here, there = _host_tag(), _other_host()
    removed_here = tmp_path / f".a.ckpt.tmp-{DEAD_PID}-abcd1234@{here}"
    written_there = tmp_path / f".b.ckpt.tmp-{DEAD_PID}-abcd1234@{there}"
    my_pid_there = tmp_path / f".c.ckpt.tmp-{os.getpid()}-abcd1234@{there}"
    live_here = tmp_path / f".d.ckpt.tmp-1-abcd1234@{here}"  # pid 1 runs
    without_host = tmp_path / f".e.ckpt.tmp-{DEAD_PID}-abcd1234"  # an earlier loopbus's
    for path in (removed_here, written_there, my_pid_there, live_here, without_host):
        path.write_bytes(b"partial")
    removed = loopbus.remove_stale_temporaries(tmp_path)
    assert sorted(removed) == sorted([removed_here, without_host])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        p.name for p in (written_there, my_pid_there, live_here)
    )


class _Rank:
    """What Checkpoint.setup reads of a trainer, on a rank of a distributed run."""

    def __init__(self, zero: bool) -> None:
        self.is_global_zero = zero
        self.strategy = SingleProcess()  # what it says of sharding: nothing is sharded


@pytest.mark.parametrize("zero", [True, False], ids=["rank0", "rank1"])
def test_only_rank_zero_cleans_up_temporaries(tmp_path: Path, zero: bool) -> None:
    stale = tmp_path / f".a.ckpt.tmp-{DEAD_PID}-abcd1234@{_host_tag()}"
    there = tmp_path / f".b.ckpt.tmp-{DEAD_PID}-abcd1234@{_other_host()}"
    for path in (stale, there):
        path.write_bytes(b"partial")
    plugin = Checkpoint(tmp_path)
    plugin.setup(_Rank(zero), "fit")  # type: ignore[arg-type]
    plugin.teardown(_Rank(zero), "fit")  # type: ignore[arg-type]
    assert stale.exists() is not zero
    assert there.exists()
