"""``num_sanity_val_steps``, ``fast_dev_run`` and the default epoch limit."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from loopbus import MisconfigurationError, Plugin, Trainer, on
from loopbus.events import PutRecord, TrainBatchCompleted, ValidationCompleted, ValidationStarted
from loopbus.plugins import Checkpoint, CSVLogger, EarlyStopping, JSONLLogger, read_jsonl
from tests.helpers import TinyModule, make_loader


class Counting(TinyModule):
    """Counts its steps; puts a record that only a sanity check would produce."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {"train": 0, "val": 0, "sanity": 0, "test": 0, "predict": 0}
        self.completed_loops: list[str] = []

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        self.calls["train"] += 1
        return super().training_step(batch, ctx)

    def validation_step(self, batch: Any, ctx: Any) -> None:
        if self.trainer.sanity_checking:
            self.calls["sanity"] += 1
            self.put("sanity/only", 1.0)
        else:
            self.calls["val"] += 1
        super().validation_step(batch, ctx)

    @on(ValidationCompleted)
    def epoch_end(self, event: ValidationCompleted) -> None:
        # The module's own handlers see the sanity run (to reset their metrics, say).
        self.completed_loops.append(event.loop)
        self.put("val/epoch_metric", 0.5)

    def test_step(self, batch: Any, ctx: Any) -> None:
        self.calls["test"] += 1
        super().test_step(batch, ctx)

    def predict_step(self, batch: Any, ctx: Any) -> Any:
        self.calls["predict"] += 1
        return batch[0].sum()


class Witness(Plugin):
    """Notes every record and validation run a plugin can see."""

    def __init__(self) -> None:
        self.records: list[PutRecord] = []
        self.validations = 0

    @on(PutRecord)
    def record(self, record: PutRecord) -> None:
        self.records.append(record)

    @on(ValidationStarted)
    def validation(self, event: ValidationStarted) -> None:
        self.validations += 1


class Broken(TinyModule):
    def __init__(self) -> None:
        super().__init__()
        self.trained = 0

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        self.trained += 1
        return super().training_step(batch, ctx)

    def validation_step(self, batch: Any, ctx: Any) -> None:
        raise KeyError("a typo in validation_step")


async def test_a_broken_validation_step_fails_before_any_training_step() -> None:
    module = Broken()
    trainer = Trainer(max_epochs=3, plugins=[], device="cpu")
    with pytest.raises(KeyError, match="a typo in validation_step") as info:
        await trainer.fit(module, make_loader(n=64), make_loader(n=64))
    assert module.trained == 0
    assert trainer.global_step == 0
    assert any("sanity check (num_sanity_val_steps=2)" in note for note in info.value.__notes__)
    assert not trainer.sanity_checking


async def test_sanity_records_reach_no_plugin_logger_or_latest(tmp_path: Path) -> None:
    module = Counting()
    witness = Witness()
    logger = JSONLLogger(tmp_path, name="", version="")
    stopper = EarlyStopping("val/epoch_metric", patience=5)
    checkpoint = Checkpoint(tmp_path / "ckpt", monitor="val/epoch_metric")
    trainer = Trainer(max_epochs=1, plugins=[witness, logger, stopper, checkpoint], device="cpu")
    # 4 validation batches: the default sanity check runs 2 of them.
    await trainer.fit(module, make_loader(n=32), make_loader(n=64))
    assert module.calls["sanity"] == 2
    assert module.calls["val"] == 4
    assert module.completed_loops == ["sanity_check", "validate"]
    # Plugins saw one validation run and its records only.
    assert witness.validations == 1
    names = [r.name for r in witness.records]
    assert "sanity/only" not in names
    assert names.count("val/epoch_metric") == 1
    assert names.count("val/loss") == 4
    assert "sanity/only" not in trainer.latest
    assert stopper.checks == 1
    assert checkpoint.best_value == 0.5
    logged = [r.name for r in read_jsonl(logger.path)]
    assert "sanity/only" not in logged
    assert logged.count("val/epoch_metric") == 1


@pytest.mark.parametrize(("steps", "expected"), [(0, 0), (1, 1), (3, 3), (-1, 4), (10, 4)])
async def test_num_sanity_val_steps_counts_batches(steps: int, expected: int) -> None:
    module = Counting()
    trainer = Trainer(max_epochs=1, num_sanity_val_steps=steps, plugins=[], device="cpu")
    await trainer.fit(module, make_loader(n=16), make_loader(n=64))
    assert module.calls["sanity"] == expected
    assert module.completed_loops[:-1] == (["sanity_check"] if expected else [])


async def test_limit_val_batches_caps_the_sanity_check_and_no_val_data_skips_it() -> None:
    module = Counting()
    trainer = Trainer(
        max_epochs=1, num_sanity_val_steps=-1, limit_val_batches=3, plugins=[], device="cpu"
    )
    await trainer.fit(module, make_loader(n=16), make_loader(n=128))
    assert module.calls["sanity"] == 3
    module = Counting()
    await Trainer(max_epochs=1, plugins=[], device="cpu").fit(module, make_loader(n=16))
    assert module.calls["sanity"] == 0


