"""Plugin state through real checkpoint files: Trainer.save_checkpoint, then
fit(ckpt_path=...) with fresh plugins."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from loopbus import Trainer, load_checkpoint
from loopbus.plugins import CSVLogger, EarlyStopping, MixedPrecision, ProgressBar, Timer
from tests.helpers import TinyModule, make_loader


class StepScript(TinyModule):
    def __init__(self, values: list[float]) -> None:
        super().__init__()
        self.values = values

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        time.sleep(0.002)
        self.put("metric", self.values[self.trainer.global_step])
        return super().training_step(batch, ctx)


async def test_early_stopping_timer_and_scaler_resume_from_a_checkpoint_file(
    tmp_path: Path,
) -> None:
    script = [1.0, 0.5, 0.7, 0.6] + [0.9] * 40
    data = make_loader(n=16 * 8)
    bar_output = (tmp_path / "bar.txt").open("a")

    def plugins() -> list[Any]:
        return [
            ProgressBar(file=bar_output),
            CSVLogger(tmp_path, mode="a", name="", version=""),
            EarlyStopping("metric", patience=3),
            EarlyStopping("metric", mode="max", patience=100),  # a second one: its own key
            Timer(duration=3600),
        ]

    first = plugins()
    trainer = Trainer(
        max_steps=4,
        plugins=first,
        precision=MixedPrecision("16-mixed", init_scale=2.0**20),
        device="cpu",
    )
    await trainer.fit(StepScript(script), data)
    path = trainer.save_checkpoint(tmp_path / "step4.ckpt")
    saved = load_checkpoint(path)
    assert saved[f"plugins/{first[2].state_key}"]["wait_count"] == 2
    assert saved[f"plugins/{first[3].state_key}"]["best_score"] == 1.0
    assert saved["plugins/Timer"]["time_elapsed"]["fit"] > 0
    scale = trainer.precision.state_dict()["scaler"]["scale"]

    second = plugins()
    precision = MixedPrecision("16-mixed")
    resumed = Trainer(max_steps=40, plugins=second, precision=precision, device="cpu")
    await resumed.fit(StepScript(script), data, ckpt_path=path)
    # The third check in a row without improvement comes at the first resumed step.
    assert resumed.global_step == 5
    assert resumed.stop_reason is not None
    assert resumed.stop_reason.startswith("EarlyStopping: metric did not improve")
    assert second[4].time_elapsed("fit") > first[4].time_elapsed("fit")
    assert precision.scaler is not None
    assert precision.scaler.get_scale() <= scale
    bar_output.close()
    last = (tmp_path / "bar.txt").read_text().splitlines()[-1]
    assert last.startswith("Stopped at epoch 1, step 5: EarlyStopping: metric did not improve")


async def test_a_spent_time_budget_stops_a_resumed_run_before_its_first_step(
    tmp_path: Path,
) -> None:
    trainer = Trainer(max_steps=3, plugins=[Timer(duration=0.2)], device="cpu")
    await trainer.fit(StepScript([0.0] * 10), make_loader(n=48))
    trainer.plugins[0].load_state_dict({"time_elapsed": {"fit": 0.5}})  # as if it had run longer
    path = trainer.save_checkpoint(tmp_path / "spent.ckpt")

    resumed = Trainer(max_steps=10, plugins=[Timer(duration=0.2)], device="cpu")
    await resumed.fit(StepScript([0.0] * 10), make_loader(n=160), ckpt_path=path)
    assert resumed.global_step == 3  # where the checkpoint was: no further step
    assert resumed.stop_reason is not None
    assert resumed.stop_reason.startswith("Timer: the time budget")
