"""The engine's shape, as the training-step issue measures it (benchmarks/architecture.py):
TrainEpochLoop and the Trainer class within their sizes, no function in engine/ over 80
lines, the loops reading a narrow host, no state written into another object from afar,
and no import of the trainer from the parts it runs."""

from __future__ import annotations

from tests.helpers import load_benchmark


def test_every_figure_is_within_its_target() -> None:
    report = load_benchmark("architecture").measure()
    off = [(name, value, target) for name, value, target, ok in report.figures if not ok]
    assert not off, off
    names = [name for name, *_ in report.figures]
    assert len(names) == 6, names
