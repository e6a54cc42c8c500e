"""``Trainer(compile=...)`` on CUDA: a compiled step (and optimizer step) with eight puts
makes no host-device sync per step once compiled, delivers its records in order, and
trains as the eager step does. Skipped without CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo

from loopbus import Plugin, Trainer, on
from loopbus.events import PutRecord, TrainBatchCompleted, TrainBatchStarted
from tests.records import test_cuda_put_gpu

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    # torch warns once per process that the sync debug mode is a prototype.
    # inductor's advice (TF32 matmuls, online softmax) depends on the card: not ours.
    pytest.mark.filterwarnings("ignore::UserWarning:torch._inductor"),
    pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning"),
]

NAMES = ["train/loss"] + [f"train/m{i}" for i in range(7)]


class Eight(test_cuda_put_gpu.Eight):
    """Puts eight tensors every step; SGD with momentum (the compiled optimizer step
    creates its state on the first step)."""

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


async def _fit(compile: Any, strict: bool) -> tuple[Eight, list[tuple[str, int, float]]]:
    torch._dynamo.reset()
    collect = Collect()
    plugins: list[Plugin] = [collect]
    if strict:
        plugins.insert(0, SyncsAreErrorsOnceCompiled())
    torch.manual_seed(0)
    module = Eight()
    try:
        await Trainer(max_epochs=2, plugins=plugins, device="cuda", compile=compile).fit(
            module, test_cuda_put_gpu._data()
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
