"""ThroughputMonitor on a CUDA device: each step's device time is measured with a pair of
CUDA events read without waiting (``query()``), so ``throughput/device_ms_per_step``
and ``throughput/host_ms_per_step`` are put, and the monitor adds no host sync to a
step (``torch.cuda.set_sync_debug_mode("error")`` raises at one)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import loopbus
from loopbus import Trainer
from loopbus.plugins.tuning import ThroughputMonitor
from tests.plugins.tuning.test_throughput import Records

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Square(loopbus.Module):
    """A step long enough on the device (a 2048 x 2048 matmul chain) to time."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(2048, 2048) for _ in range(4)))

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _batches(n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    for _ in range(n):
        yield torch.randn(256, 2048), torch.randn(256, 2048)


@pytest.fixture
def no_host_sync() -> Iterator[None]:
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def test_device_time_is_measured_with_events_and_no_host_sync(no_host_sync: None) -> None:
    records = Records()
    monitor = ThroughputMonitor(every_n_steps=10)
    trainer = Trainer(max_steps=40, device="cuda", plugins=[records, monitor])
    loopbus.run(trainer.fit, Square(), list(_batches(40)))
    device = [v for _, v in records.of("throughput/device_ms_per_step")]
    host = [v for _, v in records.of("throughput/host_ms_per_step")]
    assert len(host) == 4
    assert device  # the events of most steps have completed by a later window
    assert all(v > 0 for v in device)
    # Four 2048-wide layers on 256 rows, forward and backward: well over a
    # microsecond of device time a step on any GPU, and well under a second.
    assert all(1e-3 < v < 1e3 for v in device)
