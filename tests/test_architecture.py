"""The engine's shape, as the training-step issue measures it (benchmarks/architecture.py):
TrainEpochLoop and the Trainer class within their sizes, no function in engine/ over 80
lines, the loops reading a narrow host, no state written into another object from afar,
and no import of the trainer from the parts it runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _architecture() -> object:
    spec = importlib.util.spec_from_file_location(
        "loopbus_architecture", ROOT / "benchmarks" / "architecture.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_figure_is_within_its_target() -> None:
    report = _architecture().measure()  # type: ignore[attr-defined]
    off = [(name, value, target) for name, value, target, ok in report.figures if not ok]
    assert not off, off
    names = [name for name, *_ in report.figures]
    assert len(names) == 6, names
