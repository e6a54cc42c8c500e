"""Put records are resolved (tensors read as numbers) in one batched read per flush and
delivered exactly once, in the order they were put, with their step and epoch."""

from __future__ import annotations

from typing import Any

import torch

from loopbus import Module, PutRecord, Trainer
from loopbus.records._readback import resolve as _resolve


class Many(Module):
    """Puts eight values of mixed kinds every step (the issue's "8 puts per step")."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Linear(2, 1)

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        loss = self.w(batch).pow(2).mean()
        step = self.trainer.global_step  # the step this record belongs to
        self.put("loss", loss)
        self.put("f32", torch.tensor(step + 0.5))
        self.put("f64", torch.tensor(step + 0.25, dtype=torch.float64))
        self.put("i64", torch.tensor(step))
        self.put("flag", torch.tensor(step % 2 == 0))
        self.put("bf16", torch.tensor(float(step), dtype=torch.bfloat16))
        self.put("plain", step * 10)
        self.put("vec", torch.tensor([step + 0.75]))
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


NAMES = ["loss", "f32", "f64", "i64", "flag", "bf16", "plain", "vec"]


async def test_every_record_arrives_once_in_order_with_its_step() -> None:
    inline: list[PutRecord] = []
    queued: list[PutRecord] = []
    trainer = Trainer(max_epochs=2, plugins=[], device="cpu")
    trainer.subscribe(PutRecord, inline.append)
    trainer.subscribe(PutRecord, queued.append, mode="queued", destination="loggers")
    data = [torch.full((3, 2), float(i)) for i in range(5)]
    await trainer.fit(Many(), data)
    assert trainer.global_step == 10
    for records in (inline, queued):
        assert [r.name for r in records] == NAMES * 10
        for k in range(10):
            chunk = records[k * 8 : (k + 1) * 8]
            # put during step k, flushed after it: step number k + 1, epoch k // 5
            assert {r.step for r in chunk} == {k + 1}, chunk
            assert {r.epoch for r in chunk} == {k // 5}
            values = {r.name: r.value for r in chunk}
            assert values["f32"] == k + 0.5
            assert type(values["f32"]) is float
            assert values["f64"] == k + 0.25
            assert values["i64"] == k
            assert type(values["i64"]) is int
            assert values["flag"] is (k % 2 == 0)
            assert values["bf16"] == float(k)
            assert values["plain"] == k * 10
            assert values["vec"] == k + 0.75
            assert isinstance(values["loss"], float)
    assert inline == queued
    # The last step's records are there, and trainer.latest has the last of each name.
    assert trainer.latest["i64"].value == 9
    assert trainer.latest["i64"].step == 10


def test_resolve_reads_each_dtype_once_and_keeps_types() -> None:
    values: list[Any] = [
        torch.tensor(1.5),
        3,
        torch.tensor(2),
        torch.tensor([2.5]),
        torch.tensor(True),
        0.5,
        torch.tensor(7),
    ]
    out = _resolve(values)
    assert out == [1.5, 3, 2, 2.5, True, 0.5, 7]
    assert [type(v) for v in out] == [float, int, int, float, bool, float, int]
    assert _resolve([1, 2.0]) == [1, 2.0]


def test_scalar_detaches_and_reshapes_only_what_needs_it() -> None:
    from loopbus.data._device import scalar

    w = torch.ones(1, requires_grad=True)
    graph = (w * 3).sum()  # 0-d, requires grad
    detached = scalar(graph)
    assert (detached.ndim, detached.requires_grad, float(detached)) == (0, False, 3.0)
    plain = torch.tensor(2.5)
    assert scalar(plain) is plain  # nothing to do: no dispatch
    vector = torch.tensor([[7.0]])
    assert (scalar(vector).shape, float(scalar(vector))) == (torch.Size([]), 7.0)
    # Stacking what scalar returns builds no backward node.
    assert torch.stack([scalar(graph), scalar(plain)]).grad_fn is None
