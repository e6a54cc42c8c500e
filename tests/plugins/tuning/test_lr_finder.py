"""The learning-rate finder: the sweep, its suggestion and early stop, its records, and
the exact restore that makes ``find_lr`` then ``fit`` the same as ``fit`` alone."""

from __future__ import annotations

import copy
import inspect
import json
import math
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import loopbus
from loopbus import MisconfigurationError, Module, Plugin, PutRecord, Trainer, on
from loopbus.events import BeforeOptimizerStep
from loopbus.plugins.tuning import LRFinder, LRFinderResult, find_lr
from tests.helpers import TinyModule, make_loader
from tests.torchrun import env

SCRIPT = Path(__file__).resolve().parent / "_lr_finder_script.py"


class Regression(Module):
    """Least squares on whitened inputs: SGD is stable below a rate of about 1 (the
    loss's Hessian is about 2·I) and learns little below 1e-3 in a hundred steps."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.lr = lr

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def sweep_trainer(**options: Any) -> Trainer:
    return Trainer(plugins=[], device="cpu", max_epochs=1, **options)


def regression_data(batch_size: int = 64) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(1024, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class Classifier(Module):
    """An MLP with dropout (draws from torch's generator every step), SGD with
    momentum (optimizer state) and a per-step scheduler (scheduler state)."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2)
        )
        self.norm = torch.nn.BatchNorm1d(4)  # buffers: running statistics
        self.lr = lr

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(self.norm(x)), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.9)
        schedule = {"scheduler": scheduler, "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": schedule}


class Records(Plugin):
    delivery = loopbus.Delivery(destination="loggers")

    def __init__(self) -> None:
        self.seen: list[PutRecord] = []

    @on(PutRecord)
    def keep(self, record: PutRecord) -> None:
        self.seen.append(record)

    def values(self, name: str) -> list[Any]:
        return [r.value for r in self.seen if r.name == name]


