"""DataModules: ``fit``, ``validate``, ``test`` and ``predict`` take any object with
Lightning's DataModule methods (as ``datamodule=`` or in place of the data), ready it
(``prepare_data`` on one process per node, ``setup(stage)``), train on its loaders, tear
it down, and save its ``state_dict`` with checkpoints; a Lightning-style base class whose
loader methods only raise counts as not implementing them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from loopbus import MisconfigurationError, Trainer
from loopbus.plugins import Checkpoint
from tests.helpers import TinyModule, make_loader


class Digits:
    """A DataModule with every method, recording each call."""

    def __init__(self, batch_size: int = 16) -> None:
        self.batch_size = batch_size
        self.calls: list[str] = []
        self.seen_epochs = 0  # its state: saved with checkpoints

    def prepare_data(self) -> None:
        self.calls.append("prepare_data")

    def setup(self, stage: str) -> None:
        self.calls.append(f"setup:{stage}")

    def train_dataloader(self) -> Any:
        self.calls.append("train_dataloader")
        return make_loader(n=64, batch_size=self.batch_size, seed=0)

    def val_dataloader(self) -> Any:
        self.calls.append("val_dataloader")
        return make_loader(n=32, batch_size=self.batch_size, seed=1)

    def test_dataloader(self) -> Any:
        self.calls.append("test_dataloader")
        return make_loader(n=32, batch_size=self.batch_size, seed=2)

    def predict_dataloader(self) -> Any:
        self.calls.append("predict_dataloader")
        return [x for x, _ in make_loader(n=32, batch_size=self.batch_size, seed=3)]

    def teardown(self, stage: str) -> None:
        self.calls.append(f"teardown:{stage}")

    def state_dict(self) -> dict[str, Any]:
        return {"seen_epochs": self.seen_epochs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls.append(f"load_state_dict:{state['seen_epochs']}")
        self.seen_epochs = state["seen_epochs"]


class Predicting(TinyModule):
    def predict_step(self, batch: Any, ctx: Any) -> Any:
        return self(batch).argmax(dim=1)


def _trainer(**options: Any) -> Trainer:
    options.setdefault("max_epochs", 2)
    return Trainer(plugins=[], device="cpu", enable_model_summary=False, **options)


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.mark.parametrize("given", ["keyword", "positional"])
async def test_fit_trains_on_its_loaders_as_on_the_same_loaders_given(given: str) -> None:
    torch.manual_seed(0)
    by_hand = TinyModule()
    data = Digits()
    await _trainer().fit(by_hand, data.train_dataloader(), data.val_dataloader())
    torch.manual_seed(0)
    module, data = TinyModule(), Digits()
    trainer = _trainer()
    if given == "keyword":
        await trainer.fit(module, datamodule=data)
    else:
        await trainer.fit(module, data)
    assert data.calls == [
        "prepare_data",
        "setup:fit",
        "train_dataloader",
        "val_dataloader",
        "teardown:fit",
    ]
    assert trainer.global_step == 8
    assert "val/loss" in trainer.latest  # validated on its val_dataloader
    mine, reference = _weights(module), _weights(by_hand)
    assert all(torch.equal(mine[k], reference[k]) for k in reference)


async def test_evaluation_stages_take_their_loader() -> None:
    module, data = Predicting(), Digits()
    trainer = _trainer()
    await trainer.fit(module, datamodule=data)
    data.calls.clear()
    assert "val/loss" in await trainer.validate(module, datamodule=data)
    assert "test/loss" in await trainer.test(module, data)
    assert "test/loss" in await trainer.test(data)  # the module of the last stage
    predictions = await trainer.predict(module, datamodule=data)
    assert [p.shape for p in predictions] == [torch.Size([16]), torch.Size([16])]
    assert data.calls == [
        "prepare_data", "setup:validate", "val_dataloader", "teardown:validate",
        "prepare_data", "setup:test", "test_dataloader", "teardown:test",
        "prepare_data", "setup:test", "test_dataloader", "teardown:test",
        "prepare_data", "setup:predict", "predict_dataloader", "teardown:predict",
    ]  # fmt: skip


async def test_without_validation_step_the_val_loader_is_not_made() -> None:
    class NoValidation(TinyModule):
        validation_step = loopbus.Module.validation_step  # type: ignore[assignment]

    data = Digits()
    trainer = _trainer(max_epochs=1)
    await trainer.fit(NoValidation(), datamodule=data)
    assert "val_dataloader" not in data.calls
    assert "val/loss" not in trainer.latest


@pytest.mark.filterwarnings("ignore:resuming mid-epoch by skipping")
async def test_its_state_is_saved_with_checkpoints_and_resumed(tmp_path: Path) -> None:
    data = Digits()
    data.seen_epochs = 7
    plugin = Checkpoint(tmp_path, every_n_steps=4, save_on_end=False, keep_last=None)
    trainer = Trainer(plugins=[plugin], device="cpu", max_steps=4, enable_model_summary=False)
    await trainer.fit(TinyModule(), datamodule=data)
    saved = loopbus.load_checkpoint(tmp_path)
    assert saved["datamodule"] == {"seen_epochs": 7}
    assert trainer.state_dict()  # outside a stage: no DataModule part is left behind
    resumed_data = Digits()
    again = Checkpoint(tmp_path, every_n_steps=4, save_on_end=False, keep_last=None)
    resumed = Trainer(plugins=[again], device="cpu", max_steps=8, enable_model_summary=False)
    await resumed.fit(TinyModule(), datamodule=resumed_data, ckpt_path="last")
    assert resumed_data.seen_epochs == 7
    assert resumed_data.calls.index("load_state_dict:7") > resumed_data.calls.index("setup:fit")
    assert resumed.global_step == 8


class _LightningLike:
    """A stand-in for ``LightningDataModule``: its loader methods only raise, its
    ``state_dict`` saves nothing, it has a ``trainer`` attribute and
    ``prepare_data_per_node``."""

    prepare_data_per_node = True

    def __init__(self) -> None:
        self.trainer: Any = None

    def prepare_data(self) -> None:
        pass

    def setup(self, stage: str) -> None:
        pass

    def teardown(self, stage: str) -> None:
        pass

    def train_dataloader(self) -> Any:
        raise MisconfigurationError("`train_dataloader` must be implemented")

    def val_dataloader(self) -> Any:
        raise MisconfigurationError("`val_dataloader` must be implemented")

    def test_dataloader(self) -> Any:
        raise MisconfigurationError("`test_dataloader` must be implemented")

    def predict_dataloader(self) -> Any:
        raise MisconfigurationError("`predict_dataloader` must be implemented")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


_LightningLike.__module__ = "lightning.pytorch.core.datamodule"


class TrainOnly(_LightningLike):
    """A user's DataModule on the Lightning-style base: training data only."""

    def train_dataloader(self) -> Any:
        return make_loader(n=32)


