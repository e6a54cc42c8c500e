"""Run folders written by the real loggers, for the dashboard's tests: a short ``fit`` of
TinyModule for each of the CSV, JSONL and TensorBoard loggers, each in a run folder of its
own (``root/<kind>/version_0``), with a learning rate and a seed of its own.

    python -m tests.dashboard.runs ROOT      # writes them (the browser test's runs)
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import loopbus
from loopbus.plugins.loggers import CSVLogger, JSONLLogger, TensorBoardLogger
from tests.helpers import TinyModule, make_loader

#: kind -> (learning rate, seed).
KINDS: dict[str, tuple[float, int]] = {"csv": (0.1, 1), "jsonl": (0.05, 2), "tb": (0.1, 3)}


class Seeded(TinyModule):
    """TinyModule with its learning rate and seed as hyperparameters."""

    def __init__(self, lr: float, seed: int) -> None:
        super().__init__(lr=lr)
        self.seed = seed
        self.save_hyperparameters()

    def training_step(self, batch: Any, ctx: Any) -> Any:
        loss = super().training_step(batch, ctx)
        self.put("train/size", len(batch[0]))  # an integer record
        return loss


def write_run(root: Path, kind: str, *, epochs: int = 2, reference: Path | None = None) -> Path:
    """One run folder, ``root/kind/version_0``, written by ``kind``'s logger; with
    ``reference``, a JSONL logger writes the same records there too (outside ``root``)."""
    lr, seed = KINDS[kind]
    loopbus.seed_everything(seed)
    plugins: list[loopbus.Plugin] = [
        {"csv": CSVLogger, "jsonl": JSONLLogger, "tb": TensorBoardLogger}[kind]()
    ]
    if reference is not None:
        plugins.append(JSONLLogger(reference, name="", version=""))
    trainer = loopbus.Trainer(
        max_epochs=epochs, plugins=plugins, device="cpu", root_dir=root, name=kind
    )
    loopbus.run(trainer.fit, Seeded(lr, seed), make_loader(64, 16), make_loader(32, 16, seed=1))
    assert trainer.run_dir is not None
    return Path(trainer.run_dir)


def write_runs(root: Path, reference: Path | None = None) -> dict[str, Path]:
    """A run folder per kind under ``root``; the TensorBoard run's records also as JSONL
    in ``reference`` (to compare with)."""
    return {
        kind: write_run(root, kind, reference=reference if kind == "tb" else None) for kind in KINDS
    }


if __name__ == "__main__":
    write_runs(Path(sys.argv[1]))
