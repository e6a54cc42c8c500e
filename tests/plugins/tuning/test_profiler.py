"""The Profiler plugin: traces per rank with the engine's phases and the model's ops, the
schedule, the summary, and the engine's ranges switched on only inside the window."""

from __future__ import annotations

import io
import json
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from rich.console import Console

import loopbus
from loopbus import MisconfigurationError, Trainer
from loopbus.plugins import Checkpoint
from loopbus.plugins.tuning import Profiler
from tests.helpers import ROOT, TinyModule, make_loader

PHASES = (
    "loopbus.data_fetch",
    "loopbus.step",
    "loopbus.put_flush",
    "loopbus.boundary",
    "loopbus.validation",
    "loopbus.checkpoint",
)


class Watched(TinyModule):
    """Notes, for each training batch, whether the engine's ranges were on."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.ranges: list[bool] = []
        self.fail_at = fail_at

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        if len(self.ranges) == self.fail_at:
            raise RuntimeError("boom")
        self.ranges.append(loopbus.profiling_ranges())
        return super().training_step(batch, ctx)


def names_in(path: Path) -> set[str]:
    trace = json.loads(path.read_text(encoding="utf-8"))
    return {str(event.get("name")) for event in trace["traceEvents"]}


def found(folder: Path, pattern: str) -> list[Path]:
    return sorted(folder.glob(pattern))


def step_markers(names: set[str]) -> list[int]:
    return sorted(int(n.split("#")[1]) for n in names if n.startswith("ProfilerStep#"))


async def test_traces_hold_the_phases_and_ops_of_the_active_batches(tmp_path: Path) -> None:
    out = io.StringIO()
    profiler = Profiler(
        tmp_path / "prof", wait=1, warmup=1, active=2, console=Console(file=out, width=200)
    )
    trainer = Trainer(
        max_epochs=2,
        plugins=[profiler, Checkpoint(tmp_path / "ckpt", every_n_steps=1)],
        device="cpu",
        yield_interval_s=0,  # yield after every step: the boundary shows in each
        num_sanity_val_steps=0,
    )
    module = Watched()
    # 3 batches an epoch: epoch 0's validation runs between batches 2 and 3.
    await trainer.fit(module, make_loader(n=48), make_loader(n=32))

    # The schedule: batches 0 (wait) and 1 (warmup) are not recorded, 2 and 3 are; the
    # engine's ranges are on exactly while they run.
    assert module.ranges == [False, False, True, True, False, False]
    assert loopbus.profiling_ranges() is False
    chrome = tmp_path / "prof" / "rank0.batches2-3.trace.json"
    boards = found(tmp_path / "prof" / "tensorboard", "rank0.*.pt.trace.json")
    assert chrome.is_file()
    assert len(boards) == 1
    for path in (chrome, boards[0]):
        names = names_in(path)
        # Two steps recorded; the markers count from the window's warmup batch (#0).
        assert step_markers(names) == [1, 2]
        assert set(PHASES) <= names, set(PHASES) - names
        assert "aten::addmm" in names
    assert profiler.summary is not None
    assert profiler.summary.batches == (2, 3)
    assert profiler.summary.traces == (chrome,)
    phases = {row.name: row for row in profiler.summary.phases}
    assert set(PHASES) <= set(phases)
    assert phases["loopbus.step"].calls == 2
    assert phases["loopbus.validation"].calls == 1
    assert 0 < phases["loopbus.step"].cpu_ms <= profiler.summary.step_ms
    ops = [row.name for row in profiler.summary.ops]
    assert "aten::addmm" in ops
    assert not any(n.startswith(("loopbus.", "ProfilerStep")) for n in ops)
    summary = (tmp_path / "prof" / "summary.rank0.txt").read_text(encoding="utf-8")
    assert "Engine phases" in summary
    assert "Top ops by self CPU time" in summary
    for name in (*PHASES, "aten::addmm"):
        assert name in summary
    printed = out.getvalue()
    assert "Engine phases" in printed
    assert "loopbus.step" in printed


async def test_repeated_windows_each_write_a_trace(tmp_path: Path) -> None:
    profiler = Profiler(tmp_path, wait=1, warmup=1, active=1, repeat=2, skip_first=1)
    module = Watched()
    trainer = Trainer(max_epochs=1, plugins=[profiler], device="cpu", num_sanity_val_steps=0)
    await trainer.fit(module, make_loader(n=160))  # 10 batches
    # skip 1, then (wait, warmup, active) twice: batches 3 and 6 are recorded.
    assert module.ranges == [i in (3, 6) for i in range(10)]
    traces = found(tmp_path, "rank0.*.trace.json")
    assert [p.name for p in traces] == ["rank0.batches3-3.trace.json", "rank0.batches6-6.trace.json"]
    assert [step_markers(names_in(p)) for p in traces] == [[1], [1]]
    assert len(found(tmp_path / "tensorboard", "rank0.*.pt.trace.json")) == 2
    assert profiler.summary is not None
    assert profiler.summary.batches == (3, 6)
    assert loopbus.profiling_ranges() is False


async def test_a_run_shorter_than_the_window_writes_what_it_recorded(tmp_path: Path) -> None:
    profiler = Profiler(tmp_path, wait=0, warmup=1, active=10)
    module = Watched()
    trainer = Trainer(max_epochs=1, plugins=[profiler], device="cpu", num_sanity_val_steps=0)
    await trainer.fit(module, make_loader(n=64))  # 4 batches: 1..3 recorded, window cut short
    assert module.ranges == [False, True, True, True]
    # The last marker holds what ran after the last batch (the end of the epoch and fit).
    assert step_markers(names_in(tmp_path / "rank0.batches1-3.trace.json")) == [1, 2, 3, 4]
    assert profiler.summary is not None
    assert profiler.summary.batches == (1, 2, 3)
    assert loopbus.profiling_ranges() is False


async def test_the_thread_executor_s_ops_are_recorded(tmp_path: Path) -> None:
    profiler = Profiler(tmp_path, wait=0, warmup=1, active=2)
    trainer = Trainer(
        max_epochs=1, plugins=[profiler], device="cpu", executor="thread", num_sanity_val_steps=0
    )
    await trainer.fit(TinyModule(), make_loader(n=64))
    names = names_in(tmp_path / "rank0.batches1-2.trace.json")
    assert "aten::addmm" in names  # run in the worker thread
    assert {"loopbus.data_fetch", "loopbus.put_flush"} <= names
    assert loopbus.profiling_ranges() is False


async def test_no_window_reached_records_nothing(tmp_path: Path) -> None:
    profiler = Profiler(tmp_path, wait=10, warmup=1, active=1)
    module = Watched()
    trainer = Trainer(max_epochs=1, plugins=[profiler], device="cpu", num_sanity_val_steps=0)
    await trainer.fit(module, make_loader(n=64))
    assert module.ranges == [False] * 4
    assert not found(tmp_path, "*.json")
    assert profiler.summary is not None
    assert profiler.summary.batches == ()
    assert "no batch was profiled" in (tmp_path / "summary.rank0.txt").read_text(encoding="utf-8")


async def test_the_ranges_are_off_after_a_failed_run(tmp_path: Path) -> None:
    profiler = Profiler(tmp_path, wait=1, warmup=1, active=3)
    module = Watched(fail_at=3)  # fails inside the window, with the ranges on
    trainer = Trainer(max_epochs=1, plugins=[profiler], device="cpu", num_sanity_val_steps=0)
    with pytest.raises(RuntimeError, match="boom"):
        await trainer.fit(module, make_loader(n=96))
    assert module.ranges == [False, False, True]
    assert loopbus.profiling_ranges() is False
    assert found(tmp_path, "rank0.batches2-*.trace.json")  # the window so far


async def test_engine_ranges_only_while_switched_on(tmp_path: Path) -> None:
    """A user's own torch profiler sees the engine's phases only with the switch on."""

    async def profiled() -> set[str]:
        trainer = Trainer(max_epochs=1, plugins=[], device="cpu", yield_interval_s=0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            await trainer.fit(TinyModule(), make_loader(n=32), make_loader(n=16))
        return {event.key for event in prof.key_averages()}

    off = await profiled()
    assert "aten::addmm" in off
    assert not [name for name in off if name.startswith("loopbus.")]
    assert loopbus.profiling_ranges(True) is False
    try:
        on = await profiled()
    finally:
        assert loopbus.profiling_ranges(False) is True
    assert {"loopbus.data_fetch", "loopbus.step", "loopbus.validation"} <= on
    assert loopbus.profiling_ranges() is False


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dirpath": "s3://bucket/profile"}, r"dirpath='s3://bucket/profile'.*is a URL"),
        ({"dirpath": None}, r"dirpath=None\) must be the folder"),
        ({"dirpath": ""}, r"dirpath=''\) must be the folder"),
        ({"active": 0}, r"active"),
        ({"wait": -1}, r"wait"),
        ({"warmup": 1.5}, r"warmup"),
        ({"repeat": "all"}, r"repeat"),
        ({"skip_first": True}, r"skip_first"),
        ({"row_limit": 0}, r"row_limit"),
        ({"record_shapes": "yes"}, r"record_shapes='yes'\) must be True or False"),
        ({"profile_memory": 1}, r"profile_memory=1\) must be True or False"),
        ({"oom_snapshot": None}, r"oom_snapshot=None\) must be True or False"),
        ({"console": io.StringIO()}, r"console=.*must be a rich.console.Console"),
    ],
)
def test_bad_options_are_refused(tmp_path: Path, options: dict[str, Any], message: str) -> None:
    options = {"dirpath": tmp_path, **options}
    with pytest.raises(MisconfigurationError, match=message):
        Profiler(**options)


def test_the_switch_refuses_a_non_bool() -> None:
    with pytest.raises(MisconfigurationError, match="profiling_ranges"):
        loopbus.profiling_ranges(1)  # type: ignore[arg-type]
    assert loopbus.profiling_ranges() is False


# ------------------------------------------------------------ two ranks (torchrun, gloo)
SCRIPT = """
import sys
import loopbus
from loopbus import Trainer
from loopbus.plugins.tuning import Profiler
from tests.helpers import TinyModule, make_loader

