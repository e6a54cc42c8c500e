"""Small models and data shared by the tests, and the benchmark scripts as modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from loopbus import Module


class TinyModule(Module):
    """A linear classifier that puts its loss every step."""

    def __init__(self, n_in: int = 4, n_out: int = 2, lr: float = 0.1) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(n_in, n_out)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.put("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, ctx: Any) -> None:
        x, y = batch
        self.put("val/loss", torch.nn.functional.cross_entropy(self(x), y))

    def test_step(self, batch: Any, ctx: Any) -> None:
        x, y = batch
        self.put("test/loss", torch.nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def make_loader(n: int = 64, batch_size: int = 16, seed: int = 0, shuffle: bool = False) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle)


#: The repository's root folder.
ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module (``loopbus_<name>``), with the benchmarks'
    folder on the import path as when the script runs (its shared ``_harness``)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(f"loopbus_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
