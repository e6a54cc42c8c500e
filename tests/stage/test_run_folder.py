"""Run folders: ``Trainer(root_dir=..., name=..., version=...)`` gives the run
``root_dir/name/version_N`` with ``config.yaml``, ``run.json``, ``checkpoints/`` and the
file loggers' output; ``set_run_config`` is what the run records."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import loopbus
from loopbus import MisconfigurationError, Trainer
from loopbus.events import TrainBatchCompleted
from loopbus.plugins import Checkpoint, CSVLogger, JSONLLogger, read_csv, read_run_info
from loopbus.state._run_config import plain_config
from tests.helpers import ROOT, TinyModule, make_loader

yaml = pytest.importorskip("yaml")


class Net(TinyModule):
    def __init__(self, hidden: int = 3, lr: float = 0.1) -> None:
        super().__init__(lr=lr)
        self.save_hyperparameters()


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _run_json(trainer: Trainer) -> dict[str, Any]:
    assert trainer.run_dir is not None
    return json.loads((trainer.run_dir / "run.json").read_text())  # type: ignore[no-any-return]


async def test_the_folder_holds_the_config_and_the_facts(tmp_path: Path) -> None:
    trainer = Trainer(root_dir=tmp_path / "runs", name="exp", max_steps=2, plugins=[], device="cpu")
    assert trainer.run_dir == tmp_path / "runs" / "exp" / "version_0"
    assert trainer.run_dir.is_dir()  # chosen (and reserved) when the trainer is built
    await trainer.fit(Net(hidden=5), make_loader(n=32))
    assert _files(trainer.run_dir) == ["config.yaml", "run.json"]
    info = _run_json(trainer)
    assert info["name"] == "exp"
    assert info["version"] == 0
    assert info["stage"] == "fit"
    assert info["resumed_from_step"] is None
    assert info["world_size"] == 1
    assert info["loopbus"] == loopbus.__version__
    assert info["torch"] == str(torch.__version__)
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", info["python"])
    assert info["host"]
    assert info["started"].endswith("+00:00")
    assert info["config"] == "config.yaml"
    assert info["earlier"] == []
    assert info["outcome"] == "completed"  # how the start ended, once it did
    assert (info["end_step"], info["end_epoch"]) == (2, 0)
    assert info["ended"].endswith("+00:00")
    assert info["ended"] >= info["started"]
    assert read_run_info(trainer.run_dir)["resumed_from_step"] is None  # the loggers' reader

    config = yaml.safe_load((trainer.run_dir / "config.yaml").read_text())
    assert config["trainer"]["max_steps"] == 2
    assert config["trainer"]["root_dir"] == str(tmp_path / "runs")
    assert config["trainer"]["device"] == "cpu"
    assert config["model"] == {
        "class_path": f"{Net.__module__}.Net",
        "init_args": {"hidden": 5, "lr": 0.1},
    }
    assert list(config) == ["trainer", "model"]  # readable: keys in their order
    assert config == trainer.run_config


@pytest.mark.external  # runs git
async def test_run_json_names_the_commit_inside_a_git_checkout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(ROOT)
    trainer = Trainer(root_dir=tmp_path, max_steps=1, plugins=[], device="cpu")
    await trainer.fit(TinyModule(), make_loader(n=16))
    info = _run_json(trainer)
    assert re.fullmatch(r"[0-9a-f]{40}", info["commit"])
    assert isinstance(info["dirty"], bool)


@pytest.mark.external  # runs git
async def test_outside_a_git_repository_there_is_no_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    monkeypatch.delenv("GIT_DIR", raising=False)
    trainer = Trainer(root_dir=tmp_path / "runs", max_steps=1, plugins=[], device="cpu")
    await trainer.fit(TinyModule(), make_loader(n=16))
    info = _run_json(trainer)
    assert "commit" not in info
    assert "dirty" not in info


def test_the_next_free_version_is_taken(tmp_path: Path) -> None:
    (tmp_path / "exp" / "version_0").mkdir(parents=True)
    (tmp_path / "exp" / "version_3").mkdir()
    (tmp_path / "exp" / "notes").mkdir()
    first = Trainer(root_dir=tmp_path, name="exp", plugins=[], device="cpu")
    second = Trainer(root_dir=tmp_path, name="exp", plugins=[], device="cpu")
    assert first.run_dir == tmp_path / "exp" / "version_4"
    assert second.run_dir == tmp_path / "exp" / "version_5"  # reserved, not shared
    given = Trainer(root_dir=tmp_path, name="exp", version=3, plugins=[], device="cpu")
    assert given.run_dir == tmp_path / "exp" / "version_3"
    named = Trainer(root_dir=tmp_path, name="exp", version="baseline", plugins=[], device="cpu")
    assert named.run_dir == tmp_path / "exp" / "baseline"
    assert Trainer(root_dir=tmp_path, plugins=[], device="cpu").run_dir == (
        tmp_path / "loopbus_logs" / "version_0"
    )


async def test_a_resume_continues_the_same_folder(tmp_path: Path) -> None:
    def trainer(version: int | None, steps: int) -> Trainer:
        return Trainer(
            root_dir=tmp_path,
            name="exp",
            version=version,
            max_steps=steps,
            plugins=[Checkpoint(every_n_steps=2, keep_last=None), CSVLogger(), JSONLLogger()],
            device="cpu",
        )

    first = trainer(None, 4)
    await first.fit(TinyModule(), make_loader())
    folder = first.run_dir
    assert folder is not None
    assert {"checkpoints", "metrics.csv", "records.jsonl", "config.yaml", "run.json"} <= set(
        _files(folder)
    )
    saved = sorted(p.name for p in (folder / "checkpoints").glob("*.ckpt"))
    assert saved[:2] == ["epoch=0-step=2.ckpt", "epoch=0-step=4-v1.ckpt"]  # and step=4
    original = (folder / "config.yaml").read_text()

    resumed = trainer(0, 6)
    assert resumed.run_dir == folder
    await resumed.fit(TinyModule(), make_loader(), ckpt_path="last")
    info = _run_json(resumed)
    assert info["resumed_from_step"] == 4
    assert [e["resumed_from_step"] for e in info["earlier"]] == [None]
    assert [(e["outcome"], e["end_step"]) for e in info["earlier"]] == [("completed", 4)]
    assert (info["outcome"], info["end_step"]) == ("completed", 6)
    assert (folder / "config.yaml").read_text() == original  # the folder's first
    assert info["config"] == "config_1.yaml"  # this start's differs (max_steps, version)
    assert yaml.safe_load((folder / "config_1.yaml").read_text())["trainer"]["max_steps"] == 6
    assert [row["step"] for row in read_csv(folder / "metrics.csv")] == [1, 2, 3, 4, 5, 6]
    assert sorted(os.listdir(tmp_path / "exp")) == ["version_0"]


async def test_the_same_config_again_is_not_written_twice(tmp_path: Path) -> None:
    config = {"trainer": {"max_steps": 2}, "model": {"class_path": "tests.helpers.TinyModule"}}
    for version in (None, 0):
        trainer = Trainer(root_dir=tmp_path, version=version, max_steps=2, plugins=[], device="cpu")
        trainer.set_run_config(config)
        await trainer.fit(TinyModule(), make_loader(n=32))
    assert trainer.run_dir is not None
    assert _files(trainer.run_dir) == ["config.yaml", "run.json"]
    assert _run_json(trainer)["config"] == "config.yaml"
    assert len(_run_json(trainer)["earlier"]) == 1


async def test_an_evaluation_stage_records_its_start(tmp_path: Path) -> None:
    trainer = Trainer(root_dir=tmp_path, plugins=[], device="cpu")
    await trainer.validate(TinyModule(), make_loader(n=16))
    await trainer.test(TinyModule(), make_loader(n=16))  # a trainer's first start only
    info = _run_json(trainer)
    assert info["stage"] == "validate"
    assert info["earlier"] == []
    assert info["outcome"] == "completed"  # the validate stage's; the test left it as it was


class _FailsAtStep(TinyModule):
    def training_step(self, batch: Any, ctx: Any) -> Any:
        if self.trainer.global_step == 1:
            raise RuntimeError("broken batch")
        return super().training_step(batch, ctx)


async def test_run_json_says_how_a_stage_ended_failed_or_stopped(tmp_path: Path) -> None:
    failing = Trainer(root_dir=tmp_path, name="failing", max_steps=5, plugins=[], device="cpu")
    with pytest.raises(RuntimeError, match="broken batch"):
        await failing.fit(_FailsAtStep(), make_loader())
    info = _run_json(failing)
    assert (info["outcome"], info["end_step"]) == ("failed", 1)

    stopping = Trainer(root_dir=tmp_path, name="stopping", max_steps=5, plugins=[], device="cpu")
    stopping.subscribe(TrainBatchCompleted, lambda event: stopping.request_stop("enough"), once=2)
    await stopping.fit(TinyModule(), make_loader())
    info = _run_json(stopping)
    assert (info["outcome"], info["end_step"]) == ("stopped", 2)
    assert "ended" in info

    # A stage whose task is cancelled still says so.
    cancelled = Trainer(root_dir=tmp_path, name="cancelled", max_steps=10**6, plugins=[])
    async with anyio.create_task_group() as tg:

        def cancel(event: TrainBatchCompleted) -> None:
            tg.cancel_scope.cancel()

        cancelled.subscribe(TrainBatchCompleted, cancel, once=3)
        tg.start_soon(cancelled.fit, TinyModule(), make_loader(n=4000))
    info = _run_json(cancelled)
    assert info["outcome"] == "cancelled"
    assert info["end_step"] >= 3

    # A trainer without a folder subscribes nothing for it.
    bare = Trainer(plugins=[], device="cpu")
    assert not [s for s in bare.bus.subscriptions if s.owner == "Trainer.run_dir"]


async def test_without_root_dir_nothing_more_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    trainer = Trainer(max_steps=2, plugins=[], device="cpu")
    assert trainer.run_dir is None
    assert trainer.run_config is None
    await trainer.fit(Net(), make_loader(n=32))
    await trainer.validate(Net(), make_loader(n=16))
    assert os.listdir(tmp_path) == []
    # A checkpoint of such a run carries no configuration.
    path = trainer.save_checkpoint(tmp_path / "a.ckpt")
    assert "config" not in (loopbus.checkpoint_info(path) or {})
    assert "config" not in torch.load(path, weights_only=True)["loopbus"]


async def test_fast_dev_run_writes_no_run_folder(tmp_path: Path) -> None:
    trainer = Trainer(root_dir=tmp_path, fast_dev_run=True, plugins=[], device="cpu")
    await trainer.fit(TinyModule(), make_loader(n=32))
    assert trainer.run_dir is None
    assert os.listdir(tmp_path) == []


async def test_plugins_without_a_folder_need_a_run_folder(tmp_path: Path) -> None:
    with pytest.raises(
        MisconfigurationError, match=r"Checkpoint\(\) was given no dirpath.*root_dir"
    ):
        await Trainer(max_steps=1, plugins=[Checkpoint()], device="cpu").fit(
            TinyModule(), make_loader(n=16)
        )
    with pytest.raises(
        MisconfigurationError, match=r"CSVLogger\(\) was given no save_dir.*root_dir"
    ):
        await Trainer(max_steps=1, plugins=[CSVLogger()], device="cpu").fit(
            TinyModule(), make_loader(n=16)
        )
    with pytest.raises(
        ValueError, match=r"JSONLLogger\(name=\.\.\., version=\.\.\.\) need a save_dir"
    ):
        JSONLLogger(name="mine")
    assert Checkpoint().last_checkpoint_path is None  # no folder yet: nothing to name


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"root_dir": "s3://bucket/runs"}, r"root_dir='s3://bucket/runs'.*URL"),
        ({"root_dir": 3}, r"root_dir=\.\.\.\) must be a folder path"),
        ({"name": "a/b"}, r"name=\.\.\.\) must be a folder name"),
        ({"version": -1}, r"version=\.\.\.\) must be None"),
        ({"version": True}, r"version=\.\.\.\) must be None"),
    ],
)
def test_bad_options_are_refused_naming_them(options: dict[str, Any], match: str) -> None:
    with pytest.raises(MisconfigurationError, match=match):
        Trainer(plugins=[], **options)


def test_a_file_is_no_root_dir(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    with pytest.raises(MisconfigurationError, match=r"is a file, not a folder"):
        Trainer(root_dir=tmp_path / "f", plugins=[])


def test_the_folder_options_are_fixed_once_built(tmp_path: Path) -> None:
    trainer = Trainer(root_dir=tmp_path, plugins=[], device="cpu")
    with pytest.raises(AttributeError, match=r"Trainer\.version cannot be changed.*run folder"):
        trainer.version = 3
    assert trainer.name == "loopbus_logs"


def test_lightning_default_root_dir_points_to_root_dir() -> None:
    with pytest.raises(TypeError, match=r"'default_root_dir': loopbus calls it `root_dir`"):
        Trainer(default_root_dir="runs")  # type: ignore[call-arg]


def test_set_run_config_refuses_what_is_no_mapping() -> None:
    with pytest.raises(MisconfigurationError, match=r"set_run_config\(config\) takes a mapping"):
        Trainer(plugins=[]).set_run_config([("trainer", {})])  # type: ignore[arg-type]


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def test_odd_values_become_plain() -> None:
    class Odd:
        pass

    plain = plain_config(
        {
            1: (Path("a"), torch.device("cpu"), torch.float16),
            "set": {2, 1},
            "obj": Odd(),
            "cls": Odd,
            "inf": math.inf,
            "deep": _nested(20),
        }
    )
    assert plain["1"] == ["a", "cpu", "torch.float16"]
    assert plain["set"] == [1, 2]
    assert plain["obj"] == plain["cls"] == f"{__name__}.{Odd.__qualname__}"
    assert plain["inf"] == math.inf
    yaml.safe_dump(plain)
    json.dumps(plain)
