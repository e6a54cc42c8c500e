"""``Trainer(prefetch=N)`` on CPU: a worker thread fetches batches ahead while the steps
run. Loading overlaps with compute, results and resumes are bit-identical to inline
fetching, and the worker never outlives its run."""

from __future__ import annotations

import threading
import warnings
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import loopbus
from loopbus import MisconfigurationError, Module, Plugin, Trainer
from tests.ckpt_scenario import STATEFUL_WARNING, Net, SaveAtStep, make_data


class ObservedDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Says, per item, when its loading started."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.started = [threading.Event() for _ in range(n)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.started[index].set()
        return torch.full((4,), float(index)), torch.tensor(index % 2)


class WaitsForTheNextBatch(Module):
    """Each step waits up to ``wait`` seconds for the next batch's loading to start, and
    records whether it did (it can only while this step runs if a worker loads ahead)."""

    def __init__(self, data: ObservedDataset, wait: float) -> None:
        super().__init__()
        self.w = torch.nn.Linear(4, 2)
        self.data = data
        self.wait = wait
        self.overlapped: list[bool] = []

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        following = int(x[0, 0]) + 1
        if following < self.data.n:
            self.overlapped.append(self.data.started[following].wait(self.wait))
        return torch.nn.functional.cross_entropy(self.w(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


async def _overlaps(prefetch: int, wait: float, n: int = 6) -> list[bool]:
    data = ObservedDataset(n)
    module = WaitsForTheNextBatch(data, wait)
    trainer = Trainer(max_epochs=1, plugins=[], device="cpu", prefetch=prefetch)
    await trainer.fit(module, DataLoader(data, batch_size=1))
    return module.overlapped


async def test_prefetch_overlaps_loading_with_the_step() -> None:
    # Prefetched, the next batch loads while the step runs (observed by events, not
    # timed: the wall-time figure is benchmarks/overlap.py's). Inline it cannot: the
    # loop's thread loads it only after the step.
    assert await _overlaps(1, wait=10.0) == [True] * 5
    assert await _overlaps(0, wait=0.05) == [False] * 5


def test_prefetch_is_validated() -> None:
    with pytest.raises(MisconfigurationError, match=r"prefetch must be an int >= 0, got -1"):
        Trainer(prefetch=-1)
    with pytest.raises(MisconfigurationError, match=r"prefetch must be an int >= 0"):
        Trainer(prefetch=True)  # type: ignore[arg-type]


async def _train(prefetch: int, loader: str = "plain", **options: Any) -> dict[str, Any]:
    loopbus.seed_everything(5)
    module = Net()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", STATEFUL_WARNING)
        train, val = make_data(loader)
    trainer = Trainer(max_epochs=2, plugins=[], device="cpu", prefetch=prefetch, **options)
    await trainer.fit(module, train, val)
    return {k: v.clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("loader", ["plain", "stateful"])
async def test_prefetched_results_are_bit_identical(loader: str) -> None:
    inline = await _train(0, loader)
    for depth in (1, 3):
        ahead = await _train(depth, loader)
        for name, tensor in inline.items():
            assert torch.equal(ahead[name], tensor), f"{name} differs with prefetch={depth}"


async def test_prefetch_with_accumulation_and_the_thread_executor() -> None:
    inline = await _train(0, accumulate_grad_batches=3, executor="thread")
    ahead = await _train(2, accumulate_grad_batches=3, executor="thread")
    for name, tensor in inline.items():
        assert torch.equal(ahead[name], tensor), name


Pair = namedtuple("Pair", ["x", "y"])


@dataclass
class Sample:
    features: dict[str, torch.Tensor]
    pairs: list[Pair]
    tag: str


class Nested(Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(2, 1)
        self.seen: list[Sample] = []

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        self.seen.append(batch)
        return self.w(batch.features["a"]).sum() + batch.pairs[0].x.sum() * 0

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


async def test_nested_batches_arrive_intact() -> None:
    batches = [
        Sample(
            features={"a": torch.full((3, 2), float(i))},
            pairs=[Pair(torch.ones(1) * i, (torch.zeros(2), [i]))],
            tag=f"b{i}",
        )
        for i in range(5)
    ]
    module = Nested()
    await Trainer(max_epochs=1, plugins=[], device="cpu", prefetch=2).fit(module, batches)
    assert len(module.seen) == 5
    for sent, got in zip(batches, module.seen, strict=True):
        assert type(got) is Sample
        assert got.tag == sent.tag
        assert torch.equal(got.features["a"], sent.features["a"])
        assert type(got.pairs[0]) is Pair
        assert torch.equal(got.pairs[0].x, sent.pairs[0].x)
        assert got.pairs[0].y[1] == sent.pairs[0].y[1]


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "loopbus-prefetch"]


async def test_the_worker_stops_when_the_run_stops_early() -> None:
    trainer = Trainer(max_steps=3, plugins=[], device="cpu", prefetch=2)
    data = ObservedDataset(40)
    await trainer.fit(WaitsForTheNextBatch(data, wait=0.0), DataLoader(data, batch_size=1))
    assert trainer.global_step == 3
    assert _prefetch_threads() == []


class Broken(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 4:
            raise OSError("disk on fire at item 4")
        return torch.ones(2)


class Linear(Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        return self.w(batch).sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


async def test_a_loading_error_reaches_the_caller() -> None:
    trainer = Trainer(max_epochs=1, plugins=[], device="cpu", prefetch=1)
    with pytest.raises(OSError, match="disk on fire at item 4"):
        await trainer.fit(Linear(), DataLoader(Broken(), batch_size=1))
    assert trainer.global_step == 4
    assert _prefetch_threads() == []


@pytest.mark.parametrize("loader", ["plain", "stateful", "stateful-generator"])
async def test_resume_with_prefetch_is_bit_identical(tmp_path: Path, loader: str) -> None:
    """The checkpoint saves the position of the last batch trained on, not of the ones
    the worker fetched ahead; resuming (with prefetch on) is exact, across epochs."""
    path = tmp_path / "a.ckpt"

    async def run(plugins: list[Plugin], ckpt: Path | None) -> dict[str, Any]:
        loopbus.seed_everything(5)
        module = Net()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", STATEFUL_WARNING)
            train, val = make_data(loader)
        trainer = Trainer(max_epochs=2, plugins=plugins, device="cpu", prefetch=3)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "resuming mid-epoch by skipping")
            await trainer.fit(module, train, val, ckpt_path=ckpt)
        return {k: v.clone() for k, v in module.state_dict().items()}

    expected = await run([SaveAtStep(path, 13)], None)
    resumed = await run([SaveAtStep(tmp_path / "other.ckpt", 10_000)], path)
    for name, tensor in expected.items():
        assert torch.equal(resumed[name], tensor), f"{name} differs after resume"
