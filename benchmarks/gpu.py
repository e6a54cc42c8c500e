"""The CUDA data path: copies against compute, put without host syncs, GPU busy fraction.

Needs a CUDA device (without one it exits at once with status 2). Four sections, all
by default, one with ``--only``:

* ``copy``: batches large enough that their host-to-device copy takes about as long as
  the step's compute. The copy time of one batch from pinned memory and the step time of
  a matmul chain on a device-resident batch are measured with CUDA events, and the
  chain's depth is chosen so the two match (both are printed). Four loops do the same
  work: the hand-written loop with ``.to(device)`` then the step (~ copy + compute), the
  hand-written loop with ``.to(device, non_blocking=True)`` from pinned memory (no side
  stream: the copy still queues on the compute stream, ~ copy + compute), loopbus with
  ``device_prefetch=0`` and loopbus with ``device_prefetch=1`` (batch k+1 copied on a
  side stream while step k computes; target <= 1.05x max(copy, compute)). Before timing,
  the non-blocking hand-written loop and loopbus ``device_prefetch=1`` train 20 steps
  and their weights are compared.
* ``put``: the same model on device-resident batches, loopbus with ``device_prefetch=1``
  and an inline ``PutRecord`` subscriber; the step takes eight scalars (the loss and
  seven elements of the output, views: no kernel of their own) and either puts them (``put_lag`` default, and ``put_lag=0``: a host sync per step, for contrast)
  or not. Target: 8 puts within 2 % of none at the default ``put_lag``. Every record is
  counted.
* ``cnn``: a small CNN on the scikit-learn digits images upscaled to 3x224x224 (one
  ``interpolate`` on the host at start; the images stay on the host), batch 256, from
  pinned and from unpinned host tensors (pre-sliced batches, no collate): the
  hand-written loop (``.to(device)``), the same with ``.to(device, non_blocking=True)``,
  loopbus ``device_prefetch=1``, and loopbus ``device_prefetch=1, prefetch=1`` (a worker
  thread pins unpinned batches). Step time, and from one profiled run per loop the GPU
  busy fraction and the host syncs per step.

* ``calls``: the deterministic figure of the CUDA path, Python-level calls per step
  (``call`` + ``c_call`` profile events, as ``benchmarks/overhead.py`` counts them on
  the CPU) that loopbus adds over a hand-written loop, on a host-bound 4-layer chain
  (width 256, batch 64) from pinned host batches: loopbus ``device_prefetch=1`` with
  and without eight puts, against the hand-written loop that copies each batch with
  ``.to(device, non_blocking=True)`` and computes the same eight scalars without
  keeping them. Counted over runs of N and 2N steps (``--calls-steps``) so start-up
  cancels, with yields to the event loop switched off (time-based, so not
  deterministic); only the event loop's thread is counted.

Timing. Every loop is timed as whole runs: ``torch.cuda.synchronize()`` before and
after a run, never inside one. Each loop runs ``N`` and ``2N`` steps in every round and
its step time is ``(t(2N) - t(N)) / N``, so start-up (building the trainer, the first
copy) cancels. Rounds rotate the order of the loops; each figure is the median over
the rounds of that round's ratio (for ``copy``, to that round's own max(copy,
compute), measured again at the round's start).

GPU busy fraction (``cnn``). One run of ``--profile-steps`` steps per loop under
``torch.profiler.profile(activities=[CPU, CUDA])``, after the timed rounds. From the
device-side events (``FunctionEvent.device_type == DeviceType.CUDA``: kernels, and
``Memcpy ...`` / ``Memset ...`` copies) the window is the span from the first device
activity to the last; "busy" is the length of the union of all device intervals over
that span, "kernels" and "memcpy" the unions of each kind alone, and "both at once"
the time a copy and a kernel ran together (kernels + memcpy - their union: the overlap
a side-stream copy buys). Summing event durations instead would count overlapped time
twice. Host syncs per step count the CUDA runtime calls named ``cuda*Synchronize`` in
the same run (the final ``torch.cuda.synchronize()`` of the profiled run is one of
them). The profiler slows the host side, so profiled runs are slower than timed ones;
the fractions compare the loops with each other.

    ./dev bench gpu                                  # all three sections
    ./dev bench gpu --only copy                      # 64 MiB batches, calibrated chain
    ./dev bench gpu --only copy --batch-mb 128 --steps 300 --rounds 7
    ./dev bench gpu --only put
    ./dev bench gpu --only cnn --cnn-steps 60 --profile-steps 30
    ./dev bench gpu --only calls
"""

