"""``find_lr`` under ``torchrun`` (DDP, or FSDP with ``--strategy fsdp``): every rank
sweeps, then trains; each writes its sweep, whether the weights came back, and its step
to ``--out/rank<N>.json``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import loopbus
from loopbus import Module, Trainer
from loopbus.plugins.tuning import find_lr


class Regression(Module):
    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        self.lr = lr

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def local(tensor: torch.Tensor) -> torch.Tensor:
    to_local = getattr(tensor, "to_local", None)
    return (to_local() if to_local is not None else tensor).detach().clone()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", default="ddp")
    args = parser.parse_args()
    loopbus.seed_everything(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    data = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)
    module = Regression()
    trainer = Trainer(strategy=args.strategy, device="cpu", max_epochs=1, plugins=[])
    # Where fit puts the module (sharded under FSDP), as find_lr does first.
    trainer.strategy.prepare_module(module, torch.device("cpu"), trainer.precision)
    before = [local(t) for t in module.state_dict().values()]
    result = find_lr(
        trainer, module, data, num_training=40, min_lr=1e-4, max_lr=100.0, update_attr=True
    )
    after = [local(t) for t in module.state_dict().values()]
    restored = len(before) == len(after) and all(map(torch.equal, before, after))
    trainer.fit(module, data)
    summary = {
        "strategy": trainer.strategy.name,
        "suggestion": result.suggestion,
        "lrs": result.lrs,
        "losses": result.losses,
        "stop_reason": result.early_stop_reason,
        "restored": restored,
        "fit_step": trainer.global_step,
    }
    (args.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
