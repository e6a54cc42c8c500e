"""``ModelSummary``: the table of top-level layers printed when ``fit`` starts."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from rich.console import Console

from loopbus import MisconfigurationError, Module, Plugin, Trainer, on
from loopbus.events import FitStarted
from loopbus.plugins import ModelSummary, ProgressBar
from tests.helpers import make_loader


class Layered(Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(4, 8)  # 40 parameters
        self.norm = torch.nn.BatchNorm1d(8)  # 16 (its running stats are buffers)
        self.head = torch.nn.Linear(8, 2)  # 18, frozen below
        self.big = torch.nn.Embedding(1000, 1250)  # 1 250 000
        self.act = torch.nn.ReLU()  # none
        for p in self.head.parameters():
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.act(self.norm(self.encoder(x))))
        return out

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        loss: torch.Tensor = torch.nn.functional.cross_entropy(self(x), y)
        return loss

    def predict_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        out: torch.Tensor = self(batch[0])
        return out

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1)


def rows(text: str) -> list[list[str]]:
    """The table's cells, row by row (rich's box characters as separators)."""
    out = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.replace("│", "┃").split("┃")]
        if len(cells) > 2:
            out.append(cells[1:-1])
    return out


async def test_the_table_lists_top_level_layers_and_totals() -> None:
    out = io.StringIO()
    summary = ModelSummary(console=Console(file=out, width=120))
    trainer = Trainer(max_epochs=1, plugins=[summary], device="cpu")
    await trainer.fit(Layered(), make_loader(n=16))
    table = rows(out.getvalue())
    assert table[0] == ["", "Name", "Type", "Params"]
    assert table[1:6] == [
        ["0", "encoder", "Linear", "40"],
        ["1", "norm", "BatchNorm1d", "16"],
        ["2", "head", "Linear", "18"],
        ["3", "big", "Embedding", "1.2 M"],
        ["4", "act", "ReLU", "0"],
    ]
    trainable = 40 + 16 + 1_250_000
    assert table[6:] == [
        ["", "Trainable params", "", "1.3 M"],
        ["", "Non-trainable params", "", "18"],
        ["", "Total params", "", "1.3 M"],
        ["", "Params size (MB)", "", f"{(trainable + 18) * 4 / 1e6:.3f}"],
    ]
    # The exact figures, as data.
    assert summary.summary is not None
    assert summary.summary.trainable == trainable
    assert summary.summary.non_trainable == 18
    assert summary.summary.total == trainable + 18
    assert summary.summary.size_mb == pytest.approx((trainable + 18) * 4 / 1e6)
    assert [layer.params for layer in summary.summary.layers] == [40, 16, 18, 1_250_000, 0]


async def test_size_follows_the_parameters_dtypes() -> None:
    out = io.StringIO()
    summary = ModelSummary(console=Console(file=out, width=120))
    module = Layered().to(torch.float64)
    trainer = Trainer(max_epochs=1, plugins=[summary], device="cpu")
    await trainer.fit(
        module, [(torch.randn(4, 4, dtype=torch.float64), torch.tensor([0, 1, 0, 1]))]
    )
    assert summary.summary is not None
    assert summary.summary.size_mb == pytest.approx(summary.summary.total * 8 / 1e6)


class Order(Plugin):
    def __init__(self, out: io.StringIO) -> None:
        self.out = out
        self.text_at_fit_started = ""

    @on(FitStarted)
    def started(self, event: FitStarted) -> None:
        self.text_at_fit_started = self.out.getvalue()


async def test_printed_once_when_fit_starts_not_for_other_stages() -> None:
    out = io.StringIO()
    order = Order(out)
    summary = ModelSummary(file=out)
    trainer = Trainer(max_epochs=2, plugins=[summary, order], device="cpu")
    module = Layered()
    await trainer.fit(module, make_loader(n=16))
    assert "Total params" in order.text_at_fit_started  # before the first event of fit
    assert out.getvalue().count("Total params") == 1
    await trainer.predict(module, make_loader(n=16))
    assert out.getvalue().count("Total params") == 1


async def test_enable_model_summary_false_turns_it_off() -> None:
    out = io.StringIO()
    summary = ModelSummary(file=out)
    trainer = Trainer(max_epochs=1, plugins=[summary], enable_model_summary=False, device="cpu")
    await trainer.fit(Layered(), make_loader(n=16))
    assert out.getvalue() == ""
    assert summary.summary is None


def test_it_is_a_default_plugin_acting_on_rank_zero() -> None:
    plugins = Trainer(max_epochs=1, device="cpu").plugins
    assert [type(p) for p in plugins] == [ProgressBar, ModelSummary]
    assert ModelSummary.delivery.ranks == "zero"
    assert Trainer(max_epochs=1, plugins=[], device="cpu").plugins == []


def test_bad_options_are_refused() -> None:
    with pytest.raises(MisconfigurationError, match=r"enable_model_summary must be True or False"):
        Trainer(max_epochs=1, enable_model_summary="no", device="cpu")  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationError, match=r"ModelSummary takes file= or console="):
        ModelSummary(file=io.StringIO(), console=Console())
