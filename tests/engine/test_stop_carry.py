"""The DDP step adapter carries this rank's stop request in the loss's gradient: the
returned loss keeps its value and dtype, and the stop flag's gradient is 1 when the rank
asked to stop and 0 when not (DDP then averages it with the other gradients)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loopbus import Module
from loopbus.engine._strategy import TrainingStepAdapter


class Tiny(Module):
    def __init__(self, dtype: torch.dtype = torch.float32, as_dict: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.dtype = dtype
        self.as_dict = as_dict

    def training_step(self, batch: Any, ctx: Any) -> Any:
        loss = self.layer(batch).pow(2).mean().to(self.dtype)
        return {"loss": loss, "extra": 1} if self.as_dict else loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("asked", [False, True])
@pytest.mark.parametrize("as_dict", [False, True])
def test_the_loss_carries_the_request_without_changing(
    dtype: torch.dtype, asked: bool, as_dict: bool
) -> None:
    torch.manual_seed(0)
    module = Tiny(dtype, as_dict)
    adapter = TrainingStepAdapter(module, lambda: asked)
    batch = torch.randn(4, 3)
    expected = module.training_step(batch, None)
    out = adapter(batch, None)
    loss = out["loss"] if as_dict else out
    plain = expected["loss"] if as_dict else expected
    assert loss.dtype == dtype
    assert torch.equal(loss, plain)
    if as_dict:
        assert out["extra"] == 1
    loss.backward()
    flag = adapter.stop_flag
    assert flag is not None
    assert flag.grad is not None
    assert flag.grad.item() == (1.0 if asked else 0.0)
    assert flag.item() == 0.0
    # The module's own gradients are those of the plain loss.
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    plain.backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(grads, module.parameters(), strict=True))


def test_without_a_request_source_the_output_passes_through() -> None:
    module = Tiny()
    adapter = TrainingStepAdapter(module)
    assert adapter.stop_flag is None
    batch = torch.randn(2, 3)
    assert torch.equal(adapter(batch, None), module.training_step(batch, None))
