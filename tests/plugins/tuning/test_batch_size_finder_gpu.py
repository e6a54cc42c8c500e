"""BatchSizeFinder on a CUDA device: a real out-of-memory error ends the doubling, the
search frees what the failed trial held, and training continues at the size found."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import loopbus
from loopbus.plugins.tuning import BatchSizeFinder

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

HIDDEN = 2**20  # 4 MiB of float32 activations per sample and per layer output


class Wide(loopbus.Module):
    """A model whose activations take about 16 MiB per sample (the hidden layer's output,
    its ReLU and their gradients), so a few thousand samples fill a large GPU."""

    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(16, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, 1)
        self.sizes: list[int] = []
        self.losses: list[float] = []

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.down(F.relu(self.up(x))), y)
        self.sizes.append(x.shape[0])
        self.losses.append(float(loss.detach()))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=1e-4)


class Batches:
    """Random batches of ``size`` samples, as many as asked for."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(0)
        while True:
            yield torch.randn(self.size, 16, generator=g), torch.randn(self.size, 1, generator=g)


async def test_a_real_out_of_memory_error_on_cuda() -> None:
    started = time.monotonic()
    module = Wide()
    finder = BatchSizeFinder("binsearch", init_val=64, steps_per_trial=2, loader=Batches)
    trainer = loopbus.Trainer(max_steps=3, plugins=[finder], device="cuda")
    await trainer.fit(module, Batches(1))

    assert any(not fitted for _, fitted in finder.trials), finder.trials  # it ran out
    assert len(finder.trials) <= finder.max_trials
    largest = finder.largest_fit
    assert largest is not None
    assert largest >= 64
    assert finder.batch_size == math.floor(largest * 0.95)
    assert trainer.latest["batch_size_finder/batch_size"].value == finder.batch_size
    # Every size below the largest that fitted fitted too; one above it did not.
    failed = [size for size, fitted in finder.trials if not fitted]
    assert all(size > largest for size in failed)
    assert min(failed) - largest <= 1
    # Training went on at the size found, on the GPU.
    assert trainer.global_step == 3
    assert module.sizes[-3:] == [finder.batch_size] * 3
    assert all(math.isfinite(loss) for loss in module.losses[-3:])
    assert next(module.parameters()).device.type == "cuda"
    print(f"found {finder.batch_size} ({largest} fitted) in {len(finder.trials)} trials, "
          f"{time.monotonic() - started:.1f}s on {torch.cuda.get_device_name()}")
    assert time.monotonic() - started < 60
