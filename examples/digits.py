"""Train a small network on scikit-learn's bundled digits data (no download).

    ./dev demo                      # or: python examples/digits.py
    python examples/digits.py --epochs 30 --backend trio
    python examples/digits.py --serve --epochs 300   # then, elsewhere: loopbus watch 8765
    python examples/digits.py --compile              # steps and optimizer step compiled
    python examples/digits.py --find-lr              # sweep the learning rate, train at it
    python examples/digits.py --profile runs/prof    # torch.profiler traces of a few batches
    python examples/digits.py --throughput --ema     # throughput records; EMA weights

Shows the pieces a newcomer needs: a ``Module`` with ``training_step`` /
``validation_step``, torchmetrics for accuracy (aggregation is user code), ``put`` for
metrics, a handler of an event on the module itself, and ``loopbus.run`` from sync code.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torchmetrics
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import loopbus
from loopbus import Module, Trainer, on
from loopbus.events import ValidationCompleted


class DigitsNet(Module):
    """A two-layer MLP over the 8x8 digit images."""

    def __init__(
        self, hidden: int = 128, lr: float = 3e-3, epochs: int = 30, tensor_lr: bool = False
    ) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, hidden),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(hidden, 10),
        )
        self.lr = lr
        self.epochs = epochs
        self.tensor_lr = tensor_lr
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(
            num_classes=10, average="micro"
        )
        self.train_loss = torchmetrics.MeanMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.put("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, ctx: Any) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc.update(logits, y)
        self.put("val/loss", F.cross_entropy(logits, y), destinations=("loggers", "external"))

    @on(ValidationCompleted)
    def publish_accuracy(self, event: ValidationCompleted) -> None:
        # torchmetrics aggregates over the pass; put publishes the result.
        self.put("val/acc", self.val_acc.compute())
        self.val_acc.reset()

    def configure_optimizers(self) -> Any:
        # Compiled, the optimizer step reads the learning rate the scheduler changes:
        # as a tensor (filled in place) it compiles once; a float would be a constant.
        lr = torch.tensor(self.lr) if self.tensor_lr else self.lr
        optimizer = torch.optim.AdamW(self.parameters(), lr=lr, weight_decay=1e-4)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.epochs)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"},
        }


def digits_loaders(batch_size: int = 64, seed: int = 0) -> tuple[DataLoader[Any], DataLoader[Any]]:
    """Train/validation loaders over the digits data (80/20 split, features scaled to [0, 1])."""
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    x_tr, x_va, y_tr, y_va = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    generator = torch.Generator().manual_seed(seed)
    train = DataLoader(
        TensorDataset(x_tr, y_tr), batch_size=batch_size, shuffle=True, generator=generator
    )
    val = DataLoader(TensorDataset(x_va, y_va), batch_size=256)
    return train, val


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description="Train an MLP on the digits data with loopbus.")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--executor", choices=["inline", "thread"], default="inline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compile", action="store_true", help="compile the steps and the optimizer step"
    )
    parser.add_argument(
        "--serve",
        nargs="?",
        const="tcp://127.0.0.1:8765",
        metavar="ADDRESS",
        help="serve the records to other processes (`loopbus watch ADDRESS`); "
        "default address tcp://127.0.0.1:8765",
    )
    parser.add_argument(
        "--find-lr", action="store_true", help="sweep the learning rate first and train at it"
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="profile training batches 2-4 into DIR (torch.profiler)"
    )
    parser.add_argument(
        "--throughput", action="store_true", help="put samples/s and FLOPs every 10 steps"
    )
    parser.add_argument(
        "--ema", action="store_true", help="validate an exponential moving average of the weights"
    )
    args = parser.parse_args(argv)

    loopbus.seed_everything(args.seed)
    train, val = digits_loaders(seed=args.seed)
    module = DigitsNet(epochs=args.epochs, tensor_lr=args.compile)
    plugins = None  # the default: a progress bar
    tools = tuning_plugins(args)
    if args.serve or tools:
        from loopbus.plugins import ProgressBar, StreamServer

        plugins = [ProgressBar(), *tools]
        if args.serve:
            plugins.insert(0, StreamServer.from_address(args.serve))
    trainer = Trainer(
        max_epochs=args.epochs, executor=args.executor, plugins=plugins, compile=args.compile
    )
    if args.find_lr:
        from loopbus.plugins.tuning import find_lr

        found = loopbus.run(find_lr, trainer, module, train, update_attr=True, backend=args.backend)
        print(f"learning-rate finder: suggests {found.suggestion:.3g} (module.lr set to it)")
    loopbus.run(trainer.fit, module, train, val, backend=args.backend)

    accuracy = float(trainer.latest["val/acc"].value)
    print(f"validation accuracy after {trainer.current_epoch + 1} epochs: {accuracy:.2%}")
    return accuracy


def tuning_plugins(args: argparse.Namespace) -> list[loopbus.Plugin]:
    """The tuning tools the command line asked for (see docs/tuning.md)."""
    if not (args.profile or args.throughput or args.ema):
        return []
    from loopbus.plugins.tuning import Profiler, ThroughputMonitor, WeightAveraging

    tools: list[loopbus.Plugin] = []
    if args.profile:
        tools.append(Profiler(args.profile, wait=1, warmup=1, active=3))
    if args.throughput:
        tools.append(ThroughputMonitor(every_n_steps=10))
    if args.ema:
        tools.append(WeightAveraging.ema(decay=0.99))
    return tools


if __name__ == "__main__":
    main()
