"""``ModelSummary``: a table of the module's top-level layers when ``fit`` starts.

Written against the public API only, like a user's plugin.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

import torch
from rich.console import Console
from rich.table import Table

from loopbus import Delivery, MisconfigurationError, Plugin

if TYPE_CHECKING:
    from loopbus import TrainerView

__all__ = ["LayerSummary", "ModelSummary", "Summary", "summarize"]


@dataclass(frozen=True)
class LayerSummary:
    """One top-level child of the module: its attribute name, class name and number of
    parameters (shared parameters counted once per layer that holds them)."""

    name: str
    type: str
    params: int


@dataclass(frozen=True)
class Summary:
    """What :func:`summarize` found: the top-level layers and the module's totals (each
    parameter counted once, however many layers share it); ``size_mb`` is the memory the
    parameters take, in megabytes (10**6 bytes), at their current dtypes."""

    module: str
    layers: tuple[LayerSummary, ...]
    trainable: int
    non_trainable: int
    size_mb: float

    @property
    def total(self) -> int:
        return self.trainable + self.non_trainable


def summarize(module: torch.nn.Module) -> Summary:
    """The :class:`Summary` of ``module``'s top-level children and parameters."""
    layers = tuple(
        LayerSummary(name, type(child).__name__, sum(p.numel() for p in child.parameters()))
        for name, child in module.named_children()
    )
    trainable = non_trainable = size = 0
    for param in module.parameters():  # each parameter once
        n = param.numel()
        if param.requires_grad:
            trainable += n
        else:
            non_trainable += n
        size += n * param.element_size()
    return Summary(type(module).__name__, layers, trainable, non_trainable, size / 1e6)


def format_count(n: int) -> str:
    """``n`` the way the table shows it: ``"950"``, ``"12.3 K"``, ``"1.2 M"``, ``"7.0 B"``."""
    if n < 1000:
        return str(n)
    value = float(n)
    for unit in ("K", "M", "B"):
        value /= 1000
        if value < 1000 or unit == "B":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


def render(summary: Summary) -> Table:
    """The rich table of ``summary``: one row per layer, then the totals."""
    table = Table(title=f"{summary.module}", title_justify="left", show_footer=False)
    table.add_column("", justify="right", style="dim")
    table.add_column("Name")
    table.add_column("Type")
    table.add_column("Params", justify="right")
    for index, layer in enumerate(summary.layers):
        table.add_row(str(index), layer.name, layer.type, format_count(layer.params))
    table.add_section()
    table.add_row("", "Trainable params", "", format_count(summary.trainable))
    table.add_row("", "Non-trainable params", "", format_count(summary.non_trainable))
    table.add_row("", "Total params", "", format_count(summary.total))
    table.add_row("", "Params size (MB)", "", f"{summary.size_mb:.3f}")
    return table


class ModelSummary(Plugin):
    """Prints a table of the module's top-level layers (name, type, parameters) and its
    totals (trainable and non-trainable parameters, their size in MB) when ``fit``
    starts, before the sanity check and the first epoch.

    One of the default plugins (``Trainer()`` has one, next to the progress bar);
    ``Trainer(enable_model_summary=False)`` turns it off, and so does a ``plugins`` list
    without it. Acts on rank 0 only. ``file`` writes to that file instead of standard
    error; ``console`` uses a rich ``Console`` as it is configured.
    """

    #: Printed once, by rank 0, in a distributed run.
    delivery = Delivery(ranks="zero")

    def __init__(self, *, file: IO[str] | None = None, console: Console | None = None) -> None:
        if file is not None and console is not None:
            raise MisconfigurationError(
                "ModelSummary takes file= or console=, not both; configure the console to "
                "write to the file instead: console=Console(file=...)."
            )
        self._file = file
        self._console = console
        #: The summary printed at the start of the last ``fit`` (None before one).
        self.summary: Summary | None = None

    def setup(self, trainer: TrainerView, stage: str) -> None:
        if stage != "fit" or not trainer.enable_model_summary or trainer.module is None:
            return
        self.summary = summarize(trainer.module)
        console = self._console
        if console is None:
            console = Console(file=self._file if self._file is not None else sys.stderr)
        console.print(render(self.summary))
