"""The results table printed after ``validate`` and ``test`` (rank 0, by the progress
bar), and its ``results_table`` option."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from loopbus import MisconfigurationError, Trainer
from loopbus.plugins import ProgressBar
from tests.helpers import TinyModule, make_loader

pytestmark = pytest.mark.anyio

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def recording_console() -> Console:
    return Console(file=io.StringIO(), record=True, width=80, color_system=None)


class TwoMetrics(TinyModule):
    def test_step(self, batch: object, ctx: object) -> None:
        super().test_step(batch, ctx)
        self.put("test/count", 7, destinations="loggers")


async def test_test_prints_the_stages_last_records() -> None:
    console = recording_console()
    module = TwoMetrics()
    trainer = Trainer(max_epochs=1, plugins=[ProgressBar(console=console)], device="cpu")
    await trainer.fit(module, make_loader(n=32), make_loader(n=32))
    assert "results" not in console.export_text(clear=True)  # not after fit
    result = await trainer.test(module, make_loader(n=32))
    text = console.export_text()
    lines = text.splitlines()
    title = next(i for i, line in enumerate(lines) if line.strip() == "Test results")
    header = lines[title + 2]
    assert re.search(r"Test metric\s+.*Value", header)
    rows = [
        re.findall(r"[^\s│┃|]+", line)
        for line in lines[title + 3 :]
        if "test/" in line or "val/" in line or "train/" in line
    ]
    # Sorted by name; every record the stage put (any destination), and only those.
    assert rows == [
        ["test/count", "7"],
        ["test/loss", f"{result['test/loss']:.6g}"],
    ]
    assert all(len(line) <= 80 for line in lines)


async def test_validate_prints_a_table_to_a_plain_file_too() -> None:
    out = io.StringIO()
    trainer = Trainer(plugins=[ProgressBar(file=out)], device="cpu")
    result = await trainer.validate(TinyModule(), make_loader(n=32))
    text = out.getvalue()
    assert not CONTROL.search(text), repr(text)
    assert "Validate results" in text
    (row,) = [line for line in text.splitlines() if "val/loss" in line and "│" in line]
    assert f"{result['val/loss']:.6g}" in row


async def test_results_table_false_prints_none() -> None:
    out = io.StringIO()
    trainer = Trainer(plugins=[ProgressBar(file=out, results_table=False)], device="cpu")
    await trainer.test(TinyModule(), make_loader(n=32))
    text = out.getvalue()
    assert "Test: 2 batches in" in text
    assert "results" not in text
    assert "Test metric" not in text


async def test_a_failed_stage_prints_no_table() -> None:
    class Broken(TinyModule):
        def test_step(self, batch: object, ctx: object) -> None:
            self.put("test/partial", 1.0)
            raise ValueError("broken test_step")

    console = recording_console()
    trainer = Trainer(plugins=[ProgressBar(console=console)], device="cpu")
    with pytest.raises(ValueError, match="broken test_step"):
        await trainer.test(Broken(), make_loader(n=32))
    assert "results" not in console.export_text()


def test_results_table_must_be_a_bool() -> None:
    with pytest.raises(MisconfigurationError, match=r"results_table=.*True or False, got 'no'"):
        ProgressBar(results_table="no")  # type: ignore[arg-type]
