from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from loopbus import CheckpointError, HandlerError, Trainer, on
from loopbus.events import ValidationCompleted
from loopbus.plugins import EarlyStopping, ProgressBar
from tests.helpers import TinyModule, make_loader


class StepScript(TinyModule):
    """Puts ``metric`` from a script, one value per training step."""

    def __init__(self, values: Sequence[float]) -> None:
        super().__init__()
        self.values = list(values)

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        self.put("metric", self.values[self.trainer.global_step])
        return super().training_step(batch, ctx)


class EpochScript(TinyModule):
    """Puts ``val/metric`` from a script once per validation pass (an epoch-level value)."""

    def __init__(self, values: Sequence[float]) -> None:
        super().__init__()
        self.values = list(values)
        self.passes = 0

    def validation_step(self, batch: Any, ctx: Any) -> None:
        pass

    @on(ValidationCompleted)
    def put_metric(self, event: ValidationCompleted) -> None:
        if self.trainer.sanity_checking:
            return  # the script is for the real validation passes
        self.put("val/metric", self.values[self.passes])
        self.passes += 1


def round_trip(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


async def test_stops_at_the_step_the_script_says() -> None:
    # best 1.0 at step 1, 0.8 at step 3; then three checks in a row without improvement.
    script = [1.0, 1.1, 0.8, 0.85, 0.8, 0.79, 2.0, 0.5, 0.1, 0.1]
    stopper = EarlyStopping("metric", patience=3, min_delta=0.02)
    trainer = Trainer(max_epochs=10, plugins=[stopper], device="cpu")
    await trainer.fit(StepScript(script), make_loader(n=16 * 10))
    # 0.79 is not better than 0.8 by more than 0.02: steps 4, 5 and 6 do not improve.
    assert trainer.global_step == 6
    assert trainer.should_stop
    assert trainer.stop_reason == (
        "EarlyStopping: metric did not improve by more than 0.02 for 3 checks in a row "
        "(best 0.8 at step 3)"
    )
    assert (stopper.wait_count, stopper.best_score, stopper.best_step) == (3, 0.8, 3)
    assert stopper.stopped_step == 6
    assert stopper.checks == 6


async def test_mode_max_on_an_epoch_metric_stops_after_the_validation_pass() -> None:
    out = io.StringIO()
    stopper = EarlyStopping("val/metric", mode="max", patience=2)
    trainer = Trainer(max_epochs=20, plugins=[ProgressBar(file=out), stopper], device="cpu")
    await trainer.fit(EpochScript([0.5, 0.7, 0.6, 0.7, 0.9]), make_loader(n=32), make_loader(n=16))
    # Epochs 0 and 1 improve, 2 and 3 do not: stop after the validation of epoch 3.
    assert trainer.current_epoch == 3
    assert trainer.global_step == 8
    last = out.getvalue().splitlines()[-1]
    assert last == (
        "Stopped at epoch 3, step 8: EarlyStopping: val/metric did not improve by more than "
        "0 for 2 checks in a row (best 0.7 at step 4)"
    )


async def test_thresholds_and_non_finite_values_stop_at_once() -> None:
    cases = [
        (
            EarlyStopping("metric", stopping_threshold=0.5),
            [0.9, 0.4, 0.3],
            2,
            "reached the stopping threshold",
        ),
        (EarlyStopping("metric", divergence_threshold=5.0), [0.9, 6.0, 0.3], 2, "diverged"),
        (
            EarlyStopping("metric", patience=10),
            [0.9, math.nan, 0.3],
            2,
            "metric = nan is not finite",
        ),
    ]
    for stopper, script, step, reason in cases:
        trainer = Trainer(max_epochs=1, plugins=[stopper], device="cpu")
        await trainer.fit(StepScript(script), make_loader(n=48))
        assert trainer.global_step == step
        assert trainer.stop_reason is not None
        assert reason in trainer.stop_reason


async def test_counters_survive_a_checkpoint_round_trip() -> None:
    stopper = EarlyStopping("metric", patience=3)
    trainer = Trainer(max_steps=4, plugins=[stopper], device="cpu")
    await trainer.fit(StepScript([1.0, 0.5, 0.7, 0.6]), make_loader(n=64))
    assert (stopper.wait_count, stopper.best_score, stopper.best_step) == (2, 0.5, 2)
    state = round_trip(stopper.state_dict())
    assert state == stopper.state_dict()

    resumed = EarlyStopping("metric", patience=3)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == stopper.state_dict()
    # One more check without improvement is the third in a row: the resumed run stops at
    # its first step instead of starting the count again.
    trainer = Trainer(max_steps=10, plugins=[resumed], device="cpu")
    await trainer.fit(StepScript([0.9] * 10), make_loader(n=160))
    assert trainer.global_step == 1
    assert resumed.wait_count == 3
    assert resumed.stopped_step == 1
    assert resumed.checks == 5


def test_a_state_for_another_monitor_is_refused() -> None:
    state = EarlyStopping("val/loss").state_dict()
    with pytest.raises(
        ValueError, match=r"saved for monitor='val/loss', mode='min'.*monitors 'val/acc'"
    ):
        EarlyStopping("val/acc", mode="max").load_state_dict(state)


async def test_resuming_with_another_monitor_is_refused_before_anything_loads(
    tmp_path: Any,
) -> None:
    module = TinyModule()
    trainer = Trainer(max_epochs=1, plugins=[EarlyStopping("train/loss")], device="cpu")
    await trainer.fit(module, make_loader())
    path = await trainer.save_checkpoint_async(tmp_path / "es.ckpt")

    fresh = TinyModule()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    stopper = EarlyStopping("train/loss", mode="max")
    other = Trainer(max_epochs=2, plugins=[stopper], device="cpu")
    with pytest.raises(
        CheckpointError,
        match=r"(?s)missing from the checkpoint: plugins/EarlyStopping.*'mode': 'max'.*"
        r"in the checkpoint but not in this run: plugins/EarlyStopping.*'mode': 'min'",
    ):
        await other.fit(fresh, make_loader(), ckpt_path=path)
    # Found by the check before loading: the weights are untouched.
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())

    # With ckpt_strict=False the rest resumes and the stopper starts afresh.
    stopper = EarlyStopping("train/loss", mode="max")
    other = Trainer(max_epochs=2, plugins=[stopper], device="cpu")
    with pytest.warns(UserWarning, match="ckpt_strict=False"):
        await other.fit(fresh, make_loader(), ckpt_path=path, ckpt_strict=False)
    assert other.global_step == 8  # the second epoch ran after the resumed first
    assert stopper.best_step > 4  # its own best, from the resumed epoch: it started afresh