from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from _harness import count_calls
from torch.nn import functional as F

import loopbus
from loopbus import Module, Plugin, Trainer, on
from loopbus.events import PutRecord

SECTIONS = ("copy", "put", "cnn", "calls")
MIB = 1 << 20


# ============================================================ harness (no CUDA needed)
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", choices=SECTIONS, action="append", help="run only this section (repeatable)"
    )
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument(
        "--steps", type=int, default=200, help="N for copy and put: runs of N and 2N steps"
    )
    parser.add_argument("--batch-mb", type=float, default=64.0, help="copy/put batch size, MiB")
    parser.add_argument("--width", type=int, default=1024, help="width of the matmul chain")
    parser.add_argument(
        "--work-rows", type=int, default=1024, help="rows the chain works on (batch folded)"
    )
    parser.add_argument("--depth", type=int, default=None, help="chain depth (default: calibrated)")
    parser.add_argument("--pool", type=int, default=4, help="distinct host batches, cycled")
    parser.add_argument("--cnn-steps", type=int, default=60, help="N for cnn")
    parser.add_argument("--cnn-batch", type=int, default=256)
    parser.add_argument("--profile-steps", type=int, default=30, help="steps profiled (cnn)")
    parser.add_argument("--calls-steps", type=int, default=100, help="N for calls")
    args = parser.parse_args(argv)
    for name in (
        "rounds",
        "steps",
        "width",
        "work_rows",
        "pool",
        "cnn_steps",
        "cnn_batch",
        "calls_steps",
    ):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.batch_mb <= 0:
        parser.error("--batch-mb must be > 0")
    if args.depth is not None and args.depth < 1:
        parser.error("--depth must be >= 1")
    if args.profile_steps < 1:
        parser.error("--profile-steps must be >= 1")
    args.sections = tuple(s for s in SECTIONS if args.only is None or s in args.only)
    return args


def batch_rows(batch_mb: float, width: int, work_rows: int) -> int:
    """Rows of a float32 batch of about ``batch_mb`` MiB and ``width`` columns, a whole
    multiple of ``work_rows`` (the chain folds the batch onto ``work_rows`` rows)."""
    rows = batch_mb * MIB / (4 * width)
    return max(1, round(rows / work_rows)) * work_rows


def depth_for(target_s: float, d1: int, t1: float, d2: int, t2: float, cap: int = 4096) -> int:
    """The chain depth whose step takes ``target_s``, from step times ``t1`` at depth
    ``d1`` and ``t2`` at depth ``d2``, assuming time = base + depth * per_layer."""
    if d2 == d1:
        raise ValueError("two different depths are needed")
    per_layer = (t2 - t1) / (d2 - d1)
    if per_layer <= 0:  # noise swamped the layers: scale from the larger one
        d, t = (d2, t2) if d2 > d1 else (d1, t1)
        return max(1, min(cap, round(d * target_s / t))) if t > 0 else 1
    base = t1 - d1 * per_layer
    return max(1, min(cap, round((target_s - base) / per_layer)))


def rotated(names: Sequence[str], i: int) -> list[str]:
    """``names`` starting at position ``i`` (modulo), so rounds alternate the order."""
    k = i % len(names) if names else 0
    return list(names[k:]) + list(names[:k])


def steady_per_step(t_n: float, t_2n: float, n: int) -> float:
    """Step time from whole runs of ``n`` and ``2n`` steps (start-up cancels); the run
    of ``2n`` alone if noise made the difference non-positive."""
    diff = (t_2n - t_n) / n
    return diff if diff > 0 else t_2n / (2 * n)


