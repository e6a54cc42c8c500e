"""Shared set-up of the configuration command's tests: a run of ``loopbus.cli.main``
that returns its exit status and what it printed, and a small configuration file."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from loopbus.cli import main

#: A configuration over the test helpers' tiny module and loader: quick to check and run.
TINY: dict[str, Any] = {
    "seed_everything": 0,
    "trainer": {"max_epochs": 1, "enable_model_summary": False, "plugins": []},
    "model": {"class_path": "tests.helpers.TinyModule", "init_args": {"lr": 0.05}},
    "data": {"class_path": "tests.helpers.make_loader", "init_args": {"n": 32}},
}

Run = Callable[..., tuple[int, str, str]]


@pytest.fixture
def cli(capsys: pytest.CaptureFixture[str]) -> Run:
    """``cli("fit", "--config", ...)``: the exit status, stdout and stderr."""

    def run(*argv: str) -> tuple[int, str, str]:
        status = main(list(argv))
        out, err = capsys.readouterr()
        return status, out, err

    return run


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    """:data:`TINY` as a JSON file (YAML reads it too)."""
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path