async def test_strict_reports_a_monitor_that_is_never_put() -> None:
    trainer = Trainer(max_epochs=3, plugins=[EarlyStopping("val/los")], device="cpu")
    with pytest.raises(
        HandlerError,
        match=r"monitors 'val/los'.*by the end of epoch 0.*\['train/loss', 'val/loss'\]",
    ):
        await trainer.fit(TinyModule(), make_loader(n=32), make_loader(n=32))
    # Without validation the check happens when fit ends; strict=False never complains.
    trainer = Trainer(max_epochs=1, plugins=[EarlyStopping("val/los")], device="cpu")
    with pytest.raises(HandlerError, match="during fit"):
        await trainer.fit(TinyModule(), make_loader(n=32))
    trainer = Trainer(max_epochs=1, plugins=[EarlyStopping("val/los", strict=False)], device="cpu")
    await trainer.fit(TinyModule(), make_loader(n=32), make_loader(n=32))


async def test_validate_alone_does_not_count() -> None:
    stopper = EarlyStopping("val/loss", patience=0)
    trainer = Trainer(plugins=[stopper], device="cpu")
    await trainer.validate(TinyModule(), make_loader(n=64))
    assert stopper.checks == 0
    assert stopper.wait_count == 0


def test_bad_options_are_reported() -> None:
    with pytest.raises(ValueError, match=r"mode=.*'min'.*got 'up'"):
        EarlyStopping("x", mode="up")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"patience=.*got -1"):
        EarlyStopping("x", patience=-1)
    with pytest.raises(ValueError, match=r"min_delta=.*got -0.1"):
        EarlyStopping("x", min_delta=-0.1)
    with pytest.raises(ValueError, match=r"monitor=.*got ''"):
        EarlyStopping("")