def median_ratios(values: dict[str, list[float]], bounds: Sequence[float]) -> dict[str, float]:
    """Per loop, the median over rounds of ``value[round] / bounds[round]``."""
    return {
        name: statistics.median(v / b for v, b in zip(vs, bounds, strict=True))
        for name, vs in values.items()
    }


def median_ratio_to(values: dict[str, list[float]], reference: str) -> dict[str, float]:
    """Per loop, the median over rounds of its value over ``reference``'s that round."""
    ref = values[reference]
    return {name: median_ratios({name: vs}, ref)[name] for name, vs in values.items()}


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by ``(start, end)`` intervals (overlaps counted once)."""
    total = 0.0
    cur_start = cur_end = None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total


@dataclass(frozen=True)
class Busy:
    """GPU activity of a profiled run (times in microseconds)."""

    span_us: float
    busy_us: float
    kernel_us: float
    memcpy_us: float
    overlap_us: float
    syncs: int
    steps: int

    def line(self) -> str:
        if self.span_us <= 0:
            return "no device activity recorded"
        s = self.span_us
        return (
            f"busy {self.busy_us / s:6.1%}  kernels {self.kernel_us / s:6.1%}  "
            f"memcpy {self.memcpy_us / s:6.1%}  both at once {self.overlap_us / s:6.1%}  "
            f"syncs/step {self.syncs / self.steps:.2f}"
        )


def busy_from(
    device_events: Iterable[tuple[str, float, float]], sync_calls: int, steps: int
) -> Busy:
    """:class:`Busy` from device-side ``(name, start_us, end_us)`` events."""
    everything: list[tuple[float, float]] = []
    kernels: list[tuple[float, float]] = []
    copies: list[tuple[float, float]] = []
    for name, start, end in device_events:
        everything.append((start, end))
        if name.startswith("Memcpy"):
            copies.append((start, end))
        elif not name.startswith("Memset"):
            kernels.append((start, end))
    if not everything:
        return Busy(0.0, 0.0, 0.0, 0.0, 0.0, sync_calls, steps)
    span = max(e for _, e in everything) - min(s for s, _ in everything)
    kernel_us, memcpy_us = union_length(kernels), union_length(copies)
    overlap_us = kernel_us + memcpy_us - union_length(kernels + copies)
    return Busy(
        span_us=span,
        busy_us=union_length(everything),
        kernel_us=kernel_us,
        memcpy_us=memcpy_us,
        overlap_us=overlap_us,
        syncs=sync_calls,
        steps=steps,
    )


def print_table(title: str, per_step: dict[str, list[float]], extra: dict[str, str]) -> None:
    print(title)
    for name, values in per_step.items():
        print(f"  {name:<44} {statistics.median(values) * 1e3:8.3f} ms/step  {extra[name]}")


# ============================================================ CUDA helpers
def device_run(fn: Callable[[], Any]) -> float:
    """Wall seconds of ``fn()``, the device drained before and after (whole runs only)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def timed_rounds(
    runs: dict[str, Callable[[int], Any]],
    n: int,
    rounds: int,
    before_round: Callable[[int], None] | None = None,
) -> dict[str, list[float]]:
    """Per loop, its steady step time (s) in every round; the order rotates."""
    per_step: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(rounds):
        if before_round is not None:
            before_round(i)
        for name in rotated(list(runs), i):
            run = runs[name]
            t_n = device_run(functools.partial(run, n))
            t_2n = device_run(functools.partial(run, 2 * n))
            per_step[name].append(steady_per_step(t_n, t_2n, n))
    return per_step


def profiled_busy(run: Callable[[int], Any], steps: int) -> Busy:
    """Run ``steps`` steps under ``torch.profiler`` and measure GPU activity."""
    from torch.autograd import DeviceType  # type: ignore[attr-defined]
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(steps)
        torch.cuda.synchronize()
    device: list[tuple[str, float, float]] = []
    syncs = 0
    for event in prof.events():
        name = str(event.name)
        if event.device_type == DeviceType.CUDA:
            if getattr(event, "is_user_annotation", False):
                continue
            device.append((name, float(event.time_range.start), float(event.time_range.end)))
        elif name.startswith("cuda") and name.endswith("Synchronize"):
            syncs += 1
    return busy_from(device, syncs, steps)


