"""``loopbus --help``, ``loopbus fit --help``, a file that does not parse and an unknown
or mistyped ``trainer`` key: answered without importing torch (a process of their own, to
see what it imports); the keys the first checks know are the declarations'."""

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
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        "trainer:\n  max_epoch: 3\n  put_lag: x\n  yield_interval: 0.1\n  callbacks: []\n"
        "model: {class_path: tests.helpers.TinyModule}\n"
        "data: {class_path: tests.cli.fixtures.loaders}\n"
    )
    for argv, status in (
        (["--help"], 0),
        (["fit", "--help"], 0),
        (["fit", "--config", str(bad)], 2),
        (["fit", "--config", str(keys)], 2),
    ):
        done = subprocess.run(
            [sys.executable, "-c", CODE, *argv], capture_output=True, text=True, check=True
        )
        assert done.stdout.strip().endswith(f"STATUS {status} TORCH False"), (
            argv,
            done.stdout,
            done.stderr,
        )
        if keys in map(Path, argv[2:]):
            assert "the configuration has 4 errors" in done.stderr, done.stderr
        if argv == ["fit", "--help"]:
            assert "--print-config" in done.stdout
            assert "--trainer.max_epochs=3" in done.stdout


def test_the_keys_checked_before_torch_are_the_declarations() -> None:
    from loopbus.cli import _trainer_keys

    with open(_trainer_keys.__file__, encoding="utf-8") as file:
        written = file.read()
    assert written == _trainer_keys.render(), (
        "src/loopbus/cli/_trainer_keys.py is out of date with the Trainer options' "
        "declarations: run python -m loopbus.cli._trainer_keys"
    )
