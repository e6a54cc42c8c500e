"""How much a slow logger holds up training: its writes overlap with the steps.

Work: ``--steps`` steps of a tiny linear model, each also waiting ``--step-ms`` (a stand-in
for compute that releases the GIL, as torch's kernels do), with ``put("train/loss",
loss)`` every step. The logger is a ``Logger`` whose ``write`` costs ``--write-ms`` per
record (a slow disk or service). Three runs, timed by wall clock:

* hand-written: the same steps in a plain PyTorch loop, no logging;
* hand-written, writing inline: the loop also writes each step's loss itself, paying
  the write on the step (the sum of the two);
* loopbus with the slow logger (``overflow="block"``: every record is written, and
  ``fit`` returns once they are).

The figures are the ratios to the hand-written loop without logging: loopbus's should stay
near max(step, write) / step, well below the inline writer's (step + write) / step.

    ./dev bench slow_logger
    ./dev bench slow_logger --steps 100 --step-ms 20 --write-ms 20 --backends trio
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import anyio
import torch
from _harness import timed
from torch.nn import functional as F

import loopbus
from loopbus import Module, PutRecord, Trainer
from loopbus.plugins import Logger


class Linear(Module):
    def __init__(self, step_s: float) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
        self.step_s = step_s

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        time.sleep(self.step_s)
        loss = F.cross_entropy(self.layer(x), y)
        self.put("train/loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class SlowLogger(Logger):
    def __init__(self, write_s: float) -> None:
        super().__init__(flush_interval=0.005)
        self.write_s = write_s
        self.written = 0

    def write(self, records: Sequence[PutRecord]) -> None:
        time.sleep(self.write_s * len(records))
        self.written += len(records)


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g))] * n


def hand_written(n: int, step_s: float, write_s: float | None) -> None:
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in batches(n):
        time.sleep(step_s)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if write_s is not None:
            loss.item()
            time.sleep(write_s)


def with_loopbus(n: int, step_s: float, write_s: float, backend: str) -> None:
    logger = SlowLogger(write_s)
    trainer = Trainer(max_steps=n, plugins=[logger], device="cpu")
    anyio.run(trainer.fit, Linear(step_s), batches(n), backend=backend)
    assert logger.written == n, logger.written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-ms", type=float, default=20.0)
    parser.add_argument("--write-ms", type=float, default=20.0)
    parser.add_argument("--backends", nargs="+", default=["asyncio", "trio"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    n, step_s, write_s = args.steps, args.step_ms / 1000, args.write_ms / 1000

    print(
        f"{n} steps of {args.step_ms:g} ms, a logger write of {args.write_ms:g} ms per record "
        f"(torch {torch.__version__}, loopbus {loopbus.__version__})"
    )
    hand_written(5, step_s, None)  # warm up
    base = timed(lambda: hand_written(n, step_s, None))
    inline = timed(lambda: hand_written(n, step_s, write_s))
    print(f"{'hand-written':30} {base:7.2f} s  1.00")
    print(f"{'hand-written, writing inline':30} {inline:7.2f} s  {inline / base:.2f}")
    for backend in args.backends:
        with_loopbus(5, 0.0, 0.0, backend)  # warm up
        took = timed(lambda backend=backend: with_loopbus(n, step_s, write_s, backend))
        print(f"{'loopbus, slow logger (' + backend + ')':30} {took:7.2f} s  {took / base:.2f}")
    overlapped, summed = max(step_s, write_s) / step_s, (step_s + write_s) / step_s
    print(f"(overlapped: about {overlapped:.2f}; summed: {summed:.2f})")


if __name__ == "__main__":
    main()
