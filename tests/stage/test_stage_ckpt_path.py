"""``validate``/``test``/``predict`` with ``ckpt_path="best" | "last" | PATH``: the
module's weights (only those) come from that checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from loopbus import MisconfigurationError, Module, Plugin, Trainer, on
from loopbus.events import ValidationCompleted
from loopbus.plugins import Checkpoint
from loopbus.stage._saving import CheckpointSource
from tests.helpers import make_loader

# val/score per epoch, mode "max": epoch 1 is the best one, the last epoch (3) is not.
SCORES = [0.3, 0.9, 0.5, 0.4]


class Drifting(Module):
    """Weights that change every step; a scripted validation score per epoch; a note of
    the weights each epoch ended with, and of those each evaluation step saw."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4))
        self.at_epoch: dict[int, torch.Tensor] = {}
        self.seen: list[torch.Tensor] = []

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, _ = batch
        loss: torch.Tensor = (self.w * x).sum() + (self.w**2).sum()
        return loss

    def validation_step(self, batch: Any, ctx: Any) -> None:
        self.seen.append(self.w.detach().clone())

    @on(ValidationCompleted)
    def score(self, event: ValidationCompleted) -> None:
        if self.trainer.stage != "fit" or self.trainer.sanity_checking:
            return
        epoch = self.trainer.current_epoch
        self.put("val/score", SCORES[epoch])
        self.at_epoch[epoch] = self.w.detach().clone()

    def test_step(self, batch: Any, ctx: Any) -> None:
        self.seen.append(self.w.detach().clone())

    def predict_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        return self.w.detach().clone()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


async def fitted(tmp_path: Path) -> tuple[Trainer, Drifting, Checkpoint]:
    checkpoint = Checkpoint(tmp_path, monitor="val/score", mode="max")
    trainer = Trainer(max_epochs=len(SCORES), plugins=[checkpoint], device="cpu")
    module = Drifting()
    await trainer.fit(module, make_loader(n=32), make_loader(n=16))
    assert checkpoint.best_value == 0.9
    assert checkpoint.best_checkpoint_path == tmp_path / "epoch=1-step=4.ckpt"
    # The weights differ from epoch to epoch, so whose weights were used is telling.
    assert not torch.equal(module.at_epoch[1], module.at_epoch[3])
    return trainer, module, checkpoint


def scramble(module: Drifting) -> None:
    with torch.no_grad():
        module.w.fill_(123.0)
    module.seen.clear()


async def test_test_validate_and_predict_load_the_best_epochs_weights(tmp_path: Path) -> None:
    trainer, module, _ = await fitted(tmp_path)
    best = module.at_epoch[1]
    step = trainer.global_step

    scramble(module)
    await trainer.test(module, make_loader(n=16), ckpt_path="best")
    assert module.seen
    assert all(torch.equal(w, best) for w in module.seen)

    scramble(module)
    await trainer.validate(module, make_loader(n=16), ckpt_path="best")
    assert module.seen
    assert all(torch.equal(w, best) for w in module.seen)

    scramble(module)
    predictions = await trainer.predict(module, make_loader(n=16), ckpt_path="best")
    assert predictions
    assert all(torch.equal(w, best) for w in predictions)
    # Weights only: the run's position (step, epoch) is not loaded from the checkpoint.
    assert trainer.global_step == step
    assert trainer.current_epoch == len(SCORES) - 1


async def test_last_is_the_newest_checkpoint_as_for_fit(tmp_path: Path) -> None:
    trainer, module, checkpoint = await fitted(tmp_path)
    last = checkpoint.last_checkpoint_path
    assert last is not None
    assert last.name == f"epoch=3-step={trainer.global_step}.ckpt"
    scramble(module)
    await trainer.test(module, make_loader(n=16), ckpt_path="last")
    assert module.seen
    assert all(torch.equal(w, module.at_epoch[3]) for w in module.seen)