async def test_a_lightning_style_datamodule_works_unchanged(tmp_path: Path) -> None:
    data = TrainOnly()
    plugin = Checkpoint(tmp_path, every_n_steps=2, save_on_end=False)
    trainer = Trainer(plugins=[plugin], device="cpu", max_steps=2, enable_model_summary=False)
    await trainer.fit(TinyModule(), datamodule=data)  # no val_dataloader of its own
    assert data.trainer is trainer  # set, as Lightning sets it
    assert trainer.global_step == 2
    assert "val/loss" not in trainer.latest
    assert "datamodule" not in loopbus.load_checkpoint(tmp_path)  # the base's saves nothing
    with pytest.raises(MisconfigurationError, match=r"TrainOnly\.test_dataloader\(\), which"):
        await trainer.test(TinyModule(), datamodule=data)


def test_prepare_data_runs_on_one_process_per_node_then_setup_on_every_one() -> None:
    class Rank:
        def __init__(self, local_rank: int, global_zero: bool) -> None:
            self.local_rank, self.is_global_zero = local_rank, global_zero
            self.barriers = 0

        def barrier(self) -> None:
            self.barriers += 1

    class Host:
        def __init__(self, strategy: Rank) -> None:
            self.strategy = strategy

    for local_rank, global_zero, per_node, prepares in [
        (0, True, True, True),
        (0, False, True, True),  # rank 0 of another node
        (1, False, True, False),
        (0, False, False, False),  # prepare_data_per_node=False: global rank 0 only
        (0, True, False, True),
    ]:
        data = Digits()
        data.prepare_data_per_node = per_node  # type: ignore[attr-defined]
        strategy = Rank(local_rank, global_zero)
        loaders = loopbus.prepare_datamodule(data, "test", trainer=Host(strategy))
        assert ("prepare_data" in data.calls) == prepares
        assert data.calls[-2:] == ["setup:test", "test_dataloader"]
        assert strategy.barriers == 1
        assert len(loaders) == 1


async def test_bad_input_is_named() -> None:
    trainer = _trainer(max_epochs=1)
    data = Digits()
    with pytest.raises(MisconfigurationError, match=r"from a DataModule or from loaders, not both"):
        await trainer.fit(TinyModule(), make_loader(), datamodule=data)
    with pytest.raises(MisconfigurationError, match=r"takes a DataModule .* got DataLoader"):
        await trainer.test(TinyModule(), datamodule=make_loader())

    class Empty(Digits):
        def train_dataloader(self) -> Any:
            return None

    with pytest.raises(MisconfigurationError, match=r"Empty\.train_dataloader\(\) returned None"):
        await trainer.fit(TinyModule(), Empty())
    with pytest.raises(MisconfigurationError, match=r"stages are \['fit'"):
        loopbus.prepare_datamodule(data, "train")
    assert not loopbus.is_datamodule(make_loader())
    assert not loopbus.is_datamodule(Digits)  # the class, not an instance
    assert loopbus.is_datamodule(data)
