"""ThroughputMonitor: its FLOPs equal FlopCounterMode's count, MFU is FLOP/s over the
peak, records appear every N steps under ``throughput/...``, the user's counting
functions drive the rates, training is unchanged, bad options are refused; and under
torchrun (two ranks, gloo) the rates are world totals."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

import loopbus
from loopbus import HandlerError, MisconfigurationError, Plugin, PutRecord, Trainer, on
from loopbus.plugins.tuning import ThroughputMonitor, peak_flops
from tests.helpers import ROOT

SCRIPT = Path(__file__).resolve().parent / "_throughput_script.py"
B, N_IN, N_OUT = 16, 64, 32
FORWARD = 2 * B * N_IN * N_OUT  # one (16 x 64) @ (64 x 32) product


class Records(Plugin):
    delivery = loopbus.Delivery(destination="loggers")

    def __init__(self) -> None:
        self.seen: list[PutRecord] = []

    @on(PutRecord)
    def keep(self, record: PutRecord) -> None:
        self.seen.append(record)

    def of(self, name: str) -> list[tuple[int, float]]:
        return [(r.step, r.value) for r in self.seen if r.name == name]

    def names(self) -> set[str]:
        return {r.name for r in self.seen if r.name.startswith("throughput/")}


class Linear(loopbus.Module):
    """Linear(64, 32) and a mean squared error; ``input_grad`` makes the input need a
    gradient too, so backward computes the input's gradient as well as the weight's."""

    def __init__(self, input_grad: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(N_IN, N_OUT)
        self.input_grad = input_grad

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        if self.input_grad:
            x = x.detach().requires_grad_(True)
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def validation_step(self, batch: Any, ctx: Any) -> None:
        time.sleep(0.5)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def loader(n: int = 20 * B, seed: int = 0) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, N_IN, generator=g), torch.randn(n, N_OUT, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=B)


def counted(module: Linear, batch: Any) -> int:
    """FlopCounterMode's own count of one forward and backward of ``module`` on ``batch``."""
    with FlopCounterMode(display=False) as counter:
        module.training_step(batch, None).backward()  # type: ignore[no-untyped-call]
    return int(counter.get_total_flops())


@pytest.mark.parametrize(("input_grad", "analytic"), [(False, 2 * FORWARD), (True, 3 * FORWARD)])
async def test_flops_per_step_and_mfu(input_grad: bool, analytic: int) -> None:
    # Forward 2*16*64*32; backward the weight's gradient (as much again) and, when the
    # input needs one, the input's (backward twice the forward).
    reference = counted(Linear(input_grad), next(iter(loader())))
    assert reference == analytic
    records = Records()
    monitor = ThroughputMonitor(every_n_steps=5, peak_flops=1e12)
    trainer = Trainer(max_steps=10, plugins=[records, monitor], device="cpu")
    await trainer.fit(Linear(input_grad), loader())
    assert monitor.flops_per_step == pytest.approx(reference, rel=0.01)
    assert [step for step, _ in records.of("throughput/flops_per_step")] == [5, 10]
    assert all(v == pytest.approx(reference, rel=0.01) for _, v in records.of("throughput/flops_per_step"))
    flops_per_sec = dict(records.of("throughput/flops_per_sec"))
    batches_per_sec = dict(records.of("throughput/batches_per_sec"))
    for step, mfu in records.of("throughput/mfu"):
        assert mfu == pytest.approx(flops_per_sec[step] / 1e12, rel=1e-12)
        assert flops_per_sec[step] == pytest.approx(reference * batches_per_sec[step], rel=1e-12)
        assert 0 < mfu < 1


async def test_records_every_n_steps_with_their_names() -> None:
    records = Records()
    trainer = Trainer(
        max_steps=12, plugins=[records, ThroughputMonitor(every_n_steps=4)], device="cpu"
    )
    await trainer.fit(Linear(), loader())
    # On CPU there is no table entry, so no MFU without peak_flops; no items without items=.
    assert records.names() == {
        "throughput/samples_per_sec",
        "throughput/batches_per_sec",
        "throughput/flops_per_step",
        "throughput/flops_per_sec",
    }
    for name in records.names():
        assert [step for step, _ in records.of(name)] == [4, 8, 12]
        assert all(v > 0 for _, v in records.of(name))
    assert {frozenset(r.destinations) for r in records.seen if r.name in records.names()} == {
        frozenset({"loggers", "external"})
    }
    assert trainer.latest["throughput/samples_per_sec"].step == 12


