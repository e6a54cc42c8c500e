"""The CUDA data path: side-stream prefetch, its memory safety and its determinism.
Skipped without CUDA (run on a GPU machine: ``./dev test tests/data/test_cuda_data_gpu.py``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from loopbus import Module, Trainer
from loopbus.data._device import CudaBatchSource, copy_stream, pin_batch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CUDA = torch.device("cuda", 0)

# Runs compared bit for bit need deterministic kernels: cuBLAS may otherwise split a
# long reduction and add the parts in any order. Its workspace setting must be in place
# before the process's first cuBLAS call.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


@pytest.fixture
def deterministic() -> Iterator[None]:
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


class Poisoned(Module):
    """Slow steps (a device sleep before reading the batch) and, while the batch is in
    use, allocations of the batch's size filled with garbage: a batch whose memory the
    allocator handed out again too early would train on poison."""

    def __init__(self, features: int, sleep_cycles: int = 500_000) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Linear(features, 1)
        self.sleep_cycles = sleep_cycles
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        torch.cuda._sleep(self.sleep_cycles)  # the copy of the next batch runs meanwhile
        poison = [torch.full_like(x, float("nan")) for _ in range(4)]
        loss = torch.nn.functional.mse_loss(self.w(x).squeeze(1), y)
        del poison
        self.losses.append(loss.detach())
        return loss

    def configure_optimizers(self) -> Any:
        # Small enough for 4096 features: the losses stay finite, so a NaN is poison.
        return torch.optim.SGD(self.parameters(), lr=1e-5)


def _data(n: int = 256, features: int = 4096) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=g)
    y = torch.randn(n, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8)


async def _losses(device_prefetch: int, steps: int, **options: Any) -> torch.Tensor:
    module = Poisoned(4096)
    # No leak check: it walks what the step keeps (the 1000 losses) at every one of the
    # 1000 steps; this test is about the allocator, not about leaks.
    trainer = Trainer(
        max_steps=steps,
        plugins=[],
        device="cuda",
        device_prefetch=device_prefetch,
        leak_check=None,
        **options,
    )
    await trainer.fit(module, _data())
    return torch.stack(module.losses).cpu()


async def test_prefetched_batches_are_never_reused_early(deterministic: None) -> None:
    steps = 1000
    synchronous = await _losses(0, steps)
    assert torch.isfinite(synchronous).all()
    for depth, options in ((1, {}), (2, {}), (1, {"prefetch": 2})):
        ahead = await _losses(depth, steps, **options)
        assert torch.equal(ahead, synchronous), f"device_prefetch={depth} {options}"
        assert not torch.isnan(ahead).any()


async def test_reserved_memory_is_flat_across_epochs() -> None:
    module = Poisoned(4096, sleep_cycles=0)
    reserved: list[int] = []

    from loopbus import Plugin, on
    from loopbus.events import EpochCompleted

    class Watch(Plugin):
        @on(EpochCompleted)
        def _epoch(self, event: EpochCompleted) -> None:
            torch.cuda.synchronize()
            reserved.append(torch.cuda.memory_reserved())

    trainer = Trainer(max_epochs=5, plugins=[Watch()], device="cuda")
    await trainer.fit(module, _data())
    assert len(reserved) == 5
    assert reserved[1:] == [reserved[1]] * 4, reserved  # after the first epoch: flat


def test_one_copy_stream_per_device() -> None:
    assert copy_stream(CUDA) is copy_stream(CUDA)


@dataclasses.dataclass
class Sample:
    x: torch.Tensor
    nested: tuple[torch.Tensor, list[torch.Tensor]]


def test_nested_tensors_get_record_stream_and_arrive_on_the_device() -> None:
    from loopbus.data._sources import BatchSource

    host = [Sample(torch.ones(3) * i, (torch.ones(2) * i, [torch.ones(1) * i])) for i in range(3)]
    source = CudaBatchSource(BatchSource(iter(host)), CUDA, depth=2)
    got = []
    while source.has_next():
        got.append(source.take())
    torch.cuda.synchronize()
    assert len(got) == 3
    for i, sample in enumerate(got):
        assert type(sample) is Sample
        for t in (sample.x, sample.nested[0], sample.nested[1][0]):
            assert t.device.type == "cuda"
            assert float(t[0]) == i


def test_pinning() -> None:
    batch = {"a": torch.ones(3), "b": [Sample(torch.ones(2), (torch.ones(1), []))]}
    out = pin_batch(batch)
    assert out["a"].is_pinned()
    assert out["b"][0].x.is_pinned()
    assert pin_batch(out)["a"] is out["a"]


def test_cuda_rng_resumes_bit_identical(tmp_path: Any, deterministic: None) -> None:
    from loopbus.plugins import Checkpoint

    class Noisy(Poisoned):
        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            x, y = batch
            x = torch.nn.functional.dropout(x, 0.5)  # draws from the CUDA generator
            loss = torch.nn.functional.mse_loss(self.w(x).squeeze(1), y)
            self.losses.append(loss.detach())
            return loss

    def run(steps: int, ckpt: Any = None, plugins: Any = ()) -> Noisy:
        torch.manual_seed(1)
        module = Noisy(64, sleep_cycles=0)
        data = DataLoader(
            TensorDataset(torch.randn(64, 64), torch.randn(64)), batch_size=8, shuffle=True
        )
        trainer = Trainer(max_steps=steps, plugins=list(plugins), device="cuda")
        import loopbus

        loopbus.run(trainer.fit, module, data, ckpt_path=ckpt)
        return module

    whole = run(20)
    # Saved at step 12, in the middle of the second epoch, by a run that goes on (a run
    # that max_steps ends there finishes that epoch: its own end checkpoint resumes at
    # the next epoch, as documented).
    run(14, plugins=[Checkpoint(tmp_path, every_n_steps=12, keep_last=None)])
    with pytest.warns(UserWarning, match="resuming mid-epoch by skipping the 4 batches"):
        resumed = run(
            20, tmp_path / "epoch=1-step=12.ckpt", plugins=[Checkpoint(tmp_path, every_n_steps=100)]
        )
    assert len(resumed.losses) == 8
    assert torch.equal(torch.stack(resumed.losses).cpu(), torch.stack(whole.losses[12:]).cpu())


async def test_bf16_autocast_on_cuda() -> None:
    class Dtypes(Poisoned):
        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            x, y = batch
            out = self.w(x)
            self.losses.append(torch.tensor(float(out.dtype == torch.bfloat16)))
            return torch.nn.functional.mse_loss(out.float().squeeze(1), y)

    module = Dtypes(64, sleep_cycles=0)
    data = DataLoader(TensorDataset(torch.randn(32, 64), torch.randn(32)), batch_size=8)
    await Trainer(max_steps=4, plugins=[], device="cuda", precision="bf16-mixed").fit(module, data)
    assert [float(v) for v in module.losses] == [1.0] * 4