def sgd_step(net: torch.nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor) -> None:
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    opt.zero_grad(set_to_none=True)


class Counter(Plugin):
    """Counts the records delivered to it (an inline ``PutRecord`` subscriber)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    @on(PutRecord)
    def record(self, record: PutRecord) -> None:
        self.count += 1


def fit(module: Module, batches: list[Any], device: torch.device, **options: Any) -> Module:
    """One loopbus epoch over ``batches``, no plugins unless given."""
    options.setdefault("plugins", [])
    trainer = Trainer(max_epochs=1, device=str(device), leak_check=None, **options)
    loopbus.run(trainer.fit, module, batches)
    return module


# ============================================================ section 1: copy
class Chain(torch.nn.Module):
    """Folds the batch onto ``work_rows`` rows (reading all of it), then a chain of
    ``depth`` square linear layers: compute set by the depth, copy by the batch size."""

    def __init__(self, width: int, depth: int, work_rows: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.work_rows = work_rows
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.view(-1, self.work_rows, x.shape[-1]).mean(0)
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return h


class ChainModule(Module):
    """loopbus's side of the chain; ``puts``: put the step's eight scalars or not."""

    def __init__(self, width: int, depth: int, work_rows: int, puts: bool = False) -> None:
        super().__init__()
        self.net = Chain(width, depth, work_rows)
        self.puts = puts

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        out: torch.Tensor = self.net(batch)
        loss = out.pow(2).mean()
        if self.puts:
            self.put("loss", loss)
            for i, value in enumerate(out.detach()[0, :7].unbind()):
                self.put(f"out{i}", value)
        else:  # the same eight scalars, not put
            out.detach()[0, :7].unbind()
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


@dataclass
class CopyWork:
    device: torch.device
    width: int
    work_rows: int
    depth: int
    host: list[torch.Tensor]  # pinned

    def net(self) -> tuple[Chain, torch.optim.Optimizer]:
        net = Chain(self.width, self.depth, self.work_rows).to(self.device)
        return net, torch.optim.SGD(net.parameters(), lr=1e-3)

    def batches(self, steps: int, pool: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        pool = self.host if pool is None else pool
        return [pool[i % len(pool)] for i in range(steps)]

    def hand_written(self, steps: int, non_blocking: bool) -> Chain:
        net, opt = self.net()
        for x in self.batches(steps):
            x = x.to(self.device, non_blocking=non_blocking)
            sgd_step(net, opt, net(x).pow(2).mean())
        return net

    def loopbus(self, steps: int, device_prefetch: int) -> torch.nn.Module:
        module = ChainModule(self.width, self.depth, self.work_rows)
        fit(module, self.batches(steps), self.device, device_prefetch=device_prefetch)
        return module.net


def _timing_event() -> Any:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def copy_seconds(host: list[torch.Tensor], device: torch.device, reps: int = 20) -> float:
    """Seconds one pinned batch takes to copy to the device (CUDA events)."""
    dst = torch.empty_like(host[0], device=device)
    for x in host[:2]:
        dst.copy_(x, non_blocking=True)
    start, end = _timing_event(), _timing_event()
    torch.cuda.synchronize()
    start.record()
    for i in range(reps):
        dst.copy_(host[i % len(host)], non_blocking=True)
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3 / reps


def compute_seconds(work: CopyWork, depth: int, x: torch.Tensor, reps: int = 20) -> float:
    """Seconds one training step of a chain of ``depth`` takes on a device batch."""
    net = Chain(work.width, depth, work.work_rows).to(work.device)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    for _ in range(3):
        sgd_step(net, opt, net(x).pow(2).mean())
    start, end = _timing_event(), _timing_event()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        sgd_step(net, opt, net(x).pow(2).mean())
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end)) / 1e3 / reps


def copy_work(args: argparse.Namespace, device: torch.device) -> CopyWork:
    rows = batch_rows(args.batch_mb, args.width, args.work_rows)
    g = torch.Generator().manual_seed(0)
    host = [torch.randn(rows, args.width, generator=g).pin_memory() for _ in range(args.pool)]
    work = CopyWork(device, args.width, args.work_rows, args.depth or 1, host)
    copy_s = copy_seconds(host, device)
    if args.depth is None:
        x = host[0].to(device)
        d1, d2 = 2, 16
        t1, t2 = compute_seconds(work, d1, x), compute_seconds(work, d2, x)
        depth = depth_for(copy_s, d1, t1, d2, t2)
        t = compute_seconds(work, depth, x)
        if abs(t - copy_s) > 0.1 * copy_s and depth != d1:  # refine once, nearer the target
            depth = depth_for(copy_s, d1, t1, depth, t)
        work.depth = depth
        del x
    mib = rows * args.width * 4 / MIB
    print(
        f"copy: batch {rows} x {args.width} float32 = {mib:.1f} MiB (pinned, {args.pool} "
        f"distinct, cycled); chain of {work.depth} layers of {args.width} on "
        f"{args.work_rows} rows"
    )
    return work


def bounds_line(copy_s: float, compute_s: float) -> str:
    return (
        f"copy {copy_s * 1e3:.3f} ms, "
        f"compute {compute_s * 1e3:.3f} ms; max {max(copy_s, compute_s) * 1e3:.3f} ms, "
        f"sum {(copy_s + compute_s) * 1e3:.3f} ms"
    )


def section_copy(args: argparse.Namespace, device: torch.device) -> None:
    work = copy_work(args, device)
    x = work.host[0].to(device)
    copies: list[float] = []
    computes: list[float] = []

    def measure_bound(i: int) -> None:
        copies.append(copy_seconds(work.host, device))
        computes.append(compute_seconds(work, work.depth, x))

    measure_bound(-1)
    print(f"  calibrated: {bounds_line(copies[0], computes[0])}")
    copies.clear()
    computes.clear()
    a = work.hand_written(20, non_blocking=True).state_dict()
    b = work.loopbus(20, device_prefetch=1).state_dict()
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    print(
        f"  weights after 20 steps, hand-written vs loopbus device_prefetch=1: max |diff| {diff:g}"
    )
    runs: dict[str, Callable[[int], Any]] = {
        "hand-written .to(device)": lambda n: work.hand_written(n, non_blocking=False),
        "hand-written .to(non_blocking=True), pinned": lambda n: work.hand_written(n, True),
        "loopbus device_prefetch=0": lambda n: work.loopbus(n, 0),
        "loopbus device_prefetch=1": lambda n: work.loopbus(n, 1),
    }
    for run in runs.values():  # warm-up (allocator, cuBLAS handles, copy stream)
        device_run(functools.partial(run, 5))
    per_step = timed_rounds(runs, args.steps, args.rounds, before_round=measure_bound)
    bounds = [max(c, k) for c, k in zip(copies, computes, strict=True)]
    sums = [c + k for c, k in zip(copies, computes, strict=True)]
    to_max = median_ratios(per_step, bounds)
    to_sum = median_ratios(per_step, sums)
    print(
        f"  per round (median): {bounds_line(statistics.median(copies), statistics.median(computes))}"
    )
    extra = {
        name: f"= {to_max[name]:.3f}x max(copy, compute), {to_sum[name]:.3f}x copy + compute"
        for name in runs
    }
    print_table(
        f"  {args.steps}/{2 * args.steps}-step runs, {args.rounds} rounds; "
        "target for loopbus device_prefetch=1: <= 1.05x max(copy, compute)",
        per_step,
        extra,
    )


# ============================================================ section 2: put
def section_put(args: argparse.Namespace, device: torch.device) -> None:
    work = copy_work(args, device)
    pool = [x.to(device) for x in work.host]  # device-resident: compute only
    print("put: device-resident batches, loopbus device_prefetch=1, an inline subscriber")
    counts: dict[str, list[int]] = {}

    def run(n: int, puts: bool, name: str, **options: Any) -> None:
        counter = Counter()
        module = ChainModule(work.width, work.depth, work.work_rows, puts=puts)
        fit(module, work.batches(n, pool), device, plugins=[counter], **options)
        counts.setdefault(name, []).append(counter.count // n)

    runs: dict[str, Callable[[int], Any]] = {
        "no put": lambda n: run(n, False, "no put"),
        "8 puts, put_lag default": lambda n: run(n, True, "8 puts, put_lag default"),
        "8 puts, put_lag=0 (a sync per step)": lambda n: run(
            n, True, "8 puts, put_lag=0 (a sync per step)", put_lag=0
        ),
    }
    for r in runs.values():
        device_run(functools.partial(r, 5))
    per_step = timed_rounds(runs, args.steps, args.rounds)
    ratios = median_ratio_to(per_step, "no put")
    extra = {
        name: f"= {ratios[name]:.4f}x no put; records/step {sorted(set(counts[name]))}"
        for name in runs
    }
    print_table(
        f"  {args.steps}/{2 * args.steps}-step runs, {args.rounds} rounds; "
        "target: 8 puts (put_lag default) within 1.02x of no put",
        per_step,
        extra,
    )


# ============================================================ section 3: cnn
class SmallCNN(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 5, stride=2, padding=2),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(64, 128, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
        )
        self.head = torch.nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.features(x))
        return out


class CNNModule(Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = SmallCNN()

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def digits_224() -> tuple[torch.Tensor, torch.Tensor]:
    """The digits images as float32 3x224x224 (upscaled once, on the host) and labels."""
    from sklearn.datasets import load_digits

    data = load_digits()
    small = torch.tensor(data.images, dtype=torch.float32).div_(16.0).unsqueeze(1)
    chunks = [
        F.interpolate(c, size=(224, 224), mode="bilinear", align_corners=False)
        for c in torch.split(small, 256)
    ]
    images = torch.cat(chunks).expand(-1, 3, -1, -1).contiguous()
    images.sub_(0.5).div_(0.5)
    return images, torch.tensor(data.target, dtype=torch.int64)


def section_cnn(args: argparse.Namespace, device: torch.device) -> None:
    images, labels = digits_224()
    b = args.cnn_batch
    full = images.shape[0] // b
    if full < 1:
        raise SystemExit(f"--cnn-batch {b} is larger than the {images.shape[0]} images")
    sources = {
        "unpinned": (images, labels),
        "pinned": (images.pin_memory(), labels.pin_memory()),
    }
    pools = {
        name: [(x[i * b : (i + 1) * b], y[i * b : (i + 1) * b]) for i in range(full)]
        for name, (x, y) in sources.items()
    }
    mib = b * 3 * 224 * 224 * 4 / MIB
    print(
        f"cnn: {images.shape[0]} digits images upscaled to 3x224x224 float32, batch {b} "
        f"({mib:.0f} MiB), {full} batches cycled"
    )

    def batches(pool: list[Any], n: int) -> list[Any]:
        return [pool[i % len(pool)] for i in range(n)]

    def hand(pool: list[Any], non_blocking: bool, n: int) -> None:
        net = SmallCNN().to(device)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        for x, y in batches(pool, n):
            x = x.to(device, non_blocking=non_blocking)
            y = y.to(device, non_blocking=non_blocking)
            sgd_step(net, opt, F.cross_entropy(net(x), y))

    def lb(pool: list[Any], prefetch: int, n: int) -> None:
        fit(CNNModule(), batches(pool, n), device, device_prefetch=1, prefetch=prefetch)

    runs: dict[str, Callable[[int], Any]] = {}
    for source, pool in pools.items():
        runs[f"{source}: hand-written .to(device)"] = functools.partial(hand, pool, False)
        runs[f"{source}: hand-written .to(non_blocking=True)"] = functools.partial(hand, pool, True)
        runs[f"{source}: loopbus device_prefetch=1"] = functools.partial(lb, pool, 0)
        runs[f"{source}: loopbus device_prefetch=1, prefetch=1"] = functools.partial(lb, pool, 1)
    for r in runs.values():
        device_run(functools.partial(r, 3))
    per_step = timed_rounds(runs, args.cnn_steps, args.rounds)
    busy = {name: profiled_busy(r, args.profile_steps) for name, r in runs.items()}
    print_table(
        f"  {args.cnn_steps}/{2 * args.cnn_steps}-step runs, {args.rounds} rounds; GPU "
        f"activity from one profiled run of {args.profile_steps} steps each",
        per_step,
        {name: busy[name].line() for name in runs},
    )


# ============================================================ main
# ============================================================ section 4: calls
def extra_calls(device: torch.device, n: int) -> dict[str, float]:
    """Calls per step loopbus (``device_prefetch=1``) adds over the hand-written loop on
    ``device``, with eight puts and without: ``(lb(2N) - lb(N) - (hw(2N) - hw(N))) / N``."""
    width, depth, rows = 256, 4, 64
    g = torch.Generator().manual_seed(0)
    pinned = device.type == "cuda"
    pool = [torch.randn(rows, width, generator=g) for _ in range(4)]
    if pinned:
        pool = [x.pin_memory() for x in pool]

    def batches(steps: int) -> list[torch.Tensor]:
        return [pool[i % len(pool)] for i in range(steps)]

    def hand(steps: int) -> None:
        torch.manual_seed(0)
        net = Chain(width, depth, rows).to(device)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        for x in batches(steps):
            x = x.to(device, non_blocking=pinned)
            out = net(x)
            out.detach()[0, :7].unbind()  # the eight scalars, computed, not kept
            sgd_step(net, opt, out.pow(2).mean())

    def lb(steps: int, puts: bool) -> None:
        module = ChainModule(width, depth, rows, puts=puts)
        fit(module, batches(steps), device, device_prefetch=1, yield_interval_s=math.inf)

    runs: dict[str, Callable[[int], Any]] = {
        "hand-written": hand,
        "loopbus, no put": functools.partial(lb, puts=False),
        "loopbus, 8 puts": functools.partial(lb, puts=True),
    }
    for run in runs.values():  # warm up imports, caches and the device
        run(5)
    delta = {
        name: count_calls(functools.partial(run, 2 * n)) - count_calls(functools.partial(run, n))
        for name, run in runs.items()
    }
    hand_delta = delta.pop("hand-written")
    return {name: (d - hand_delta) / n for name, d in delta.items()}


def section_calls(args: argparse.Namespace, device: torch.device) -> None:
    figures = extra_calls(device, args.calls_steps)
    print(
        f"calls: Python calls per step loopbus adds (device_prefetch=1, 4-layer chain, "
        f"width 256, batch 64, pinned host batches; runs of {args.calls_steps} and "
        f"{2 * args.calls_steps} steps)"
    )
    for name, value in figures.items():
        print(f"  {name:<18} {value:6.1f}")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            f"benchmarks/gpu.py needs a CUDA device; this torch ({torch.__version__}, "
            f"CUDA build {torch.version.cuda}) sees none. Run it on a machine with a GPU.",
            file=sys.stderr,
        )
        raise SystemExit(2)
    device = torch.device("cuda", torch.cuda.current_device())
    props = torch.cuda.get_device_properties(device)
    cudnn = torch.backends.cudnn.version()  # type: ignore[no-untyped-call]
    print(
        f"{torch.cuda.get_device_name(device)} ({props.total_memory / 2**30:.0f} GiB, "
        f"capability {props.major}.{props.minor}); torch {torch.__version__}, CUDA "
        f"{torch.version.cuda}, cuDNN {cudnn}, Python "
        f"{sys.version.split()[0]}, loopbus {getattr(loopbus, '__version__', '?')}"
    )
    sections: dict[str, Callable[[argparse.Namespace, torch.device], None]] = {
        "copy": section_copy,
        "put": section_put,
        "cnn": section_cnn,
        "calls": section_calls,
    }
    for name in args.sections:
        sections[name](args, device)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
