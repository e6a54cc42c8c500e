"""``loopbus sweep``: a grid of ``fit`` runs from one configuration, each point checked
before any runs, each in its own version folder, or printed as command lines; the spec
saved beside them."""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from tests.cli.conftest import Run


def _spec(folder: Path) -> dict:
    (path,) = folder.glob("sweep-*.yaml")
    return yaml.safe_load(path.read_text())


def test_each_point_runs_in_its_own_version_folder(cli: Run, tiny: Path, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    status, _, err = cli(
        "sweep", "--config", str(tiny), f"--trainer.root_dir={root}",
        "--grid", "model.init_args.lr=0.01,0.1", "--seeds", "0,1",
    )  # fmt: skip
    assert status == 0, err
    folder = root / "loopbus_logs"
    points = [
        (config["model"]["init_args"]["lr"], config["seed_everything"])
        for config in (
            yaml.safe_load((folder / f"version_{n}" / "config.yaml").read_text())
            for n in range(4)
        )
    ]
    assert points == [(0.01, 0), (0.01, 1), (0.1, 0), (0.1, 1)]
    spec = _spec(folder)
    assert [p["version"] for p in spec["points"]] == [0, 1, 2, 3]
    assert spec["points"][3]["overrides"] == ["--model.init_args.lr=0.1", "--seed_everything=1"]
    assert spec["sweep"] == {"grid": ["model.init_args.lr=0.01,0.1"], "seeds": "0,1", "dry_run": False}


def test_a_dry_run_prints_one_fit_command_per_point(cli: Run, tiny: Path, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    (root / "loopbus_logs" / "version_4").mkdir(parents=True)  # taken: the sweep goes on after
    status, out, err = cli(
        "sweep", "--config", str(tiny), f"--trainer.root_dir={root}",
        "--grid", "trainer.max_epochs=1,2", "--dry-run",
    )  # fmt: skip
    assert status == 0, err
    lines = [shlex.split(line) for line in out.splitlines()]
    assert lines == [
        ["loopbus", "fit", "--config", str(tiny), f"--trainer.root_dir={root}",
         f"--trainer.max_epochs={n}", f"--trainer.version={v}"]
        for n, v in ((1, 5), (2, 6))
    ]  # fmt: skip
    assert sorted(p.name for p in (root / "loopbus_logs").iterdir() if p.is_dir()) == ["version_4"]
    assert _spec(root / "loopbus_logs")["sweep"]["dry_run"] is True


def test_every_point_is_checked_before_any_runs(cli: Run, tiny: Path, tmp_path: Path) -> None:
    root = tmp_path / "runs"
    status, _, err = cli(
        "sweep", "--config", str(tiny), f"--trainer.root_dir={root}",
        "--grid", "trainer.max_epochs=1,two",
    )  # fmt: skip
    assert status == 2
    assert "trainer.max_epochs" in err
    assert "(at --trainer.max_epochs=two)" in err
    assert not root.exists()  # nothing ran, nothing was written


def test_bad_sweep_command_lines_are_named(cli: Run, tiny: Path, tmp_path: Path) -> None:
    status, _, err = cli("sweep", "--config", str(tiny), "--grid", "model.init_args.lr=0.1")
    assert status == 2
    assert "--trainer.root_dir=runs" in err
    status, _, err = cli("sweep", "--config", str(tiny), f"--trainer.root_dir={tmp_path}")
    assert status == 2
    assert "at least one --grid" in err
    status, _, err = cli(
        "sweep", "--config", str(tiny), f"--trainer.root_dir={tmp_path}", "--grid", "lr"
    )
    assert status == 2
    assert "write --grid KEY=V1,V2" in err
    status, out, _ = cli("sweep", "--help")
    assert status == 0
    assert "--dry-run" in out
    status, _, err = cli("fit", "--config", str(tiny), "--grid", "model.init_args.lr=0.1")
    assert status == 2
    assert "loopbus sweep only" in err
