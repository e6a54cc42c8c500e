"""A Lightning classifier ported to loopbus, run the way a Lightning user runs it.

    python examples/lightning_port.py            # compiled steps, logs under runs/
    python examples/lightning_port.py --eager    # the same, without torch.compile

What it shows (see docs/lightning.md for the side by side):

* ``trainer.fit(...)`` called from plain synchronous code runs to the end;
* ``Trainer(compile=True)`` with torchmetrics metrics updated inside ``training_step`` and
  ``validation_step``: the metrics stay eager, and the number of compilations does not
  grow with the number of steps (counted and printed);
* ``Checkpoint`` keeping the best by ``val/acc``, ``EarlyStopping``, ``LearningRateMonitor``,
  a cosine schedule, TensorBoard and CSV loggers in Lightning's ``name/version_N`` layout;
* ``trainer.test(test_loader, ckpt_path="best")`` without passing the module again;
* the TensorBoard and CSV logs read back.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.classification import MulticlassAccuracy

import loopbus
from loopbus import Module, Trainer, on
from loopbus.events import TestCompleted, TrainEpochCompleted, ValidationCompleted
from loopbus.plugins import (
    Checkpoint,
    CSVLogger,
    EarlyStopping,
    LearningRateMonitor,
    TensorBoardLogger,
    read_csv,
)


class Classifier(Module):
    """What a LightningModule becomes: ``self.log`` -> ``self.put``, epoch aggregates from
    torchmetrics in event handlers, hyperparameters as before."""

    def __init__(self, lr: float = 3e-3, epochs: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
        )
        self.train_acc = MulticlassAccuracy(num_classes=10)  # macro, the default
        self.val_acc = MulticlassAccuracy(num_classes=10)
        self.test_acc = MulticlassAccuracy(num_classes=10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits, y)
        self.train_acc.update(logits, y)  # a metric update inside the compiled step
        self.put("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, ctx: Any) -> None:
        x, y = batch
        self.val_acc.update(self(x), y)

    def test_step(self, batch: Any, ctx: Any) -> None:
        x, y = batch
        self.test_acc.update(self(x), y)

    @on(TrainEpochCompleted)
    def train_epoch_end(self, event: TrainEpochCompleted) -> None:
        self.put("train/acc", self.train_acc.compute())
        self.train_acc.reset()

    @on(ValidationCompleted)
    def validation_end(self, event: ValidationCompleted) -> None:
        self.put("val/acc", self.val_acc.compute())
        self.val_acc.reset()

    @on(TestCompleted)
    def test_end(self, event: TestCompleted) -> None:
        self.put("test/acc", self.test_acc.compute())
        self.test_acc.reset()

    def configure_optimizers(self) -> Any:
        # A tensor learning rate lets the compiled optimizer step follow the schedule
        # without compiling again (a Python float would keep it eager, with a warning).
        opt = torch.optim.AdamW(self.parameters(), lr=torch.tensor(self.hparams.lr))
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.hparams.epochs)
        return {"optimizer": opt, "lr_scheduler": sched}


def loaders(seed: int = 0) -> tuple[DataLoader[Any], DataLoader[Any], DataLoader[Any]]:
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    x_train, x_rest, y_train, y_rest = train_test_split(x, y, test_size=0.4, random_state=seed)
    x_val, x_test, y_val, y_test = train_test_split(x_rest, y_rest, test_size=0.5, random_state=seed)
    generator = torch.Generator().manual_seed(seed)
    return (
        DataLoader(TensorDataset(x_train, y_train), batch_size=64, shuffle=True, generator=generator),
        DataLoader(TensorDataset(x_val, y_val), batch_size=128),
        DataLoader(TensorDataset(x_test, y_test), batch_size=128),
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eager", action="store_true", help="run without torch.compile")
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    out = args.out if args.out is not None else Path(tempfile.mkdtemp(prefix="lightning-port-"))

    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    loopbus.seed_everything(0)
    train, val, test = loaders()
    checkpoint = Checkpoint(out / "ckpts", monitor="val/acc", mode="max")
    tensorboard = TensorBoardLogger(out / "runs")
    csv = CSVLogger(out / "runs")
    trainer = Trainer(
        max_epochs=args.epochs,
        compile=not args.eager,
        device="cpu",
        plugins=[
            checkpoint,
            EarlyStopping("val/acc", mode="max", patience=3),
            LearningRateMonitor(),
            tensorboard,
            csv,
        ],
    )
    trainer.fit(Classifier(epochs=args.epochs), train, val)  # plain sync code
    compilations = int(counters["stats"]["unique_graphs"])
    tested = trainer.test(test, ckpt_path="best")  # the fitted module, best weights

    rows = read_csv(csv.path)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tensorboard.log_dir))
    events.Reload()
    summary = {
        "steps": trainer.global_step,
        "compilations": compilations,
        "best": str(checkpoint.best_checkpoint_path),
        "test/acc": tested["test/acc"],
        "csv_rows": len(rows),
        "csv_val_acc": [r["val/acc"] for r in rows if r.get("val/acc") is not None],
        "tensorboard_tags": sorted(events.Tags()["scalars"]),
        "log_dir": str(csv.log_dir),
    }
    print(
        f"{summary['steps']} steps, {compilations} compilations, best {checkpoint.best_checkpoint_path}, "
        f"test/acc {tested['test/acc']:.3f}; logs in {csv.log_dir}"
    )
    return summary


if __name__ == "__main__":
    main()
