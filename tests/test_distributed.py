"""DDP for real: ``tests/distributed_script.py`` run under ``torchrun`` (gloo, CPU) in
subprocesses, and single-process with plain ``python``."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from loopbus import MisconfigurationError, Trainer
from loopbus.checkpoint._format import _host_tag, _temp_path
from loopbus.distributed._strategy import SingleProcess
from loopbus.plugins import Checkpoint

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "distributed_script.py"
#: Above any pid_max: no process has this id on this host.
DEAD_PID = 999_999_999
#: What gloo says when a collective waits longer than the process group's timeout.
# What gloo says when a collective outlives the group's timeout (a receive that waited,
# or a connection it closed for that reason).
TIMED_OUT = ("Timed out waiting", "Application timeout caused pair closure")

pytestmark = pytest.mark.skipif(
    not torch.distributed.is_available(), reason="torch.distributed is not available"
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else src
    env["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _torchrun(*launcher: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher]


def _launch(
    out: Path, *args: str, nproc: int = 2, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    launcher = [f"--nproc_per_node={nproc}", f"--master_port={_free_port()}"]
    cmd = [*_torchrun(*launcher, str(SCRIPT)), "--out", str(out), *args]
    return subprocess.run(
        cmd,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]


def _summary(out: Path, rank: int) -> dict[str, Any]:
    return json.loads((out / f"summary_rank{rank}.json").read_text())  # type: ignore[no-any-return]


def _weights(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"weights_rank{rank}.pt", weights_only=True)  # type: ignore[no-any-return]


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_ranks_train_one_model(tmp_path: Path) -> None:
    # A temporary that a dead writer of this host left in each rank's checkpoint
    # directory: only rank 0, the writer, cleans up.
    stale = [tmp_path / f"ckpt_rank{r}" / f".old.ckpt.tmp-{DEAD_PID}-abcd1234" for r in (0, 1)]
    for path in stale:
        path.parent.mkdir()
        path.write_bytes(b"partial")
    proc = _launch(tmp_path, "--csv", "--ckpt", "20")
    _ok(proc)
    s0, s1 = _summary(tmp_path, 0), _summary(tmp_path, 1)
    assert (s0["strategy"], s0["world_size"], s1["world_size"]) == ("ddp", 2, 2)
    # Each rank trains on half of the 512 samples: 16 batches of 16 per epoch.
    assert s0["step"] == s1["step"] == 4 * 16
    assert s0["accuracy"] >= 0.9
    assert _same(_weights(tmp_path, 0), _weights(tmp_path, 1))
    # torchmetrics synchronises on compute(): every rank validated all 256 samples, so
    # the synced count is both ranks' and the synced accuracy is each rank's own.
    assert s0["val_seen"] == s1["val_seen"] == 2 * 256
    assert s0["val_acc"] == pytest.approx(s0["accuracy"])
    assert s1["val_acc"] == pytest.approx(s0["accuracy"])
    # Loggers and checkpoint writing act on rank 0 only.
    assert (tmp_path / "logs_rank0" / "metrics.csv").is_file()
    assert not (tmp_path / "logs_rank1").exists()
    assert list((tmp_path / "ckpt_rank0").glob("*.ckpt"))
    assert [p.name for p in (tmp_path / "ckpt_rank1").iterdir()] == [stale[1].name]
    assert not stale[0].exists()
    # The checkpoint holds both ranks' generators.
    state = loopbus.load_checkpoint(tmp_path / "ckpt_rank0")
    assert len(state["rng"]["ranks"]) == 2


def test_same_script_single_process(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--epochs", "2"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    _ok(proc)
    summary = _summary(tmp_path, 0)
    assert (summary["strategy"], summary["world_size"], summary["step"]) == ("single", 1, 64)
    assert summary["val_seen"] == 256


def test_two_nodes_on_one_machine(tmp_path: Path) -> None:
    port = _free_port()
    procs = [
        subprocess.Popen(
            _torchrun(
                "--nnodes=2",
                f"--node_rank={node}",
                "--nproc_per_node=1",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=loopbus-test",
                str(SCRIPT),
                "--out",
                str(tmp_path),
                "--epochs",
                "2",
            ),
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in (0, 1)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for p, output in zip(procs, outputs, strict=True):
        assert p.returncode == 0, output[-8000:]
    assert _summary(tmp_path, 0)["world_size"] == 2
    assert _same(_weights(tmp_path, 0), _weights(tmp_path, 1))


@pytest.mark.parametrize(
    ("where", "stopped_at"),
    [
        # Checked at every boundary (stop_check_interval_s=0): asked by a handler after
        # step 10, sent at boundary 10, read at boundary 11.
        pytest.param("handler", 11, id="in-a-handler"),
        # Asked inside step 11: sent at boundary 11, read at boundary 12.
        pytest.param("step", 12, id="in-the-step"),
        # Asked by a validation handler inside the epoch: the blocking exchange after
        # validation stops every rank at once.
        pytest.param("validation", 10, id="at-validation"),
    ],
)
def test_stop_on_one_rank_stops_all_at_the_same_step(
    tmp_path: Path, where: str, stopped_at: int
) -> None:
    _ok(
        _launch(
            tmp_path, "--epochs", "2", "--stop-rank", "1", "--stop-at", "10", "--stop-in", where,
            "--stop-check-interval", "0",
        )
    )  # fmt: skip
    s0, s1 = _summary(tmp_path, 0), _summary(tmp_path, 1)
    assert s0["step"] == s1["step"] == stopped_at
    assert s1["stop_reason"] == "rank 1 asked at step 10"
    assert s0["stop_reason"] == "rank 1 asked at step 10 (on rank 1)"
    assert _same(_weights(tmp_path, 0), _weights(tmp_path, 1))


def test_with_the_default_interval_a_stop_lands_at_one_step_on_every_rank(
    tmp_path: Path,
) -> None:
    # Checks about every 50 ms: where the stop lands depends on the pace, but it is the
    # same step on both ranks, after the request and at the latest at the end of the
    # epoch (16 steps a rank), whose blocking exchange reads what is in flight.
    _ok(_launch(tmp_path, "--epochs", "2", "--stop-rank", "1", "--stop-at", "10"))
    s0, s1 = _summary(tmp_path, 0), _summary(tmp_path, 1)
    assert s0["step"] == s1["step"]
    assert 10 <= s0["step"] <= 16
    assert s0["stop_reason"] == "rank 1 asked at step 10 (on rank 1)"
    assert _same(_weights(tmp_path, 0), _weights(tmp_path, 1))


def test_manual_optimization_is_refused_clearly(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "--epochs", "1", "--manual")
    assert proc.returncode != 0
    assert "uses manual optimization, which strategy='ddp' does not support yet" in (
        proc.stdout + proc.stderr
    )


def test_accumulation_keeps_ranks_in_sync(tmp_path: Path) -> None:
    _ok(_launch(tmp_path, "--epochs", "1", "--accumulate", "3"))
    s0 = _summary(tmp_path, 0)
    assert s0["step"] == 6  # 16 batches: 5 full windows and the epoch's last batch
    assert _same(_weights(tmp_path, 0), _weights(tmp_path, 1))


def test_a_compiled_step_trains_under_ddp(tmp_path: Path) -> None:
    # The DDP wrapper's forward compiled (its graph split at the gradient buckets).
    _ok(_launch(tmp_path, "--epochs", "2", "--compile", "aot_eager", timeout=300))
    s0, s1 = _summary(tmp_path, 0), _summary(tmp_path, 1)
    assert s0["step"] == s1["step"] == 2 * 16
    assert s0["accuracy"] >= 0.9
    weights = _weights(tmp_path, 0)
    assert _same(weights, _weights(tmp_path, 1))
    assert not [key for key in weights if "_orig_mod" in key or "module." in key]


def test_a_compiled_forward_target_trains_as_eager_under_ddp(tmp_path: Path) -> None:
    # compile={"target": "forward"}: the module's call compiled inside the DDP wrapper,
    # the step, the loss and the optimizer step eager.
    target, plain = tmp_path / "target", tmp_path / "plain"
    args = ("--epochs", "1", "--compile", "aot_eager", "--compile-target", "forward")
    _ok(_launch(target, *args, timeout=300))
    _ok(_launch(plain, "--epochs", "1"))
    compiled = _weights(target, 0)
    assert _same(compiled, _weights(target, 1))
    assert not [key for key in compiled if "_orig_mod" in key or "module." in key]
    for key, value in _weights(plain, 0).items():
        torch.testing.assert_close(compiled[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_rerun_into_a_shared_checkpoint_folder_is_refused_on_every_rank(tmp_path: Path) -> None:
    # The ranks' shards share one folder: a second run that does not resume from it is
    # refused (not allowed to overwrite the first run's checkpoints), on every rank, and
    # the job comes down at once rather than when a collective times out.
    args = ("--epochs", "1", "--ckpt", "8", "--sharded", "--timeout", "600")
    _ok(_launch(tmp_path, *args))
    proc = _launch(tmp_path, *args, timeout=120)
    assert proc.returncode != 0
    assert "exist_ok=True" in proc.stdout + proc.stderr


def test_a_failing_rank_brings_the_job_down(tmp_path: Path) -> None:
    # The process group's timeout is longer than the launch's deadline: a job that came
    # down only once the other rank's collective timed out would miss the deadline. The
    # failure is passed on, not waited out.
    proc = _launch(
        tmp_path, "--raise-rank", "1", "--raise-at", "5", "--timeout", "600", timeout=120
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "boom on rank 1 at step 5" in output
    assert not any(text in output for text in TIMED_OUT), output[-4000:]
    assert not (tmp_path / "summary_rank0.json").exists()


@pytest.mark.slow
def test_a_hung_rank_times_the_others_out(tmp_path: Path) -> None:
    proc = _launch(tmp_path, "--hang-rank", "1", "--hang-at", "5", "--timeout", "5", timeout=90)
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
def test_killed_job_resumes_bit_identical(tmp_path: Path, kill_at: str) -> None:
    _kill_and_resume(tmp_path, kill_at)


@pytest.mark.slow
def test_killed_job_with_a_stateful_loader_resumes_bit_identical(tmp_path: Path) -> None:
    """torchdata's StatefulDataLoader stays stateful under DDP (sharded by loopbus): the
    checkpoint holds its position, and the resumed job continues from there."""
    pytest.importorskip("torchdata")
    _kill_and_resume(tmp_path, "25", "--loader", "stateful")
    (last,) = (tmp_path / "killed" / "ckpt_rank0").glob("*.ckpt")
    assert loopbus.load_checkpoint(last)["data/train"]["position"] is not None


def _kill_and_resume(tmp_path: Path, kill_at: str, *options: str) -> None:
    full, killed = tmp_path / "full", tmp_path / "killed"
    common = ("--epochs", "2", "--ckpt", "10", *options)
    _ok(_launch(full, *common))
    proc = _launch(killed, *common, "--kill-at", kill_at)
    assert proc.returncode != 0
    assert not (killed / "summary_rank0.json").exists()
    _ok(_launch(killed, *common, "--resume"))
    for rank in (0, 1):
        assert _same(_weights(full, rank), _weights(killed, rank))
    assert _summary(killed, 0)["step"] == _summary(full, 0)["step"] == 32


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
