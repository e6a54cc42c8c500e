"""``loopbus fit --config``: files in three formats merged in order with overrides, the
resolved configuration (``--print-config``) and where each value came from
(``--explain``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import loopbus
from tests.cli.conftest import TINY, Run
from tests.helpers import ROOT

DIGITS = str(ROOT / "examples" / "digits.yaml")


def test_print_config_holds_every_default(cli: Run, tmp_path: Path) -> None:
    status, out, err = cli("fit", "--config", DIGITS, "--print-config")
    assert status == 0, err
    config = yaml.safe_load(out)
    assert list(config) == ["seed_everything", "trainer", "model", "data", "ckpt_path"]
    for declaration in loopbus.TrainerOptions.declarations():
        expected = 30 if declaration.name == "max_epochs" else declaration.default
        assert config["trainer"][declaration.name] == expected, declaration.name
    assert config["trainer"]["plugins"] is None
    assert config["trainer"]["precision"] == "32"
    assert config["model"] == {
        "class_path": "examples.digits.DigitsNet",
        "init_args": {"hidden": 128, "lr": 3e-3, "epochs": 30, "tensor_lr": False},
    }
    assert config["data"]["init_args"] == {"batch_size": 64, "seed": 0}
    assert not list(tmp_path.iterdir())  # nothing written
    # The printed configuration reads back to itself.
    printed = tmp_path / "printed.yaml"
    printed.write_text(out)
    assert cli("fit", "--config", str(printed), "--print-config")[1] == out


def test_explain_says_where_each_value_came_from(cli: Run) -> None:
    status, out, _ = cli(
        "fit",
        "--config",
        DIGITS,
        "--trainer.max_epochs=2",
        "--model.init_args.lr",
        "3e-4",
        "--explain",
    )
    assert status == 0
    lines = {line.split()[0]: line for line in out.splitlines()}
    assert lines["trainer.max_epochs"].split()[1] == "2"
    assert lines["trainer.max_epochs"].endswith("# command line: --trainer.max_epochs=2")
    assert lines["model.init_args.lr"].split()[1] == "0.0003"  # 3e-4: a float, as annotated
    assert lines["model.init_args.lr"].endswith("# command line: --model.init_args.lr=3e-4")
    assert lines["model.init_args.hidden"].endswith(f"# {DIGITS}")
    assert lines["model.init_args.tensor_lr"].endswith("# default")
    assert lines["trainer.put_lag"].endswith("# default")
    assert lines["seed_everything"].endswith(f"# {DIGITS}")


def _resolved(cli: Run, *argv: str) -> dict:
    status, out, err = cli("fit", *argv, "--print-config")
    assert status == 0, err
    return yaml.safe_load(out)


def test_files_and_overrides_apply_in_the_order_given(cli: Run, tiny: Path, tmp_path: Path) -> None:
    second = tmp_path / "second.yaml"
    second.write_text("trainer:\n  max_epochs: 2\nmodel:\n  init_args:\n    n_out: 3\n")
    config = _resolved(
        cli, "--config", str(tiny), "--trainer.max_epochs=5", "--config", str(second)
    )
    assert config["trainer"]["max_epochs"] == 2  # the later file wins over the earlier flag
    assert config["model"]["init_args"] == {"n_in": 4, "n_out": 3, "lr": 0.05}  # merged
    config = _resolved(
        cli, "--config", str(tiny), "--config", str(second), "--trainer.max_epochs=5"
    )
    assert config["trainer"]["max_epochs"] == 5


def test_another_class_path_drops_the_old_init_args(cli: Run, tiny: Path) -> None:
    config = _resolved(
        cli,
        "--config",
        str(tiny),
        "--model=tests.cli.fixtures.NeedsWidth",
        "--model.init_args.width=3",
    )
    assert config["model"] == {
        "class_path": "tests.cli.fixtures.NeedsWidth",
        "init_args": {"width": 3, "lr": 0.1},
    }


@pytest.mark.parametrize("suffix", [".toml", ".json", ".yml"])
def test_toml_json_and_yaml_files_read_the_same(
    cli: Run, tiny: Path, tmp_path: Path, suffix: str
) -> None:
    path = tmp_path / f"config{suffix}"
    if suffix == ".toml":
        path.write_text(
            "seed_everything = 0\n[trainer]\nmax_epochs = 1\nenable_model_summary = false\nplugins = []\n"
            '[model]\nclass_path = "tests.helpers.TinyModule"\n[model.init_args]\nlr = 0.05\n'
            '[data]\nclass_path = "tests.helpers.make_loader"\n[data.init_args]\nn = 32\n'
        )
    elif suffix == ".json":
        path.write_text(json.dumps(TINY))
    else:
        path.write_text(yaml.safe_dump(TINY))
    assert _resolved(cli, "--config", str(path)) == _resolved(cli, "--config", str(tiny))


def test_override_values_are_read_as_yaml(cli: Run, tiny: Path) -> None:
    config = _resolved(
        cli,
        "--config",
        str(tiny),
        "--trainer.limit_train_batches=0.5",
        "--trainer.max_steps=null",
        "--trainer.plugins=[Checkpoint]",
        "--trainer.plugins.0.init_args.keep_last=2",
        "--ckpt_path=last",
    )
    assert config["trainer"]["limit_train_batches"] == 0.5
    assert config["trainer"]["max_steps"] is None
    plugin = config["trainer"]["plugins"][0]
    assert plugin["class_path"] == "loopbus.plugins.Checkpoint"  # a plugin by its name
    assert plugin["init_args"]["keep_last"] == 2
    assert config["ckpt_path"] == "last"


def test_a_strategy_object_is_given_by_its_class_path(cli: Run, tiny: Path) -> None:
    # LightningCLI's form: {class_path, init_args}; loopbus's strategies by short name.
    given = "--trainer.strategy={class_path: SingleProcess}"
    status, out, err = cli("fit", "--config", str(tiny), given, "--print-config")
    assert status == 0, err
    assert yaml.safe_load(out)["trainer"]["strategy"] == {
        "class_path": "loopbus.SingleProcess",
        "init_args": {},
    }
    status, out, err = cli("fit", "--config", str(tiny), given)
    assert status == 0, err