def rng_states() -> tuple[Any, ...]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def same_rng(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return (
        torch.equal(a[0], b[0])
        and a[1] == b[1]
        and all(np.array_equal(x, y) for x, y in zip(a[2], b[2], strict=True))
    )


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def snapshot(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def shuffled_loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(96, 4, generator=g)
    y = (x[:, 0] + x[:, 1] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True)


# ------------------------------------------------------------------ restore
async def test_find_lr_then_fit_equals_fit_with_the_rate_set_by_hand() -> None:
    torch.manual_seed(0)
    tuned = Classifier()
    torch.manual_seed(0)
    by_hand = Classifier()
    data = shuffled_loader()

    torch.manual_seed(1)
    before, rng = snapshot(tuned), rng_states()
    trainer = Trainer(max_epochs=2, plugins=[], device="cpu")
    result = await find_lr(trainer, tuned, data, num_training=30, update_attr=True)
    # The sweep trained (its loss moved) and then everything was put back.
    assert len(result.lrs) >= 12
    assert result.suggestion is not None
    assert result.raw_losses[0] != result.raw_losses[-1]
    assert same_tensors(snapshot(tuned), before)
    assert same_rng(rng_states(), rng)
    assert all(p.grad is None for p in tuned.parameters())
    assert tuned.lr == result.suggestion
    assert (trainer.global_step, trainer.current_epoch, trainer.latest) == (0, 0, {})
    await trainer.fit(tuned, data)

    torch.manual_seed(1)
    by_hand.lr = result.suggestion
    await Trainer(max_epochs=2, plugins=[], device="cpu").fit(by_hand, data)
    assert trainer.global_step == 12
    assert same_tensors(snapshot(tuned), snapshot(by_hand))
    assert not same_tensors(snapshot(tuned), before)


async def test_a_trainer_that_trained_keeps_its_optimizer_scheduler_and_loops() -> None:
    module = Classifier()
    trainer = Trainer(max_epochs=1, plugins=[], device="cpu")
    data = shuffled_loader()
    await trainer.fit(module, data)
    weights = snapshot(module)
    optimizer = copy.deepcopy(trainer.optimizers[0].state_dict())
    scheduler = trainer.lr_scheduler_configs[0].scheduler.state_dict()
    loops, step, latest = trainer.fit_loop.state_dict(), trainer.global_step, dict(trainer.latest)

    result = await find_lr(trainer, module, data, num_training=20, min_lr=1e-3, max_lr=10.0)
    assert same_tensors(snapshot(module), weights)
    after = trainer.optimizers[0].state_dict()
    assert after["param_groups"] == optimizer["param_groups"]
    assert all(
        torch.equal(after["state"][k]["momentum_buffer"], optimizer["state"][k]["momentum_buffer"])
        for k in optimizer["state"]
    )
    assert trainer.lr_scheduler_configs[0].scheduler.state_dict() == scheduler
    assert trainer.fit_loop.state_dict() == loops
    assert (trainer.global_step, trainer.latest) == (step, latest)
    assert len(result.lrs) >= 2

    # update_attr also sets the rate of the optimizers the trainer keeps for the module.
    result = await find_lr(trainer, module, data, num_training=20, update_attr=True)
    assert module.lr == result.suggestion
    assert trainer.optimizers[0].param_groups[0]["lr"] == result.suggestion


def test_from_synchronous_code_it_runs_to_completion() -> None:
    module, data = Regression(), regression_data()
    before = snapshot(module)
    result = find_lr(Trainer(max_steps=5, plugins=[], device="cpu"), module, data, num_training=12)
    assert isinstance(result, LRFinderResult)
    assert len(result.lrs) == 12
    assert same_tensors(snapshot(module), before)


async def test_in_async_code_it_returns_an_awaitable() -> None:
    call = find_lr(sweep_trainer(), Regression(), regression_data(), num_training=5)
    assert inspect.isawaitable(call)
    result = await call
    assert len(result.lrs) == 5


# ------------------------------------------------------------------ the sweep
async def test_suggestion_on_least_squares_lies_in_the_stable_decade() -> None:
    torch.manual_seed(0)
    result = await find_lr(
        sweep_trainer(),
        Regression(),
        regression_data(),
        min_lr=1e-4,
        max_lr=10.0,
    )
    # Below 1e-2 the loss barely moves in 100 steps; from about 1 on SGD diverges.
    assert result.suggestion is not None
    assert 1e-2 <= result.suggestion < 1.0
    assert result.lrs[0] == pytest.approx(1e-4)
    ratios = [b / a for a, b in zip(result.lrs, result.lrs[1:], strict=False)]
    assert ratios == pytest.approx([10 ** (5 / 99)] * len(ratios))
    index = result.suggestion_index
    assert index is not None
    assert result.lrs[index] == result.suggestion
    assert result.suggest(skip_begin=0, skip_end=0) is not None


def _lightning_rule(lrs: list[float], losses: list[float], skip_begin: int, skip_end: int) -> int:
    """Lightning's suggestion (2.1 on), written out: the most negative gradient of the
    losses with respect to the rates, over the finite points of the window."""
    window = torch.tensor(losses[skip_begin:-skip_end], dtype=torch.float64)
    rates = torch.tensor(lrs[skip_begin:-skip_end], dtype=torch.float64)
    finite = torch.isfinite(window)
    gradient = torch.gradient(window[finite], spacing=[rates[finite]])[0]
    return skip_begin + int(torch.nonzero(finite)[int(gradient.argmin())])


async def test_the_per_lr_rule_is_lightning_s_and_reads_a_lower_rate() -> None:
    torch.manual_seed(0)
    result = await find_lr(
        sweep_trainer(), Regression(), regression_data(), min_lr=1e-4, max_lr=10.0, rule="per_lr"
    )
    assert result.rule == "per_lr"
    index = result.suggestion_index
    assert index == _lightning_rule(result.lrs, result.losses, 10, 1)
    assert result.suggestion == result.lrs[index]
    # Per unit of rate, on an exponential sweep, a drop at a low rate weighs more: the
    # suggestion is at most the per-step one (and each rule reads the other on demand).
    per_step = result.suggest(rule="per_step")
    assert per_step is not None
    assert result.suggestion <= per_step
    assert LRFinderResult(lrs=result.lrs, losses=result.losses).suggestion == per_step
    with pytest.raises(MisconfigurationError, match="rule"):
        result.suggest(rule="steepest")


async def test_the_sweep_stops_early_when_the_loss_diverges() -> None:
    torch.manual_seed(0)
    result = await find_lr(
        sweep_trainer(), Regression(), regression_data(), min_lr=1e-4, max_lr=10.0
    )
    assert result.stopped_early
    assert result.early_stop_reason is not None
    assert "early_stop_threshold=4" in result.early_stop_reason
    assert len(result.lrs) < 100
    assert result.lrs[-1] > 1.0  # where SGD on this problem diverges
    assert result.losses[-1] > 4.0 * min(result.losses[:-1])

    full = await find_lr(
        sweep_trainer(),
        Regression(),
        regression_data(),
        min_lr=1e-4,
        max_lr=10.0,
        early_stop_threshold=None,
    )
    assert not full.stopped_early
    assert len(full.lrs) == 100
    assert full.lrs[-1] == pytest.approx(10.0)


async def test_linear_mode_and_the_rate_the_optimizer_steps_with() -> None:
    class Used(Plugin):
        def __init__(self) -> None:
            self.lrs: list[float] = []

        @on(BeforeOptimizerStep)
        def seen(self, event: BeforeOptimizerStep) -> None:
            self.lrs.append(event.optimizer.param_groups[0]["lr"])

    used = Used()
    # Classifier's StepLR changes the rate after each step: the sweep's rate wins.
    result = await find_lr(
        sweep_trainer(),
        Classifier(),
        shuffled_loader(),
        min_lr=0.01,
        max_lr=0.1,
        num_training=10,
        mode="linear",
        plugins=[used],
    )
    assert result.lrs == pytest.approx([0.01 + 0.01 * i for i in range(10)])
    assert used.lrs == result.lrs
    assert result.mode == "linear"


async def test_accumulation_averages_the_window_and_sweeps_per_optimizer_step() -> None:
    module = TinyModule()
    data = make_loader(n=64, batch_size=8)
    with torch.no_grad():
        batches = list(data)
        first = [torch.nn.functional.cross_entropy(module(x), y).item() for x, y in batches[:2]]
    trainer = Trainer(plugins=[], device="cpu", max_epochs=1, accumulate_grad_batches=2)
    result = await find_lr(trainer, module, data, num_training=6)
    assert len(result.lrs) == 6  # 12 batches, 6 optimizer steps
    assert result.raw_losses[0] == pytest.approx(sum(first) / 2)
    assert result.losses[0] == pytest.approx(result.raw_losses[0])  # bias-corrected


async def test_losses_are_smoothed_with_bias_correction() -> None:
    result = await find_lr(
        sweep_trainer(), Regression(), regression_data(), num_training=20
    )
    # avg_n = 0.98·avg_(n-1) + 0.02·raw_n (avg_(-1) = 0), smoothed_n = avg_n / (1 - 0.98^(n+1))
    avg, expected = 0.0, []
    for n, raw in enumerate(result.raw_losses):
        avg = 0.98 * avg + 0.02 * raw
        expected.append(avg / (1 - 0.98 ** (n + 1)))
    assert result.losses == pytest.approx(expected, rel=1e-12)
    assert result.losses[0] == result.raw_losses[0]


# ------------------------------------------------------------------ records and plot
async def test_the_curve_is_put_as_records() -> None:
    records = Records()
    result = await find_lr(
        sweep_trainer(),
        Regression(),
        regression_data(),
        num_training=15,
        plugins=[records],
    )
    assert records.values("lr_find/lr") == result.lrs
    assert records.values("lr_find/loss") == result.losses
    assert [r.step for r in records.seen if r.name == "lr_find/lr"] == list(range(1, 16))


def test_plot_names_the_fix_without_matplotlib(tmp_path: Path) -> None:
    result = LRFinderResult(lrs=[1e-3, 1e-2, 1e-1], losses=[1.0, 0.5, 0.4])
    with pytest.raises(MisconfigurationError, match=r"\.png, \.svg, \.pdf"):
        result.plot(tmp_path / "curve.jpg")
    if sys.modules.get("matplotlib") is None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            with pytest.raises(ModuleNotFoundError, match="pip install matplotlib"):
                result.plot(tmp_path / "curve.png")
            assert not (tmp_path / "curve.png").exists()
            return
    pytest.skip("matplotlib is installed: test_plot_writes_png_and_svg covers it")


def test_plot_writes_png_and_svg(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    lrs = [10 ** (-i / 4) for i in range(20, 0, -1)]
    result = LRFinderResult(lrs=lrs, losses=[1 / (i + 1) for i in range(20)])
    assert result.plot(tmp_path / "curve.png").read_bytes()[:4] == b"\x89PNG"
    assert b"<svg" in result.plot(tmp_path / "curve.svg").read_bytes()


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"min_lr": 1.0, "max_lr": 1e-3}, "min_lr must be smaller than max_lr"),
        ({"min_lr": 0.1, "max_lr": 0.1}, "min_lr must be smaller than max_lr"),
        ({"min_lr": 0.0}, "positive numbers"),
        ({"num_training": 1}, "at least 2 steps"),
        ({"num_training": 2.5}, "at least 2 steps"),
        ({"mode": "cosine"}, "exponential"),
        ({"early_stop_threshold": 0.5}, "number above 1"),
        ({"rule": "lightning"}, "per_step"),
    ],
)
def test_bad_options_raise_naming_the_fix(options: dict[str, Any], message: str) -> None:
    with pytest.raises(MisconfigurationError, match=message):
        LRFinder(**options)
    with pytest.raises(MisconfigurationError, match=message):
        find_lr(sweep_trainer(), Regression(), regression_data(), **options)


