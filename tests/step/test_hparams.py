"""Hyperparameters: Module.save_hyperparameters, the checkpoint's hparams part,
Module.load_from_checkpoint, and what the loggers write."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from loopbus import CheckpointError, MisconfigurationError, Module, Trainer
from loopbus.plugins import CSVLogger, JSONLLogger, TensorBoardLogger
from tests.helpers import TinyModule, make_loader


class Net(TinyModule):
    def __init__(
        self,
        hidden: int = 8,
        lr: float = 0.1,
        *,
        name: str = "net",
        sizes: tuple[int, ...] = (1, 2),
        extra: dict[str, Any] | None = None,
        **more: Any,
    ) -> None:
        super().__init__(lr=lr)
        self.layer = torch.nn.Sequential(
            torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 2)
        )
        self.save_hyperparameters()


class Needs(TinyModule):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, hidden)


def test_the_init_arguments_are_kept_read_only() -> None:
    net = Net(16, name="a", extra={"k": [1, None]}, dropout=0.5)
    assert dict(net.hparams) == {
        "hidden": 16,
        "lr": 0.1,
        "name": "a",
        "sizes": (1, 2),
        "extra": {"k": [1, None]},
        "dropout": 0.5,
    }
    with pytest.raises(TypeError):
        net.hparams["hidden"] = 3  # type: ignore[index]
    assert dict(TinyModule().hparams) == {}


def test_names_and_ignore_choose_what_is_kept() -> None:
    class Some(TinyModule):
        def __init__(self, a: int = 1, b: str = "x", encoder: Any = None) -> None:
            super().__init__()
            if encoder is None:
                self.save_hyperparameters("a")
            else:
                self.save_hyperparameters(ignore=["encoder"])

    assert dict(Some().hparams) == {"a": 1}
    assert dict(Some(encoder=torch.nn.Linear(1, 1)).hparams) == {"a": 1, "b": "x"}

    class Typo(TinyModule):
        def __init__(self, a: int = 1) -> None:
            super().__init__()
            self.save_hyperparameters("aa")

    with pytest.raises(MisconfigurationError, match=r"\['aa'\].*arguments are \['a'\]"):
        Typo()


def test_a_value_that_is_not_plain_is_refused_naming_it() -> None:
    class Holds(TinyModule):
        def __init__(self, weights: Any, layers: Any = ()) -> None:
            super().__init__()
            self.save_hyperparameters()

    with pytest.raises(
        MisconfigurationError, match=r"argument 'weights' is a Tensor.*ignore=\['weights'\]"
    ):
        Holds(torch.ones(2))
    with pytest.raises(MisconfigurationError, match=r"'layers'\[1\] is a Linear"):
        Holds(1, [1, torch.nn.Linear(1, 1)])


async def test_checkpoints_hold_them_and_load_from_checkpoint_rebuilds(tmp_path: Path) -> None:
    loopbus.seed_everything(0)
    net = Net(hidden=6, lr=0.05, name="b")
    trainer = Trainer(max_steps=2, plugins=[], device="cpu")
    await trainer.fit(net, make_loader(n=32))
    path = trainer.save_checkpoint(tmp_path / "a.ckpt")
    saved = torch.load(path, weights_only=True)  # plain types only
    assert saved["hparams"] == {"values": dict(net.hparams)}

    again = Net.load_from_checkpoint(path)
    assert dict(again.hparams) == dict(net.hparams)
    assert again.layer[0].out_features == 6
    for mine, theirs in zip(again.state_dict().values(), net.state_dict().values(), strict=True):
        assert torch.equal(mine, theirs)
    changed = Net.load_from_checkpoint(path, lr=0.5)
    assert changed.hparams["lr"] == 0.5
    assert changed.lr == 0.5

    # Overrides that change the shapes: the weights do not fit, and it says so.
    with pytest.raises(CheckpointError, match=r"do not fit Net.*shape"):
        Net.load_from_checkpoint(path, hidden=7)


async def test_without_hparams_the_constructor_arguments_must_be_given(tmp_path: Path) -> None:
    trainer = Trainer(max_steps=1, plugins=[], device="cpu")
    await trainer.fit(Needs(3), make_loader(n=16))
    path = trainer.save_checkpoint(tmp_path / "n.ckpt")
    with pytest.raises(
        MisconfigurationError, match=r"holds no hyperparameters.*save_hyperparameters.*hidden"
    ):
        Needs.load_from_checkpoint(path)
    assert Needs.load_from_checkpoint(path, hidden=3).layer.out_features == 3


async def test_file_loggers_write_them_beside_their_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    yaml = pytest.importorskip("yaml")
    net = Net(hidden=5, sizes=(3,), extra={"opt": {"beta": 0.9}})
    trainer = Trainer(max_steps=1, plugins=[CSVLogger(tmp_path / "csv", name="", version="")], device="cpu")
    await trainer.fit(net, make_loader(n=16))
    written = yaml.safe_load((tmp_path / "csv" / "hparams.yaml").read_text())
    assert written == {**dict(net.hparams), "sizes": [3]}  # a tuple reads back as a list

    # Without PyYAML: the same as JSON, in hparams.json.
    from loopbus.plugins.loggers import _files as _loggers

    monkeypatch.setattr(_loggers, "_have_yaml", lambda: False)
    trainer = Trainer(max_steps=1, plugins=[JSONLLogger(tmp_path / "jsonl", name="", version="")], device="cpu")
    await trainer.fit(net, make_loader(n=16))
    assert json.loads((tmp_path / "jsonl" / "hparams.json").read_text()) == written
    assert not (tmp_path / "jsonl" / "hparams.yaml").exists()

    # A module that saved none: no file.
    trainer = Trainer(max_steps=1, plugins=[CSVLogger(tmp_path / "none", name="", version="")], device="cpu")
    await trainer.fit(TinyModule(), make_loader(n=16))
    assert sorted(p.name for p in (tmp_path / "none").iterdir()) == ["metrics.csv", "run.json"]


async def test_tensorboard_shows_them_in_the_same_run(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    net = Net(hidden=5, name="tb", extra={"opt": {"beta": 0.9}, "n": None})
    trainer = Trainer(max_steps=2, plugins=[TensorBoardLogger(tmp_path, name="", version="")], device="cpu")
    await trainer.fit(net, make_loader(n=32))
    assert not [name for name in os.listdir(tmp_path) if (tmp_path / name).is_dir()]  # one run
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    start = HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    values = {
        k: v.WhichOneof("kind") and getattr(v, v.WhichOneof("kind"))
        for k, v in start.session_start_info.hparams.items()
    }
    assert values == {
        "hidden": 5,
        "lr": 0.1,
        "name": "tb",
        "sizes": "(1, 2)",
        "extra/opt/beta": 0.9,
        "extra/n": "None",
    }
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]


def test_module_is_still_a_plain_torch_module() -> None:
    net = Net()
    assert isinstance(net, Module)
    assert "hparams" not in dict(net.named_children())
    assert set(net.state_dict()) == {
        "layer.0.weight",
        "layer.0.bias",
        "layer.2.weight",
        "layer.2.bias",
    }


async def test_a_checkpoint_without_the_hparams_part_still_resumes_strictly(
    tmp_path: Path,
) -> None:
    """Checkpoints written before the part existed lack it: no mismatch."""
    class Plain(Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            return self.w(batch).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = [torch.ones(1, 2) for _ in range(4)]
    trainer = Trainer(max_steps=2, plugins=[], device="cpu")
    await trainer.fit(Plain(), data)
    path = tmp_path / "old.ckpt"
    trainer.save_checkpoint(path)
    state = loopbus.load_checkpoint(path)
    del state["hparams"]  # as an older version wrote it
    loopbus.write_checkpoint(state, path)
    resumed = Trainer(max_steps=4, plugins=[], device="cpu")
    await resumed.fit(Plain(), data, ckpt_path=path)
    assert resumed.global_step == 4
