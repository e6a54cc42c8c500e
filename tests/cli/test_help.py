"""``loopbus --help``, ``loopbus fit --help`` and a file that does not parse: answered
without importing torch (a process of their own, to see what it imports)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

CODE = """
import sys
from loopbus.__main__ import main
try:
    status = main(sys.argv[1:])
except SystemExit as exc:
    status = exc.code
print("STATUS", status, "TORCH", "torch" in sys.modules)
"""


@pytest.mark.external
def test_help_and_a_bad_file_do_not_import_torch(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [1,\n")
    for argv, status in (
        (["--help"], 0),
        (["fit", "--help"], 0),
        (["fit", "--config", str(bad)], 2),
    ):
        done = subprocess.run(
            [sys.executable, "-c", CODE, *argv], capture_output=True, text=True, check=True
        )
        assert done.stdout.strip().endswith(f"STATUS {status} TORCH False"), (
            argv,
            done.stdout,
            done.stderr,
        )
        if argv == ["fit", "--help"]:
            assert "--print-config" in done.stdout
            assert "--trainer.max_epochs=3" in done.stdout
