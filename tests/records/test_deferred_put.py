"""Sync-free put: records whose values are still on their way from a device are
delivered later, in order, with their own step and epoch, within a bounded lag.

A CUDA device is not needed to test the bookkeeping: a fake read-back (standing in for
the device-to-host copy and its event) treats CPU tensors as device values and says
"copied" only when a test allows it. The CUDA copy itself is tested in
test_cuda_put_gpu.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loopbus import Module, Plugin, Trainer, on
from loopbus.data import _device
from loopbus.events import EpochCompleted, PutRecord, TrainBatchCompleted
from tests.helpers import make_loader


class FakeReading:
    def __init__(self, tensors: list[torch.Tensor], readback: FakeReadback) -> None:
        self.numbers = [t.item() for t in tensors]
        self.readback = readback
        self.polls = 0

    def ready(self) -> bool:
        self.polls += 1
        return self.readback.ready_after is not None and self.polls > self.readback.ready_after

    def values(self) -> list[Any]:
        if not self.ready():
            self.readback.waited += 1  # a real reading would wait for its copy here
        return self.numbers


class FakeReadback:
    device_type = "cpu"  # it reads back the CPU tensors put

    def __init__(self, ready_after: int | None) -> None:
        self.ready_after = ready_after  # None: never ready unless waited for
        self.started = 0
        self.waited = 0

    def start(self, tensors: list[torch.Tensor]) -> FakeReading:
        self.started += 1
        return FakeReading(tensors, self)


@pytest.fixture
def readback(monkeypatch: pytest.MonkeyPatch, request: Any) -> FakeReadback:
    fake = FakeReadback(getattr(request, "param", 1))
    monkeypatch.setattr(_device, "readback_for", lambda device: fake)
    return fake


class Counting(Module):
    """Puts its step number (as a tensor) and a plain number every step."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        step = self.trainer.global_step
        self.put("seen_at", torch.tensor(float(step)))
        self.put("plain", step)
        return self.w(torch.ones(1, 2)).sum() * 0 + self.w.weight.sum()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.0)


class Watch(Plugin):
    def __init__(self) -> None:
        self.records: list[tuple[str, int, int, Any]] = []
        self.waiting: list[int] = []
        self.latest_steps: list[tuple[int, int]] = []
        self.at_epoch_end: list[int] = []

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer

    @on(PutRecord)
    def record(self, record: PutRecord) -> None:
        self.records.append((record.name, record.step, record.epoch, record.value))

    @on(TrainBatchCompleted)
    def step(self, event: TrainBatchCompleted) -> None:
        self.waiting.append(len(self.trainer.recorder.inflight))
        latest = self.trainer.latest.get("seen_at")
        self.latest_steps.append((event.step, -1 if latest is None else latest.step))

    @on(EpochCompleted)
    def epoch(self, event: EpochCompleted) -> None:
        self.at_epoch_end.append(len(self.records))


def _expected(steps_per_epoch: int, epochs: int) -> list[tuple[str, int, int, Any]]:
    out: list[tuple[str, int, int, Any]] = []
    for epoch in range(epochs):
        for i in range(steps_per_epoch):
            before = epoch * steps_per_epoch + i  # global_step inside the step
            out += [
                ("seen_at", before + 1, epoch, float(before)),
                ("plain", before + 1, epoch, before),
            ]
    return out


@pytest.mark.parametrize("readback", [0, 2, None], indirect=True, ids=["next", "late", "never"])
async def test_every_record_arrives_once_in_order_with_its_step(readback: FakeReadback) -> None:
    watch = Watch()
    trainer = Trainer(max_epochs=2, plugins=[watch], device="cpu", put_lag=3)
    await trainer.fit(Counting(), make_loader(n=64, batch_size=8))
    assert watch.records == _expected(8, 2)  # the last step's records included
    assert readback.started == 16
    # Records wait for their values, never more than put_lag step flushes.
    assert max(watch.waiting) <= 3
    if readback.ready_after is None:
        assert max(watch.waiting) == 3
        assert readback.waited > 0  # the lag bound (and the epoch end) made them wait


@pytest.mark.parametrize("readback", [None], indirect=True)
async def test_epoch_boundaries_deliver_everything_first(readback: FakeReadback) -> None:
    watch = Watch()
    await Trainer(max_epochs=3, plugins=[watch], device="cpu", put_lag=100).fit(
        Counting(), make_loader(n=32, batch_size=8)
    )
    # At each EpochCompleted, every record of the epoch so far was delivered.
    assert watch.at_epoch_end == [8, 16, 24]
    assert watch.records == _expected(4, 3)


@pytest.mark.parametrize("readback", [None], indirect=True)
async def test_latest_serves_the_last_value_read_without_waiting(readback: FakeReadback) -> None:
    watch = Watch()
    await Trainer(max_epochs=1, plugins=[watch], device="cpu", put_lag=2).fit(
        Counting(), make_loader(n=64, batch_size=8)
    )
    # trainer.latest lags the step by up to put_lag steps: it never waits for a copy.
    assert all(step - seen <= 2 + 1 for step, seen in watch.latest_steps)
    assert any(seen < step for step, seen in watch.latest_steps)
    assert readback.waited <= 8  # waits come from the lag bound, not from reading latest


@pytest.mark.parametrize("readback", [None], indirect=True)
async def test_put_lag_zero_delivers_at_every_step(readback: FakeReadback) -> None:
    watch = Watch()
    await Trainer(max_epochs=1, plugins=[watch], device="cpu", put_lag=0).fit(
        Counting(), make_loader(n=32, batch_size=8)
    )
    assert watch.waiting == [0, 0, 0, 0]
    assert watch.latest_steps == [(1, 1), (2, 2), (3, 3), (4, 4)]


@pytest.mark.parametrize("readback", [None], indirect=True)
async def test_a_checkpoint_holds_the_records_still_on_their_way(
    readback: FakeReadback,
) -> None:
    saved: list[dict[str, Any]] = []

    class Save(Plugin):
        def setup(self, trainer: Trainer, stage: str) -> None:
            self.trainer = trainer

        @on(TrainBatchCompleted)
        def save(self, event: TrainBatchCompleted) -> None:
            if event.step == 5:
                saved.append(self.trainer.recorder.state_dict())

    await Trainer(max_epochs=1, plugins=[Save()], device="cpu", put_lag=4).fit(
        Counting(), make_loader(n=64, batch_size=8)
    )
    assert saved[0]["seen_at"]["step"] == 5
    assert saved[0]["seen_at"]["value"] == 4.0


def test_put_lag_is_validated() -> None:
    from loopbus import MisconfigurationError

    with pytest.raises(MisconfigurationError, match="put_lag"):
        Trainer(put_lag=-1, plugins=[])
