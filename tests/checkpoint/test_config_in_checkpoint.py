"""The run's configuration travels with it: ``Trainer.set_run_config`` (or the default
configuration of a trainer with a run folder) reaches ``config.yaml``, every checkpoint
(``checkpoint_info(path)["config"]``, files and sharded ones alike) and the loggers'
hyperparameters."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from loopbus import Trainer
from loopbus.plugins import Checkpoint, CSVLogger, JSONLLogger, TensorBoardLogger
from tests.helpers import TinyModule, make_loader

yaml = pytest.importorskip("yaml")


class Unplain:
    """A value no YAML or JSON holds."""


#: What a config-file front end hands the trainer (LightningCLI's shape).
CONFIG: dict[str, Any] = {
    "seed_everything": 7,
    "trainer": {"max_steps": 2, "precision": "32"},
    "model": {"class_path": "tests.helpers.TinyModule", "init_args": {"lr": 0.1}},
    "data": {"init_args": {"batch_size": 16, "odd": Unplain(), "limit": math.inf}},
    "ckpt_path": None,
}


def _expected() -> dict[str, Any]:
    data = {"batch_size": 16, "odd": f"{__name__}.Unplain", "limit": math.inf}
    return {**CONFIG, "data": {"init_args": data}}


def _trainer(tmp_path: Path, *plugins: Any, **options: Any) -> Trainer:
    trainer = Trainer(
        root_dir=tmp_path / "runs", max_steps=2, plugins=list(plugins), device="cpu", **options
    )
    trainer.set_run_config(CONFIG)
    return trainer


async def test_a_file_checkpoint_carries_the_config(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, Checkpoint())
    await trainer.fit(TinyModule(), make_loader(n=32))
    assert trainer.run_config == _expected()
    assert trainer.run_dir is not None
    assert yaml.safe_load((trainer.run_dir / "config.yaml").read_text()) == _expected()
    path = trainer.plugins[0].last_checkpoint_path  # type: ignore[attr-defined]
    assert path.parent == trainer.run_dir / "checkpoints"
    info = loopbus.checkpoint_info(path)
    assert info is not None
    expected = _expected()
    expected["data"]["init_args"]["limit"] = "inf"  # the marker is JSON
    assert info["config"] == expected
    header = torch.load(path, weights_only=True)["loopbus"]
    assert header["config"] == _expected()
    # A checkpoint saved by hand carries it too.
    saved = trainer.save_checkpoint(tmp_path / "by-hand.ckpt")
    assert (loopbus.checkpoint_info(saved) or {})["config"] == expected


async def test_a_sharded_checkpoint_carries_the_config(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, Checkpoint(sharded=True, background=False))
    await trainer.fit(TinyModule(), make_loader(n=32))
    path = trainer.plugins[0].last_checkpoint_path  # type: ignore[attr-defined]
    assert path.is_dir()
    info = loopbus.checkpoint_info(path)
    assert info is not None
    assert info["config"]["model"] == CONFIG["model"]
    assert info["config"]["seed_everything"] == 7


async def test_the_default_config_is_the_options_and_the_hparams(tmp_path: Path) -> None:
    class Net(TinyModule):
        def __init__(self, lr: float = 0.2) -> None:
            super().__init__(lr=lr)
            self.save_hyperparameters()

    trainer = Trainer(root_dir=tmp_path, max_steps=1, plugins=[Checkpoint()], device="cpu")
    await trainer.fit(Net(), make_loader(n=16))
    info = loopbus.checkpoint_info(trainer.plugins[0].last_checkpoint_path)  # type: ignore[attr-defined]
    assert info is not None
    assert info["config"]["trainer"]["max_steps"] == 1
    assert info["config"]["model"]["init_args"] == {"lr": 0.2}


async def test_older_checkpoints_have_no_config(tmp_path: Path) -> None:
    trainer = Trainer(max_steps=1, plugins=[], device="cpu")
    await trainer.fit(TinyModule(), make_loader(n=16))
    path = trainer.save_checkpoint(tmp_path / "a.ckpt")
    info = loopbus.checkpoint_info(path)
    assert info is not None
    assert "config" not in info


async def test_a_large_config_stays_out_of_the_marker(tmp_path: Path) -> None:
    trainer = Trainer(root_dir=tmp_path, max_steps=1, plugins=[], device="cpu")
    trainer.set_run_config({"notes": "x" * 300_000})
    await trainer.fit(TinyModule(), make_loader(n=16))
    path = trainer.save_checkpoint(tmp_path / "a.ckpt")
    assert "config" not in (loopbus.checkpoint_info(path) or {})
    assert torch.load(path, weights_only=True)["loopbus"]["config"]["notes"] == "x" * 300_000


async def test_the_file_loggers_write_it_as_their_hparams(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path, CSVLogger(), JSONLLogger())
    await trainer.fit(TinyModule(), make_loader(n=32))
    assert trainer.run_dir is not None
    written = yaml.safe_load((trainer.run_dir / "hparams.yaml").read_text())
    assert written == _expected()
    assert (trainer.run_dir / "metrics.csv").exists()
    assert (trainer.run_dir / "records.jsonl").exists()
    # The trainer writes run.json; the loggers in its folder leave it to the trainer.
    assert json.loads((trainer.run_dir / "run.json").read_text())["version"] == 0


async def test_the_loggers_own_folders_get_it_too(tmp_path: Path) -> None:
    trainer = Trainer(
        max_steps=1, plugins=[CSVLogger(tmp_path / "logs", name="", version="")], device="cpu"
    )
    trainer.set_run_config({"trainer": {"max_steps": 1}})
    await trainer.fit(TinyModule(), make_loader(n=16))
    written = yaml.safe_load((tmp_path / "logs" / "hparams.yaml").read_text())
    assert written == {"trainer": {"max_steps": 1}}


async def test_tensorboard_shows_it_as_hparams(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    trainer = _trainer(tmp_path, TensorBoardLogger())
    await trainer.fit(TinyModule(), make_loader(n=32))
    assert trainer.run_dir is not None
    acc = EventAccumulator(str(trainer.run_dir))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    start = HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    values = {
        k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
        for k, v in start.session_start_info.hparams.items()
    }
    assert values["model/class_path"] == "tests.helpers.TinyModule"
    assert values["trainer/max_steps"] == 2
    assert values["data/init_args/odd"] == f"{__name__}.Unplain"