async def test_training_is_the_same_with_or_without_the_sanity_check() -> None:
    async def run(steps: int) -> torch.Tensor:
        loopbus.seed_everything(7)
        module = TinyModule()
        trainer = Trainer(max_epochs=2, num_sanity_val_steps=steps, plugins=[], device="cpu")
        train = make_loader(n=64, shuffle=True)
        await trainer.fit(module, train, make_loader(n=32, shuffle=True))
        return module.layer.weight.detach().clone()

    # The sanity check iterates a shuffled loader (which draws from the global
    # generators): it leaves them as it found them.
    assert torch.equal(await run(0), await run(2))


def test_num_sanity_val_steps_is_validated() -> None:
    with pytest.raises(MisconfigurationError, match=r"num_sanity_val_steps must be .*-1 runs"):
        Trainer(num_sanity_val_steps=-2, plugins=[], device="cpu")


# ---------------------------------------------------------------- fast_dev_run


async def test_fast_dev_run_runs_one_batch_of_each_stage_and_writes_no_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    module = Counting()
    plugins = [
        Checkpoint(tmp_path / "ckpt", every_n_steps=1),
        CSVLogger(tmp_path / "csv", name="", version=""),
        JSONLLogger(tmp_path / "jsonl", name="", version=""),
    ]
    with caplog.at_level(logging.WARNING, logger="loopbus"):
        trainer = Trainer(fast_dev_run=True, max_epochs=50, plugins=plugins, device="cpu")
    assert "fast_dev_run=1" in caplog.text
    assert "none are written" in caplog.text
    train, val = make_loader(n=64), make_loader(n=64)
    await trainer.fit(module, train, val)
    await trainer.test(module, val)
    predictions = await trainer.predict(module, val)
    assert module.calls == {"train": 1, "val": 1, "sanity": 0, "test": 1, "predict": 1}
    assert len(predictions) == 1
    assert trainer.current_epoch == 0
    assert trainer.global_step == 1
    assert os.listdir(tmp_path) == []


async def test_fast_dev_run_n_runs_n_batches() -> None:
    module = Counting()
    trainer = Trainer(fast_dev_run=3, plugins=[], device="cpu")
    await trainer.fit(module, make_loader(n=128), make_loader(n=128))
    await trainer.test(module, make_loader(n=128))
    assert module.calls == {"train": 3, "val": 3, "sanity": 0, "test": 3, "predict": 0}
    assert trainer.max_epochs == 1


@pytest.mark.parametrize("value", [-1, 1.5, "yes"])
def test_fast_dev_run_is_validated(value: Any) -> None:
    with pytest.raises(MisconfigurationError, match=r"fast_dev_run must be .*True runs 1 batch"):
        Trainer(fast_dev_run=value, plugins=[], device="cpu")


# ---------------------------------------------------------------- limits


def test_no_limit_given_means_1000_epochs_with_a_notice(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="loopbus"):
        trainer = Trainer(plugins=[], device="cpu")
    assert trainer.max_epochs == 1000
    assert trainer.max_steps == math.inf
    assert "max_epochs=1000" in caplog.text
    assert "max_epochs=-1" in caplog.text


@pytest.mark.parametrize(
    ("options", "epochs", "steps"),
    [
        ({"max_epochs": -1}, math.inf, math.inf),
        ({"max_steps": -1}, math.inf, math.inf),
        ({"max_steps": 10}, math.inf, 10),
        ({"max_epochs": 3}, 3, math.inf),
    ],
)
def test_a_limit_given_or_minus_one_means_no_notice(
    options: dict[str, Any], epochs: float, steps: float, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="loopbus"):
        trainer = Trainer(plugins=[], device="cpu", **options)
    assert (trainer.max_epochs, trainer.max_steps) == (epochs, steps)
    assert "max_epochs" not in caplog.text


class SaveAndStop(Plugin):
    """Saves a checkpoint after optimizer step ``at`` (inside the epoch) and stops."""

    def __init__(self, path: Path, at: int) -> None:
        self.path = path
        self.at = at
        self.trainer: Trainer | None = None

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer

    @on(TrainBatchCompleted)
    def save(self, event: TrainBatchCompleted) -> None:
        if event.step == self.at and self.trainer is not None:
            self.trainer.save_checkpoint(self.path)
            self.trainer.request_stop("saved")


async def test_a_resume_mid_epoch_skips_the_sanity_check_one_between_epochs_runs_it(
    tmp_path: Path,
) -> None:
    module = Counting()
    mid = tmp_path / "mid.ckpt"
    trainer = Trainer(max_epochs=2, plugins=[SaveAndStop(mid, at=2)], device="cpu")
    await trainer.fit(module, make_loader(n=64), make_loader(n=32))
    assert module.calls["sanity"] == 2
    assert module.calls["train"] == 2
    module = Counting()
    resumed = Trainer(max_epochs=2, plugins=[], device="cpu")
    with pytest.warns(UserWarning, match="resuming mid-epoch by skipping the 2 batches"):
        await resumed.fit(module, make_loader(n=64), make_loader(n=32), ckpt_path=mid)
    assert module.calls["sanity"] == 0
    assert module.calls["train"] == 6  # the epoch's last 2 batches, then one more epoch
    # Saved between epochs: the sanity check runs again.
    end = resumed.save_checkpoint(tmp_path / "end.ckpt")
    module = Counting()
    again = Trainer(max_epochs=3, plugins=[], device="cpu")
    await again.fit(module, make_loader(n=64), make_loader(n=32), ckpt_path=end)
    assert module.calls["sanity"] == 2
    assert module.calls["train"] == 4
