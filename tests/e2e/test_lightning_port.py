"""The Lightning port (examples/lightning_port.py) runs as a Lightning user runs it: `fit`
from synchronous code, `compile=True` with torchmetrics updated inside the steps (the
number of compilations does not grow with the steps), `test(ckpt_path="best")` without
the module, and its TensorBoard and CSV logs read back."""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT

EXAMPLE = ROOT / "examples" / "lightning_port.py"

pytestmark = [
    pytest.mark.external,
    pytest.mark.skipif(
        importlib.util.find_spec("tensorboard") is None
        or importlib.util.find_spec("sklearn") is None,
        reason="needs tensorboard and scikit-learn",
    ),
]


def _run(*argv: str) -> dict[str, Any]:
    spec = importlib.util.spec_from_file_location("lightning_port", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["lightning_port"] = module
    try:
        spec.loader.exec_module(module)
        with warnings.catch_warnings():
            # A metric call is a graph break; torch then warns once about reading the
            # .grad of a non-leaf tensor while it traces (harmless; docs/performance.md).
            warnings.filterwarnings("ignore", message=r"The \.grad attribute of a Tensor")
            return module.main(list(argv))  # type: ignore[no-any-return]
    finally:
        sys.modules.pop("lightning_port", None)


def test_the_ported_classifier_runs_from_sync_code_compiled(tmp_path: Path) -> None:
    short = _run("--epochs", "2", "--out", str(tmp_path / "short"))
    full = _run("--epochs", "4", "--out", str(tmp_path / "full"))
    # Twice the steps, the same compilations: nothing recompiles per step.
    assert full["steps"] == 2 * short["steps"] > 0
    assert full["compilations"] == short["compilations"]
    assert 1 <= full["compilations"] <= 8
    # test(ckpt_path="best") without a module: the best checkpoint's weights, tested.
    assert Path(full["best"]).is_relative_to(tmp_path / "full" / "ckpts")
    assert full["test/acc"] > 0.8
    # The logs read back: one val/acc per epoch in the CSV; TensorBoard has the scalars.
    assert len(full["csv_val_acc"]) == 4
    assert all(0.0 <= value <= 1.0 for value in full["csv_val_acc"])
    assert {"train/loss", "train/acc", "val/acc"} <= set(full["tensorboard_tags"])
    assert full["log_dir"].endswith("loopbus_logs/version_0")
