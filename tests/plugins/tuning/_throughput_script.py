"""Two ranks under torchrun (gloo, CPU) train with a ThroughputMonitor; each writes the
world figures and its own for every window to ``<out>/rank<r>.json``. Rank 1 counts
three samples per row, rank 0 one, so the world's samples/s tells whose were summed."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import loopbus
from loopbus import Module, Plugin, Trainer, on
from loopbus.plugins.tuning import ThroughputMeasured, ThroughputMonitor

EVERY = 4


class Net(Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 8)

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Windows(Plugin):
    """Keeps each window's figures: the world's and this rank's."""

    def __init__(self) -> None:
        self.windows: list[tuple[int, dict[str, float], dict[str, float]]] = []

    @on(ThroughputMeasured)
    def keep(self, event: ThroughputMeasured) -> None:
        self.windows.append((event.step, event.values, event.device))


def main() -> None:
    out = Path(sys.argv[1])
    loopbus.seed_everything(0)
    data = DataLoader(TensorDataset(torch.randn(128, 16), torch.randn(128, 8)), batch_size=8)
    rank_factor: list[int] = []
    monitor = ThroughputMonitor(
        samples=lambda batch: rank_factor[0] * len(batch[0]), every_n_steps=EVERY, peak_flops=1e12
    )
    windows = Windows()
    trainer = Trainer(max_steps=2 * EVERY, plugins=[monitor, windows], device="cpu", strategy="ddp")
    rank_factor.append(3 if trainer.global_rank == 1 else 1)
    trainer.fit(Net(), data)
    summary = {
        "world_size": trainer.world_size,
        "latest": monitor.latest,
        "windows": windows.windows,
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