class Pointing(Plugin):
    """A plugin of another kind that implements ``CheckpointSource``: it names a
    checkpoint written elsewhere as its newest and as its best."""

    monitor = "val/score"

    def __init__(self, path: Path) -> None:
        self.path = path

    def latest_checkpoint(self) -> Path:
        return self.path

    @property
    def best_checkpoint_path(self) -> Path:
        return self.path


async def test_last_and_best_ask_any_plugin_that_implements_the_protocol(tmp_path: Path) -> None:
    _, module, _ = await fitted(tmp_path)
    pointing = Pointing(tmp_path / "epoch=1-step=4.ckpt")
    assert isinstance(pointing, CheckpointSource)
    trainer = Trainer(plugins=[pointing], device="cpu")
    for ckpt_path in ("last", "best"):
        scramble(module)
        await trainer.test(module, make_loader(n=16), ckpt_path=ckpt_path)
        assert module.seen
        assert all(torch.equal(w, module.at_epoch[1]) for w in module.seen)


async def test_a_path_loads_that_checkpoint(tmp_path: Path) -> None:
    _, module, _ = await fitted(tmp_path)
    # Another trainer, without plugins: a path needs none.
    trainer = Trainer(plugins=[], device="cpu")
    scramble(module)
    await trainer.test(module, make_loader(n=16), ckpt_path=tmp_path / "epoch=1-step=4.ckpt")
    assert module.seen
    assert all(torch.equal(w, module.at_epoch[1]) for w in module.seen)


async def test_best_without_a_monitored_checkpoint_plugin_says_so(tmp_path: Path) -> None:
    module = Drifting()
    trainer = Trainer(max_epochs=1, plugins=[], device="cpu")
    with pytest.raises(
        MisconfigurationError, match=r"ckpt_path='best' needs a Checkpoint plugin that monitors"
    ):
        await trainer.test(module, make_loader(n=16), ckpt_path="best")
    periodic = Trainer(max_epochs=1, plugins=[Checkpoint(tmp_path)], device="cpu")
    await periodic.fit(module, make_loader(n=16))
    with pytest.raises(MisconfigurationError, match=r"monitor nothing"):
        await periodic.test(module, make_loader(n=16), ckpt_path="best")
    assert module.seen == []  # nothing ran


async def test_best_before_any_best_exists_says_so(tmp_path: Path) -> None:
    trainer = Trainer(
        max_epochs=1,
        plugins=[Checkpoint(tmp_path, monitor="val/score", mode="max")],
        device="cpu",
    )
    with pytest.raises(MisconfigurationError, match=r"has saved no best checkpoint yet"):
        await trainer.test(Drifting(), make_loader(n=16), ckpt_path="best")


async def test_last_before_any_checkpoint_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    trainer = Trainer(max_epochs=1, plugins=[Checkpoint(tmp_path)], device="cpu")
    with pytest.raises(MisconfigurationError, match=r"no checkpoint has been written yet"):
        await trainer.validate(Drifting(), make_loader(n=16), ckpt_path="last")


async def test_two_monitored_checkpoint_plugins_are_ambiguous(tmp_path: Path) -> None:
    plugins = [
        Checkpoint(tmp_path / "a", monitor="val/score", mode="max"),
        Checkpoint(tmp_path / "b", monitor="val/score", mode="min"),
    ]
    trainer = Trainer(max_epochs=2, plugins=plugins, device="cpu")
    module = Drifting()
    await trainer.fit(module, make_loader(n=16), make_loader(n=16))
    with pytest.raises(
        MisconfigurationError, match=r"ambiguous.*ckpt_path=plugin.best_checkpoint_path"
    ):
        await trainer.test(module, make_loader(n=16), ckpt_path="best")
    best_path = plugins[1].best_checkpoint_path
    assert best_path is not None
    await trainer.test(module, make_loader(n=16), ckpt_path=best_path)