def test_update_attr_needs_an_attribute_it_can_set() -> None:
    class NoRate(Regression):
        def __init__(self, lr: float = 0.1) -> None:
            super().__init__(lr)
            del self.lr
            self.save_hyperparameters()

    trainer = sweep_trainer()
    with pytest.raises(MisconfigurationError, match=r"hparams\.lr is read-only"):
        find_lr(trainer, NoRate(), regression_data(), update_attr=True)
    with pytest.raises(MisconfigurationError, match=r"module\.rate.*attr_name"):
        find_lr(trainer, Regression(), regression_data(), update_attr=True, attr_name="rate")
    with pytest.raises(MisconfigurationError, match=r"needs a loopbus\.Trainer"):
        find_lr(object(), Regression(), regression_data())  # type: ignore[arg-type]


async def test_not_from_inside_a_stage() -> None:
    errors: list[str] = []

    class Inner(Regression):
        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            if not errors:
                try:
                    find_lr(self.trainer, self, regression_data())  # type: ignore[arg-type]
                except MisconfigurationError as exc:
                    errors.append(str(exc))
            return super().training_step(batch, ctx)

    await Trainer(plugins=[], device="cpu", max_steps=1).fit(Inner(), regression_data())
    assert errors
    assert "runs between stages" in errors[0]


# ------------------------------------------------------------------ distributed
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.external
@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="no torch.distributed")
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_rank_sweeps_alike_and_agrees_on_one_suggestion(
    tmp_path: Path, strategy: str
) -> None:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        f"--master_port={_free_port()}", str(SCRIPT),
        "--out", str(tmp_path), "--strategy", strategy,
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env(tests=True), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    s0, s1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert s0["strategy"] == s1["strategy"] == strategy
    assert s0["suggestion"] is not None
    assert s0["suggestion"] == s1["suggestion"]
    assert s0["lrs"] == s1["lrs"]
    assert s0["losses"] == s1["losses"]
    assert s0["stop_reason"] == s1["stop_reason"]
    assert s0["stop_reason"] is not None
    assert s0["restored"]
    assert s1["restored"]
    assert s0["fit_step"] == s1["fit_step"] > 0
    assert all(math.isfinite(v) for v in s0["losses"][:-1])
