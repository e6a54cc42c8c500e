"""``Trainer(compile=...)`` on CUDA: a compiled step (and optimizer step) with eight puts
makes no host-device sync per step once compiled, delivers its records in order, and
trains as the eager step does. Skipped without CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo
from torch.utils.data import DataLoader, TensorDataset

from loopbus import Module, Plugin, Trainer, on
from loopbus.events import PutRecord, TrainBatchCompleted, TrainBatchStarted

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    # torch warns once per process that the sync debug mode is a prototype.
    pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning"),
]

NAMES = ["train/loss"] + [f"train/m{i}" for i in range(7)]


class Eight(Module):
    """Puts eight tensors every step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
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
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class SyncsAreErrorsOnceCompiled(Plugin):
    """Host-device syncs raise from the start of each training batch to its end, from
    the third step on (the first two compile the step and the optimizer step, which may
    wait for the device while it tunes kernels)."""

    @on(TrainBatchStarted)
    def strict(self, event: TrainBatchStarted) -> None:
        if event.step >= 2:
            torch.cuda.set_sync_debug_mode("error")

    @on(TrainBatchCompleted, priority=-1000)
    def lenient(self, event: TrainBatchCompleted) -> None:
        torch.cuda.set_sync_debug_mode("default")


class Collect(Plugin):
    def __init__(self) -> None:
        super().__init__()
        self.received: list[tuple[str, int, float]] = []

    @on(PutRecord)
    def record(self, record: PutRecord) -> None:
        self.received.append((record.name, record.step, float(record.value)))


def _data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(512, 64, generator=g), torch.randn(512, generator=g)),
        batch_size=32,
        pin_memory=True,
    )


async def _fit(compile: Any, strict: bool) -> tuple[Eight, list[tuple[str, int, float]]]:
    torch._dynamo.reset()
    collect = Collect()
    plugins: list[Plugin] = [collect]
    if strict:
        plugins.insert(0, SyncsAreErrorsOnceCompiled())
    module = Eight()
    try:
        await Trainer(max_epochs=2, plugins=plugins, device="cuda", compile=compile).fit(
            module, _data()
        )
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return module, collect.received


async def test_a_compiled_step_makes_no_sync_per_step_and_trains_as_eager() -> None:
    compiled, got = await _fit({"backend": "inductor"}, strict=True)
    eager, expected = await _fit(False, strict=False)
    assert [(n, s) for n, s, _ in got] == [(n, s) for s in range(1, 33) for n in NAMES]
    assert [(n, s) for n, s, _ in got] == [(n, s) for n, s, _ in expected]
    for (_, _, a), (_, _, b) in zip(got, expected, strict=True):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    for name, value in eager.state_dict().items():
        torch.testing.assert_close(compiled.state_dict()[name], value, rtol=1e-4, atol=1e-5)