async def test_every_n_steps_counts_optimizer_steps_under_accumulation() -> None:
    records = Records()
    monitor = ThroughputMonitor(every_n_steps=2, destinations="loggers")
    trainer = Trainer(
        max_steps=6, accumulate_grad_batches=2, plugins=[records, monitor], device="cpu"
    )
    await trainer.fit(Linear(), loader())
    assert [step for step, _ in records.of("throughput/batches_per_sec")] == [2, 4, 6]
    # Four batches (two optimizer steps) per window; FLOPs are one batch's.
    for (_, samples), (_, batches) in zip(
        records.of("throughput/samples_per_sec"), records.of("throughput/batches_per_sec"), strict=True
    ):
        assert samples == pytest.approx(B * batches, rel=1e-12)
    assert monitor.flops_per_step == 2 * FORWARD


async def test_rates_use_the_samples_and_items_functions() -> None:
    records = Records()
    monitor = ThroughputMonitor(
        samples=lambda batch: 3 * len(batch[0]),
        items=lambda batch: batch[0].numel() + 7,
        every_n_steps=5,
    )
    trainer = Trainer(max_steps=10, plugins=[records, monitor], device="cpu")
    await trainer.fit(Linear(), loader())
    batches = dict(records.of("throughput/batches_per_sec"))
    assert set(batches) == {5, 10}
    for step, samples in records.of("throughput/samples_per_sec"):
        assert samples == pytest.approx(3 * B * batches[step], rel=1e-12)
    for step, items in records.of("throughput/items_per_sec"):
        assert items == pytest.approx((B * N_IN + 7) * batches[step], rel=1e-12)
    assert monitor.latest["items_per_sec"] == records.of("throughput/items_per_sec")[-1][1]


async def test_default_samples_is_the_first_tensors_first_dimension() -> None:
    class Dicts(Linear):
        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            return super().training_step((batch["inputs"]["x"], batch["y"]), ctx)

    x, y = torch.randn(4 * 6, N_IN), torch.randn(4 * 6, N_OUT)
    data = [{"meta": "no tensor", "inputs": {"x": x[i : i + 6]}, "y": y[i : i + 6]} for i in range(0, 24, 6)]
    monitor = ThroughputMonitor(every_n_steps=4)
    trainer = Trainer(max_steps=4, plugins=[monitor], device="cpu")
    await trainer.fit(Dicts(), data)
    assert monitor.latest["samples_per_sec"] == pytest.approx(6 * monitor.latest["batches_per_sec"])


async def test_validation_time_is_not_counted() -> None:
    # Each validation sleeps half a second; five tiny steps take milliseconds, so a
    # window that counted the validation would report well under 5 * 16 / 0.5 = 160/s.
    records = Records()
    trainer = Trainer(
        max_steps=10, val_check_interval=5, limit_val_batches=1, num_sanity_val_steps=0,
        plugins=[records, ThroughputMonitor(every_n_steps=5)], device="cpu",
    )
    await trainer.fit(Linear(), loader(), loader(n=B))
    rates = [v for _, v in records.of("throughput/samples_per_sec")]
    assert len(rates) == 2
    assert min(rates) > 4 * 160


def _train(seed: int, plugins: list[Plugin]) -> dict[str, torch.Tensor]:
    class Net(loopbus.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(N_IN, 48), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                torch.nn.Linear(48, N_OUT),
            )

        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    loopbus.seed_everything(seed)
    module = Net()
    trainer = Trainer(max_epochs=2, plugins=plugins, device="cpu", num_sanity_val_steps=0)
    trainer.fit(module, loader(n=8 * B))
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_training_is_unchanged_by_the_monitor() -> None:
    monitor = ThroughputMonitor(every_n_steps=3, items=lambda b: b[0].numel())
    without = _train(1, [])
    with_monitor = _train(1, [monitor])
    assert monitor.flops_per_step is not None
    assert monitor.flops_per_step > 0
    assert without.keys() == with_monitor.keys()
    assert all(torch.equal(without[k], with_monitor[k]) for k in without)


