"""``loopbus fit|validate|test --config`` runs: the digits example's file trains to the
weights its Python script gives, the run folder gets the resolved configuration, and
``--resume`` continues a run in its folder."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

import loopbus
from tests.cli.conftest import Run
from tests.cli.fixtures import SaveWeights
from tests.helpers import ROOT

DIGITS = str(ROOT / "examples" / "digits.yaml")
SHORT = (
    "--trainer.max_steps=3",
    "--trainer.limit_val_batches=1",
    "--trainer.enable_model_summary=false",
)


def test_the_digits_file_trains_as_the_script_does(cli: Run, tmp_path: Path) -> None:
    saved = tmp_path / "cli.pt"
    plugin = f"--trainer.plugins=[{{class_path: tests.cli.fixtures.SaveWeights, init_args: {{path: '{saved}'}}}}]"
    status, _, err = cli("fit", "--config", DIGITS, *SHORT, plugin)
    assert status == 0, err

    from examples.digits import DigitsNet, digits_loaders  # what the file names

    loopbus.seed_everything(0)
    module = DigitsNet(hidden=128, lr=3e-3, epochs=30)
    train, val = digits_loaders(batch_size=64, seed=0)
    script = tmp_path / "script.pt"
    trainer = loopbus.Trainer(
        max_epochs=30,
        max_steps=3,
        limit_val_batches=1,
        enable_model_summary=False,
        plugins=[SaveWeights(str(script))],
    )
    loopbus.run(trainer.fit, module, train, val)
    ours, theirs = torch.load(saved, weights_only=True), torch.load(script, weights_only=True)
    assert ours.keys() == theirs.keys()
    for name in ours:
        torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)


def test_the_run_folder_holds_the_resolved_configuration(
    cli: Run, tiny: Path, tmp_path: Path
) -> None:
    root = tmp_path / "runs"
    status, printed, _ = cli(
        "fit", "--config", str(tiny), f"--trainer.root_dir={root}", "--print-config"
    )
    assert status == 0
    assert not root.exists()
    status, _, err = cli("fit", "--config", str(tiny), f"--trainer.root_dir={root}")
    assert status == 0, err
    written = yaml.safe_load((root / "loopbus_logs" / "version_0" / "config.yaml").read_text())
    assert written == yaml.safe_load(printed)


def test_validate_and_test_print_their_results(cli: Run, tiny: Path) -> None:
    status, out, err = cli("test", "--config", str(tiny))
    assert status == 0, err
    assert set(yaml.safe_load(out)["test"]) == {"test/loss"}
    status, out, _ = cli("validate", "--config", str(tiny))
    assert status == 0
    assert set(yaml.safe_load(out)["validate"]) == {"val/loss"}


def test_resume_continues_the_run_in_its_folder(cli: Run, tiny: Path, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    first = (
        "--config",
        str(tiny),
        f"--trainer.root_dir={root}",
        "--trainer.max_steps=2",
        "--trainer.plugins=[Checkpoint]",
    )
    status, _, err = cli("fit", *first, "--trainer.plugins.0.init_args.every_n_steps=1")
    assert status == 0, err
    run_dir = root / "loopbus_logs" / "version_0"
    status, _, err = cli("fit", "--resume", str(run_dir), "--trainer.max_steps=4")
    assert status == 0, err
    assert f"loopbus fit: resuming {run_dir}" in err
    assert "  trainer.max_steps: 2 -> 4  # command line: --trainer.max_steps=4" in err
    assert f"  ckpt_path: null -> last  # --resume {run_dir}" in err
    assert sorted(p.name for p in (root / "loopbus_logs").iterdir()) == [
        "version_0"
    ]  # the same folder
    run = json.loads((run_dir / "run.json").read_text())
    assert run["resumed_from_step"] == 2
    assert run["earlier"][0]["config"] == "config.yaml"
    assert yaml.safe_load((run_dir / run["config"]).read_text())["trainer"]["max_steps"] == 4


def test_resume_needs_a_run_folder_with_a_configuration(cli: Run, tmp_path: Path) -> None:
    status, _, err = cli("fit", "--resume", str(tmp_path))
    assert status == 2
    assert "it holds no config.yaml, so it is no run folder" in err
    assert cli("test", "--resume", str(tmp_path))[0] == 2


def test_no_engine_package_imports_the_cli() -> None:
    from tests.project.test_dependencies import ENGINE, SRC, imports_of

    for package in (*ENGINE, "plugins", "events", "stream", "dashboard"):
        for path in (SRC / package).rglob("*.py"):
            assert not any(name.startswith("loopbus.cli") for name, _ in imports_of(path)), path
