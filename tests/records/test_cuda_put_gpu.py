"""Sync-free put on CUDA: no host-device sync on the per-step path, records delivered in
order. Skipped without CUDA."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from loopbus import Module, Plugin, Trainer, on
from loopbus.events import PutRecord, TrainBatchCompleted, TrainBatchStarted
from loopbus.plugins import CSVLogger, ProgressBar

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    # torch warns once per process that the sync debug mode is a prototype.
    pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning"),
]


class Eight(Module):
    """Puts eight tensors every step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        out = self.net(x).squeeze(1)
        loss = torch.nn.functional.mse_loss(out, y)
        self.put("train/loss", loss)
        for i in range(7):
            self.put(f"train/m{i}", out.mean() * i)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class SyncsAreErrors(Plugin):
    """Host-device syncs raise from the start of each training batch to its end (the
    step, its flush and the step's events); the epoch and stage boundaries, which read
    what is left on purpose, are not checked."""

    @on(TrainBatchStarted)
    def strict(self, event: TrainBatchStarted) -> None:
        torch.cuda.set_sync_debug_mode("error")

    @on(TrainBatchCompleted, priority=-1000)
    def lenient(self, event: TrainBatchCompleted) -> None:
        torch.cuda.set_sync_debug_mode("default")


def _data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(512, 64, generator=g), torch.randn(512, generator=g)),
        batch_size=32,
        pin_memory=True,
    )


async def test_no_sync_per_step_with_put_bar_and_csv(tmp_path: Path) -> None:
    received: list[tuple[str, int]] = []

    class Collect(Plugin):
        @on(PutRecord)
        def record(self, record: PutRecord) -> None:
            received.append((record.name, record.step))

    plugins = [
        SyncsAreErrors(),
        ProgressBar(file=io.StringIO()),
        CSVLogger(tmp_path, name="", version=""),
        Collect(),
    ]
    try:
        await Trainer(max_epochs=2, plugins=plugins, device="cuda").fit(Eight(), _data())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    names = ["train/loss"] + [f"train/m{i}" for i in range(7)]
    assert received == [(n, s) for s in range(1, 33) for n in names]


async def test_values_match_a_synchronous_read() -> None:
    lagged: list[float] = []
    at_once: list[float] = []

    def collect(into: list[float]) -> Plugin:
        class Collect(Plugin):
            @on(PutRecord)
            def record(self, record: PutRecord) -> None:
                if record.name == "train/loss":
                    into.append(record.value)

        return Collect()

    for lag, into in ((4, lagged), (0, at_once)):
        torch.manual_seed(0)
        trainer = Trainer(max_epochs=1, plugins=[collect(into)], device="cuda", put_lag=lag)
        await trainer.fit(Eight(), _data())
    assert lagged == at_once
    assert len(lagged) == 16