profiler = Profiler(sys.argv[1], wait=1, warmup=1, active=2)
trainer = Trainer(max_epochs=1, plugins=[profiler], device="cpu", strategy="ddp")
trainer.fit(TinyModule(), make_loader(n=128))
assert profiler.summary.rank == trainer.global_rank, profiler.summary
assert profiler.summary.batches == (2, 3), profiler.summary
assert loopbus.profiling_ranges() is False
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.external
@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_each_rank_writes_its_own_traces(tmp_path: Path) -> None:
    script = tmp_path / "profile_ranks.py"
    script.write_text(textwrap.dedent(SCRIPT), encoding="utf-8")
    env = dict(os.environ)
    paths = [str(ROOT / "src"), str(ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    out = tmp_path / "prof"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        f"--master_port={_free_port()}", str(script), str(out),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    for rank in (0, 1):
        names = names_in(out / f"rank{rank}.batches2-3.trace.json")
        assert step_markers(names) == [1, 2]
        assert {"loopbus.step", "loopbus.data_fetch", "aten::addmm"} <= names
        assert len(list((out / "tensorboard").glob(f"rank{rank}.*.pt.trace.json"))) == 1
        summary = (out / f"summary.rank{rank}.txt").read_text(encoding="utf-8")
        assert re.search(rf"on rank {rank}\b", summary)
        assert "loopbus.step" in summary