async def test_thread_executor_leaves_flops_unmeasured_unless_given() -> None:
    # FlopCounterMode is thread-local: a step run in a worker thread is not counted, so
    # nothing is reported rather than zero; flops_per_step= supplies the figure instead.
    records = Records()
    monitor = ThroughputMonitor(every_n_steps=5)
    trainer = Trainer(max_steps=5, executor="thread", plugins=[records, monitor], device="cpu")
    with pytest.warns(UserWarning, match=r"executor='thread'.*flops_per_step=") as said:
        await trainer.fit(Linear(), loader())
    assert len([w for w in said if "FlopCounterMode" in str(w.message)]) == 1  # once
    assert monitor.flops_per_step is None
    assert records.names() == {"throughput/samples_per_sec", "throughput/batches_per_sec"}

    given = ThroughputMonitor(every_n_steps=5, flops_per_step=1e6, peak_flops=1e9)
    trainer = Trainer(max_steps=5, executor="thread", plugins=[given], device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # given, nothing is missing: no warning
        await trainer.fit(Linear(), loader())
    assert given.latest["flops_per_step"] == 1e6
    assert given.latest["mfu"] == pytest.approx(given.latest["flops_per_sec"] / 1e9)


def test_peak_table_by_device_name_and_dtype() -> None:
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989.5e12
    assert peak_flops("NVIDIA H100 PCIe", torch.float16) == 756.5e12
    assert peak_flops("NVIDIA H100 NVL", "tf32") == 417.5e12
    assert peak_flops("NVIDIA H200", torch.bfloat16) == 989.5e12
    assert peak_flops("NVIDIA A100-SXM4-80GB", "tf32") == 156e12
    assert peak_flops("NVIDIA A100 80GB PCIe", torch.float32) == 19.5e12
    assert peak_flops("NVIDIA A10G", torch.bfloat16) == 125e12
    assert peak_flops("NVIDIA L4", torch.bfloat16) == 121e12
    assert peak_flops("NVIDIA L40S", torch.bfloat16) == 362.05e12
    assert peak_flops("NVIDIA GeForce RTX 4090", torch.float16) == 165.2e12
    assert peak_flops("Tesla V100-SXM2-16GB", torch.float16) == 125e12
    assert peak_flops("Tesla V100-PCIE-32GB", "tf32") == 14e12  # no TF32: FP32
    assert peak_flops("Tesla T4", torch.bfloat16) is None  # no bf16 tensor cores
    assert peak_flops("NVIDIA L40", torch.bfloat16) is None  # not L4, not L40S
    assert peak_flops("Some CPU", torch.float32) is None
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.float64) is None


def test_all_reduce_host_in_one_process() -> None:
    strategy = loopbus.SingleProcess()
    assert strategy.all_reduce_host([1, 2.5], "max") == [1.0, 2.5]
    with pytest.raises(MisconfigurationError, match="op"):
        strategy.all_reduce_host([1.0], "mean")  # type: ignore[arg-type]


def test_samples_are_summed_over_data_parallel_replicas() -> None:
    """Under tensor parallelism the peers of a replica read the same batch: the world's
    samples are the replicas' (4 ranks in 2 replicas, each rank 100 samples/s), while
    each rank's FLOPs are its own."""
    from types import SimpleNamespace

    from loopbus.plugins.tuning._throughput import _world

    class FourRanksTwoReplicas(loopbus.SingleProcess):
        world_size = 4
        data_parallel_size = 2  # type: ignore[assignment]

        def all_reduce_host(self, values: Any, op: Any = "sum") -> list[float]:
            return [4 * float(v) for v in values]

    trainer: Any = SimpleNamespace(world_size=4, strategy=FourRanksTwoReplicas())
    world = _world(trainer, {"samples_per_sec": 100.0, "flops_per_sec": 10.0})
    assert world == {"samples_per_sec": 200.0, "flops_per_sec": 40.0}


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"every_n_steps": "10"}, "every_n_steps"),
        ({"peak_flops": 0}, "peak_flops"),
        ({"peak_flops": float("nan")}, "peak_flops"),
        ({"peak_flops": float("inf")}, "peak_flops"),
        ({"flops_per_step": -1}, "flops_per_step"),
        ({"samples": 16}, "samples"),
        ({"items": "tokens"}, "items"),
        ({"destinations": []}, "destinations"),
    ],
)
def test_bad_options_are_refused(options: dict[str, Any], match: str) -> None:
    with pytest.raises(MisconfigurationError, match=match):
        ThroughputMonitor(**options)


