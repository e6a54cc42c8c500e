"""Overlap of data loading with compute: step time against max(load, compute).

A synthetic loader whose every batch takes ``--load-ms`` to produce (sleeping, which
releases the GIL as file I/O or decoding in C does) feeds a model whose training step
takes about ``--compute-ms`` of real torch work (a matmul chain, calibrated at start).
Three loops do the same work, alternating in one process:

* the hand-written loop: fetch, then step (time ~ load + compute);
* loopbus with ``prefetch=0``: the same, through the engine;
* loopbus with ``prefetch=1``: a worker thread fetches batch k+1 while step k runs
  (target: <= 1.15x max(load, compute)).

    ./dev bench overlap                         # 2 ms load, 2 ms compute
    ./dev bench overlap --load-ms 4 --compute-ms 2 --steps 200
    ./dev bench overlap --switch-interval 0.0005

The worker thread needs the GIL briefly after each load; while the step holds it, the
worker waits for the interpreter's switch interval (``sys.getswitchinterval()``, 5 ms by
default). ``--switch-interval`` sets it for the run (loopbus never changes it itself);
docs/performance.md shows both.

The CUDA cases (side-stream host-to-device copies against compute, sync-free put, GPU
busy fraction) need a GPU: ``benchmarks/gpu.py``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _harness import timed

import loopbus
from loopbus import Module, Trainer

torch.set_num_threads(1)


class SlowLoader:
    """``steps`` batches, each ready ``load_s`` seconds after it is asked for."""

    def __init__(self, steps: int, load_s: float) -> None:
        self.steps = steps
        self.load_s = load_s
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(steps, 64, 64, generator=g)

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(self.steps):
            time.sleep(self.load_s)
            yield self.x[i]


class Chain(torch.nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(64, 64) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def step_of(net: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    loss = net(x).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def calibrate(compute_s: float) -> int:
    """The chain depth whose step takes about ``compute_s``."""
    x = torch.randn(64, 64)
    depth = 4
    while True:
        net = Chain(depth)
        opt = torch.optim.SGD(net.parameters(), lr=1e-3)
        for _ in range(5):
            step_of(net, opt, x)
        start = time.perf_counter()
        for _ in range(20):
            step_of(net, opt, x)
        per_step = (time.perf_counter() - start) / 20
        if per_step >= compute_s or depth > 4096:
            return max(1, round(depth * compute_s / per_step))
        depth *= 2


def hand_written(depth: int, steps: int, load_s: float) -> torch.nn.Module:
    net = Chain(depth)
    opt = torch.optim.SGD(net.parameters(), lr=1e-3)
    for x in SlowLoader(steps, load_s):
        step_of(net, opt, x)
    return net


class ChainModule(Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.net = Chain(depth)

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        loss = self.net(batch).pow(2).mean()
        self.put("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def with_loopbus(depth: int, steps: int, load_s: float, prefetch: int) -> torch.nn.Module:
    module = ChainModule(depth)
    trainer = Trainer(max_epochs=1, plugins=[], device="cpu", leak_check=None, prefetch=prefetch)
    loopbus.run(trainer.fit, module, SlowLoader(steps, load_s))
    return module.net


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--load-ms", type=float, default=2.0)
    parser.add_argument("--compute-ms", type=float, default=2.0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--switch-interval", type=float, default=None, help="sys.setswitchinterval(s) first"
    )
    args = parser.parse_args(argv)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)
    load_s, steps = args.load_ms / 1e3, args.steps
    depth = calibrate(args.compute_ms / 1e3)
    # The compute time as measured in this process (no loading), per step.
    compute_s = timed(lambda: hand_written(depth, steps, 0.0)) / steps
    bound = max(load_s, compute_s)
    a = hand_written(depth, 20, 0.0).state_dict()
    b = with_loopbus(depth, 20, 0.0, 1).state_dict()
    same = all(torch.equal(a[k], b[k]) for k in a)
    print(
        f"torch {torch.__version__}, chain depth {depth}: compute {compute_s * 1e3:.2f} ms/step, "
        f"load {load_s * 1e3:.2f} ms/batch, {steps} steps, {args.repeats} rounds, "
        f"switch interval {sys.getswitchinterval() * 1e3:g} ms; "
        f"same weights as the hand-written loop: {same}"
    )
    if not same:
        raise SystemExit("the loops diverged; the comparison would be meaningless")
    runs: dict[str, Callable[[], Any]] = {
        "hand-written (fetch, then step)": lambda: hand_written(depth, steps, load_s),
        "loopbus prefetch=0": lambda: with_loopbus(depth, steps, load_s, 0),
        "loopbus prefetch=1": lambda: with_loopbus(depth, steps, load_s, 1),
    }
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(args.repeats):
        names = list(runs)
        for name in names[i % 3 :] + names[: i % 3]:
            times[name].append(timed(runs[name]) / steps)
    print(f"max(load, compute) = {bound * 1e3:.2f} ms; load + compute = {(load_s + compute_s) * 1e3:.2f} ms")
    for name, values in times.items():
        per_step = statistics.median(values)
        print(
            f"{name:<34} {per_step * 1e3:6.2f} ms/step = {per_step / bound:.3f}x max(load, compute)"
        )


if __name__ == "__main__":
    main()
