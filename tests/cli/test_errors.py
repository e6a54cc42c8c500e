"""Every bad input of ``loopbus fit --config``: exit status 2, each problem with its key's
full path, the bad value and the fix; nothing built or written first."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.cli.conftest import Run

BAD = [
    (
        ["--trainer.max_epoch=3"],
        "trainer.max_epoch (command line: --trainer.max_epoch=3): is not a Trainer option; did you mean 'max_epochs'?",
    ),
    (
        ["--trainer.max_epochs=three"],
        "trainer.max_epochs (command line: --trainer.max_epochs=three): max_epochs must be",
    ),
    (
        ["--trainer.gradient_clip_val=-1"],
        "gradient_clip_val must be a positive number or None, got -1",
    ),
    (
        ["--trainer.callbacks=[]"],
        "trainer.callbacks (command line: --trainer.callbacks=[]): loopbus calls callbacks and loggers plugins; list them under trainer.plugins:\n      trainer:\n        plugins:\n          - class_path: Checkpoint",
    ),
    (
        ["--trainer.logger=true"],
        "trainer.logger (command line: --trainer.logger=true): loopbus calls callbacks",
    ),
    (
        ["--trainer.yield_interval=0.1"],
        "trainer.yield_interval (command line: --trainer.yield_interval=0.1): was renamed: write trainer.yield_interval_s.",
    ),
    (
        ["--modle.init_args.lr=1"],
        "modle (command line: --modle.init_args.lr=1): is not a key of the configuration; did you mean 'model'?",
    ),
    (["--print"], "print: --print needs a value"),
    (
        ["--print=1"],
        "print (command line: --print=1): is not a key of the configuration; did you mean 'print-config'?",
    ),
    (
        ["--optimizer.lr=1"],
        "optimizer (command line: --optimizer.lr=1): loopbus builds optimizers in the module's configure_optimizers()",
    ),
    (
        ["--seed_everything=x"],
        "seed_everything (command line: --seed_everything=x): must be an int",
    ),
    (
        ["--model.init_args.lrr=0.1"],
        "model.init_args.lrr (command line: --model.init_args.lrr=0.1): TinyModule.__init__ takes no argument 'lrr'; did you mean 'lr'?",
    ),
    (
        ["--model.init_args.n_in=wide"],
        "model.init_args.n_in (command line: --model.init_args.n_in=wide): TinyModule.__init__ takes n_in as int, got 'wide' (str).",
    ),
    (
        ["--model.extra=1"],
        "model.extra (command line: --model.extra=1): is not a key here (a class is given by class_path and init_args)",
    ),
    (
        ["--model=tests.helpers.TinyModul"],
        "model.class_path (command line: --model=tests.helpers.TinyModul): cannot import 'tests.helpers.TinyModul': module 'tests.helpers' has no 'TinyModul'; did you mean 'TinyModule'?",
    ),
    (
        ["--data.class_path=nosuch.loaders"],
        "data.class_path (command line: --data.class_path=nosuch.loaders): cannot import 'nosuch.loaders': there is no module 'nosuch'",
    ),
    (
        ["--model=tests.cli.exploding.Net"],
        "importing 'tests.cli.exploding' for 'tests.cli.exploding.Net' failed: RuntimeError: this module fails to import",
    ),
    (
        ["--model=tests.cli.fixtures.NeedsWidth"],
        "model.init_args.width: NeedsWidth.__init__ requires it (it has no default): give it in the file or as --model.init_args.width=VALUE.",
    ),
    (
        ["--trainer.plugins=[Chekpoint]"],
        "trainer.plugins.0.class_path (command line: --trainer.plugins=[Chekpoint]): there is no loopbus plugin 'Chekpoint'; did you mean 'Checkpoint'?",
    ),
    (
        ["--trainer.plugins=[{class_path: CSVLogger, init_args: {sav_dir: x}}]"],
        "CSVLogger.__init__ takes no argument 'sav_dir'; did you mean 'save_dir'?",
    ),
    (
        ["--trainer.plugins.1.init_args.x=1"],
        "trainer.plugins.1 (command line: --trainer.plugins.1.init_args.x=1): there is no item '1' here: the list has 0",
    ),
    (
        ["--trainer.max_epochs.x=1"],
        "trainer.max_epochs (command line: --trainer.max_epochs.x=1): is 1 (",
    ),
    (
        ["--trainer.strategy={class_path: FSDPStrategi}"],
        "trainer.strategy.class_path (command line: --trainer.strategy={class_path: FSDPStrategi}): there is no loopbus strategy 'FSDPStrategi'; did you mean 'FSDPStrategy'?",
    ),
    (
        ["--trainer.strategy={class_path: ModelParallelStrategy, init_args: {tp: 2, dp: 2}}"],
        "ModelParallelStrategy.__init__ takes no argument 'dp'; did you mean 'dp_replicate'?",
    ),
    (
        ["--trainer.strategy=ddpp"],
        "trainer.strategy (command line: --trainer.strategy=ddpp): strategy must be Literal['auto', 'ddp', 'fsdp', 'ft', 'single'], got 'ddpp'.",
    ),
    (["stray"], "unexpected argument 'stray': loopbus fit takes --config FILE and --KEY=VALUE"),
    (["--print-config=yes"], "--print-config takes no value"),
    (["--resume", "/nonexistent/run"], "--resume /nonexistent/run: there is no such folder"),
    (
        ["--grid", "model.init_args.lr=1,2"],
        "--grid, --seeds and --dry-run are options of loopbus sweep only.",
    ),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_input_is_named_with_its_key(
    cli: Run, tiny: Path, tmp_path: Path, argv: list[str], message: str
) -> None:
    root = tmp_path / "runs"
    status, out, err = cli("fit", "--config", str(tiny), f"--trainer.root_dir={root}", *argv)
    assert status == 2
    assert message in err
    assert err.startswith("loopbus fit: the configuration has ")
    assert out == ""
    assert not root.exists()  # no run folder made


def test_every_problem_is_listed_at_once(cli: Run, tiny: Path) -> None:
    # Keys and types first (before torch), every one of them; the class paths are not
    # imported yet.
    status, _, err = cli(
        "fit", "--config", str(tiny), "--trainer.max_epoch=1", "--trainer.put_lag=x",
        "--trainer.device=[1]", "--model=x.Y",
    )  # fmt: skip
    assert status == 2
    assert "has 3 errors" in err
    assert "trainer.max_epoch " in err
    assert "put_lag must be int, got 'x'." in err
    assert "device must be str | None, got [1]." in err
    assert "x.Y" not in err
    # Then the values, every one of them, before any class path is imported.
    status, _, err = cli(
        "fit", "--config", str(tiny), "--trainer.put_lag=-1", "--trainer.max_epochs=-5",
        "--model=x.Y",
    )  # fmt: skip
    assert status == 2
    assert "has 2 errors" in err
    assert "trainer.put_lag " in err
    assert "trainer.max_epochs " in err
    assert "x.Y" not in err


def test_the_trainer_section_is_checked_before_any_class_path_is_imported(
    cli: Run, tiny: Path
) -> None:
    status, _, err = cli(
        "fit", "--config", str(tiny), "--trainer.max_epochs=-5", "--model=tests.cli.exploding.Net"
    )
    assert status == 2
    assert "trainer.max_epochs" in err
    assert "exploding" not in err
    assert "tests.cli.exploding" not in sys.modules


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("run.ini", "", "unknown format '.ini'; name the file .yaml, .yml, .toml or .json"),
        ("bad.yaml", "trainer: [1,\n", "is not valid YAML"),
        ("bad.toml", "trainer = = 1", "is not valid TOML"),
        ("bad.json", "{", "is not valid JSON"),
        (
            "list.yaml",
            "- 1\n",
            "must hold a mapping of sections (trainer:, model:, data:, ...), got a list",
        ),
        (
            "trainer.yaml",
            "trainer: 3\n",
            "trainer (FILE): must be a mapping of Trainer options, got 3.",
        ),
        (
            "args.yaml",
            "model:\n  class_path: tests.helpers.TinyModule\n  init_args: [1]\n",
            "model.init_args (FILE): must be a mapping",
        ),
    ],
)
def test_a_bad_file_is_named(cli: Run, tmp_path: Path, name: str, text: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    status, _, err = cli("fit", "--config", str(path))
    assert status == 2
    assert message.replace("FILE", str(path)) in err


def test_a_missing_file_and_sections_are_named(cli: Run, tmp_path: Path) -> None:
    status, _, err = cli("fit", "--config", str(tmp_path / "absent.yaml"))
    assert status == 2
    assert "absent.yaml: cannot read it" in err
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    status, _, err = cli("fit", "--config", str(empty))
    assert status == 2
    assert "model: is required: name its class with model.class_path" in err
    assert "data: is required" in err


def test_data_a_stage_cannot_take(cli: Run, tiny: Path) -> None:
    status, _, err = cli("test", "--config", str(tiny), "--data=tests.cli.fixtures.three_loaders")
    assert status == 2
    assert (
        "data.class_path: tests.cli.fixtures.three_loaders returned a tuple of 3; loopbus test takes one loader, or a DataModule."
        in err
    )


def test_a_trainer_refusal_is_a_configuration_error(cli: Run, tiny: Path) -> None:
    status, _, err = cli("fit", "--config", str(tiny), "--trainer.precision=17-odd")
    assert status == 2
    assert err.startswith("loopbus fit: the configuration has 1 error:\n  trainer: ")
    assert "17-odd" in err


def test_an_unknown_command(cli: Run) -> None:
    assert cli("train")[0] == 2
