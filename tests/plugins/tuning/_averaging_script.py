"""Run under ``torchrun --nproc_per_node=2`` (gloo, CPU) by test_averaging.py: an EMA of
the weights under DDP, then the refusal under FSDP. Writes ``rank<r>.pt`` (the average,
the module's final weights, its weights after every step) and ``fsdp.json`` (rank 0)
into the folder given as the first argument."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from loopbus import MisconfigurationError, Module, Trainer, on
from loopbus.events import TrainBatchCompleted
from loopbus.plugins.tuning import WeightAveraging


class Net(Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        self.snapshots: dict[str, dict[str, torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)

    @on(TrainBatchCompleted)
    def snapshot(self, event: TrainBatchCompleted) -> None:
        weights = {k: v.detach().clone() for k, v in self.state_dict().items()}
        self.snapshots[str(self.trainer.global_step)] = weights


def _data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    return DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8)


async def main(out: Path) -> None:
    torch.manual_seed(0)  # the same initial weights on every rank
    module = Net()
    averaging = WeightAveraging.ema(0.75, every_n_steps=2)
    trainer = Trainer(
        max_epochs=2, strategy="ddp", plugins=[averaging], device="cpu", num_sanity_val_steps=0
    )
    await trainer.fit(module, _data())
    assert averaging.averaged_model is not None
    rank = trainer.global_rank
    torch.save(
        {
            "world_size": trainer.world_size,
            "steps": trainer.global_step,
            "n_averaged": averaging.n_averaged,
            "averaged": dict(averaging.averaged_model.module.state_dict()),
            "module": dict(module.state_dict()),
            "snapshots": module.snapshots,
        },
        out / f"rank{rank}.pt",
    )

    refusal = ""
    fsdp = Trainer(max_steps=1, strategy="fsdp", plugins=[WeightAveraging.ema()], device="cpu")
    try:
        await fsdp.fit(Net(), _data())
    except MisconfigurationError as exc:
        refusal = str(exc)
    if rank == 0:
        (out / "fsdp.json").write_text(json.dumps({"refusal": refusal}))
    dist.barrier()


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]))