async def test_a_bad_count_names_the_function() -> None:
    monitor = ThroughputMonitor(items=lambda batch: -1)
    trainer = Trainer(max_steps=2, plugins=[monitor], device="cpu")
    with pytest.raises(HandlerError, match=r"items=\.\.\.\) must return a count") as info:
        await trainer.fit(Linear(), loader())
    assert isinstance(info.value.original, MisconfigurationError)

    class Words(Linear):
        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            return self.layer.weight.square().sum()

    trainer = Trainer(max_steps=2, plugins=[ThroughputMonitor()], device="cpu")
    with pytest.raises(HandlerError, match="found no tensor in the batch"):
        await trainer.fit(Words(), [(["no", "tensor"], None)] * 2)


# ------------------------------------------------------------ two ranks (torchrun, gloo)
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.external
@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
def test_two_ranks_sum_their_samples(tmp_path: Path) -> None:
    env = dict(os.environ)
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, env["PYTHONPATH"]]) if env.get("PYTHONPATH") else src
    env["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        f"--master_port={_free_port()}", str(SCRIPT), str(tmp_path),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["world_size"] == r1["world_size"] == 2
    # Every window's world figures: the same on both ranks, the sum of the ranks' rates
    # (rank 1 counts 3 samples per row, rank 0 one), MFU and FLOPs per step their mean.
    assert r0["latest"] == r1["latest"]
    assert len(r0["windows"]) == 2
    assert [w[0] for w in r0["windows"]] == [w[0] for w in r1["windows"]] == [4, 8]
    for (_, w0, d0), (_, _, d1) in zip(r0["windows"], r1["windows"], strict=True):
        for name in ("samples_per_sec", "batches_per_sec", "flops_per_sec"):
            assert w0[name] == pytest.approx(d0[name] + d1[name], rel=1e-9)
        assert w0["mfu"] == pytest.approx((d0["mfu"] + d1["mfu"]) / 2, rel=1e-9)
        assert d0["samples_per_sec"] == pytest.approx(8 * d0["batches_per_sec"], rel=1e-9)
        assert d1["samples_per_sec"] == pytest.approx(24 * d1["batches_per_sec"], rel=1e-9)
        assert w0["flops_per_step"] == d0["flops_per_step"] == d1["flops_per_step"]


class _FakeEvent:
    """A stand-in for ``torch.cuda.Event``: done once the fake device clock passes it."""

    clock = 0.0
    done_until = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        self.at = -1.0

    def record(self, stream: Any = None) -> None:
        self.at = _FakeEvent.clock

    def query(self) -> bool:
        return self.at <= _FakeEvent.done_until

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.query(), "read before the start event completed"
        assert end.query(), "read before the end event completed"
        return end.at - self.at


def test_device_time_is_read_back_only_once_complete(monkeypatch: pytest.MonkeyPatch) -> None:
    # The CUDA path without a GPU (the fake events above): each step's end event is read
    # only once query() says it completed, never waited for; the window's figure is the
    # mean of the steps read so far. Host time is counted at once.
    monkeypatch.setattr(_FakeEvent, "clock", 0.0)
    monkeypatch.setattr(_FakeEvent, "done_until", -1.0)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monitor = ThroughputMonitor()
    monitor._cuda = torch.device("cuda", 0)
    monitor._t0 = 0.0
    for step in range(4):  # device steps of 2, 4, 6, 8 ms
        monitor._cuda_step_started()
        _FakeEvent.clock += 2.0 * (step + 1)
        monitor._cuda_step_completed()
        _FakeEvent.clock += 0.5
        if step == 1:
            _FakeEvent.done_until = _FakeEvent.clock  # the first two steps are done
    assert len(monitor._pending) == 2
    window = monitor._window()
    assert window["device_ms_per_step"] == pytest.approx((2 + 4) / 2)
    assert window["host_ms_per_step"] >= 0
    _FakeEvent.done_until = _FakeEvent.clock
    monitor._cuda_step_started()
    _FakeEvent.clock += 1.0
    monitor._cuda_step_completed()  # reads the two late steps; its own end is not done
    assert monitor._window()["device_ms_per_step"] == pytest.approx((6 + 8) / 2)
