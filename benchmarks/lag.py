"""Event-loop lag while a CPU training run is going: ``executor="inline"`` vs ``"thread"``.

A heartbeat task shares the event loop with ``trainer.fit``: it sleeps 1 ms in a loop and
records how late it wakes up (wake-up time minus the time it asked for). That lateness is
what every other task of a host application (a web request, a websocket ping) waits on
top of its own work. The figure is printed as p50 / p99 / max over all heartbeats of the
run, for each executor and backend, next to a baseline with no training at all.

Work: an MLP (256 -> 512 -> 512 -> 10) on random data, batch 128, SGD with momentum,
``put("train/loss", loss)`` every step and one queued record subscriber (a logger's
shape). About 1-3 ms per step on one core: long enough to matter to a host, short enough
for many steps per second.

    ./dev bench lag                                 # both backends, defaults below
    ./dev bench lag --steps 2000 --backends trio
    ./dev bench lag --torch-threads 2 --switch-interval 0.001
    ./dev bench lag --yield-interval 0                # inline: yield after every step

Target (issue 6): p99 lag <= 5 ms with ``executor="thread"``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import anyio
import torch
from torch.nn import functional as F

import loopbus
from loopbus import Module, PutRecord, Trainer

TICK = 0.001


class Mlp(Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(256, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 512),
            torch.nn.ReLU(),
            torch.nn.Linear(512, 10),
        )

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.put("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def make_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 128, 256, generator=g)
    y = torch.randint(0, 10, (n, 128), generator=g)
    return list(zip(x, y, strict=True))


async def heartbeat(lags: list[float], stop: anyio.Event) -> None:
    clock = time.perf_counter
    while not stop.is_set():
        start = clock()
        await anyio.sleep(TICK)
        lags.append(clock() - start - TICK)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def measure(
    executor: str | None, steps: int, seconds: float, yield_interval: float = 0.005
) -> dict[str, float]:
    """Heartbeat lag during a run of ``steps`` steps (``executor=None``: no training,
    ``seconds`` of idle heartbeat)."""
    lags: list[float] = []
    stop = anyio.Event()
    # Build the model and the data first: only the run itself is measured.
    torch.manual_seed(0)
    module = Mlp()
    batches = make_batches(min(steps, 200))
    trainer = Trainer(
        max_steps=steps,
        plugins=[],
        executor=executor or "inline",  # type: ignore[arg-type]
        yield_interval_s=yield_interval,
        device="cpu",
    )
    trainer.subscribe(PutRecord, lambda record: None, mode="queued", destination="loggers")
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat, lags, stop)
        await anyio.sleep(0.05)  # let the heartbeat settle
        lags.clear()
        start = time.perf_counter()
        if executor is None:
            await anyio.sleep(seconds)
        else:
            await trainer.fit(module, batches)
        elapsed = time.perf_counter() - start
        stop.set()
    ms = [lag * 1000 for lag in lags]
    return {
        "p50": statistics.median(ms),
        "p99": percentile(ms, 0.99),
        "max": max(ms),
        "beats": len(ms),
        "steps_per_s": steps / elapsed if executor is not None else 0.0,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--backends", nargs="+", default=["asyncio", "trio"])
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument(
        "--yield-interval",
        type=float,
        default=0.005,
        help="Trainer(yield_interval_s=...): how long inline steps may run between yields",
    )
    parser.add_argument(
        "--switch-interval",
        type=float,
        default=None,
        help="sys.setswitchinterval() for the run (Python's default is 0.005 s)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    if args.switch_interval is not None:
        sys.setswitchinterval(args.switch_interval)

    print(
        f"event-loop lag of a 1 ms heartbeat during {args.steps} training steps "
        f"(torch threads {torch.get_num_threads()}, GIL switch interval "
        f"{sys.getswitchinterval() * 1000:g} ms, yield_interval {args.yield_interval * 1000:g} ms, "
        f"torch {torch.__version__}, "
        f"loopbus {loopbus.__version__})"
    )
    print(
        f"{'backend':8} {'executor':9} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8} "
        f"{'beats':>6} {'steps/s':>8}"
    )
    for backend in args.backends:
        # Warm up torch (first-call costs) outside the measurement.
        anyio.run(measure, "inline", 50, 0.0, backend=backend)
        idle = anyio.run(measure, None, 0, 1.0, backend=backend)
        rows = [("none", idle)]
        rows += [
            (
                executor,
                anyio.run(measure, executor, args.steps, 0.0, args.yield_interval, backend=backend),
            )
            for executor in ("inline", "thread")
        ]
        for name, r in rows:
            rate = f"{r['steps_per_s']:8.0f}" if name != "none" else f"{'-':>8}"
            print(
                f"{backend:8} {name:9} {r['p50']:8.2f} {r['p99']:8.2f} {r['max']:8.2f} "
                f"{r['beats']:6.0f} {rate}"
            )


if __name__ == "__main__":
    main()
