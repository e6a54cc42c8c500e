from __future__ import annotations

import io
from typing import Any

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import loopbus
from loopbus import MisconfigurationError, Module, Trainer
from loopbus.plugins import MixedPrecision
from tests.helpers import TinyModule, make_loader


def round_trip(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded: dict[str, Any] = torch.load(buffer, weights_only=True)
    return loaded


class AutocastProbe(TinyModule):
    """Records the autocast state its steps ran under."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[str, bool, torch.dtype]] = set()

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        self.seen.add(("train", torch.is_autocast_enabled("cpu"), logits.dtype))
        loss = F.cross_entropy(logits.float(), y)
        self.put("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, ctx: Any) -> None:
        x, _ = batch
        self.seen.add(("val", torch.is_autocast_enabled("cpu"), self(x).dtype))


def test_names_are_registered() -> None:
    assert isinstance(Trainer(precision="16-mixed", device="cpu").precision, MixedPrecision)
    assert Trainer(precision="bf16-mixed", device="cpu").precision.name == "bf16-mixed"
    with pytest.raises(ValueError, match=r"unknown precision 'fp8'.*'16-mixed'.*'bf16-mixed'"):
        Trainer(precision="fp8")
    with pytest.raises(ValueError, match=r"precision=\.\.\.\) must be '16-mixed' or 'bf16-mixed', got '16-true'"):
        MixedPrecision("16-true")  # type: ignore[arg-type]


@pytest.mark.parametrize("executor", ["inline", "thread"])
async def test_fp16_scales_unscales_and_keeps_its_scaler_state(executor: str) -> None:
    # A scale this large overflows fp16 gradients: the scaler must skip and back off.
    precision = MixedPrecision("16-mixed", init_scale=2.0**24)
    module = AutocastProbe()
    trainer = Trainer(
        max_steps=12,
        precision=precision,
        gradient_clip_val=1.0,  # exercises unscale_ before clipping
        executor=executor,  # type: ignore[arg-type]
        device="cpu",
    )
    await trainer.fit(module, make_loader(n=16 * 12), make_loader(n=16))
    assert module.seen == {("train", True, torch.float16), ("val", True, torch.float16)}
    scaler = precision.scaler
    assert isinstance(scaler, torch.amp.GradScaler)
    state = precision.state_dict()
    assert state["precision"] == "16-mixed"
    assert state["scaler"] == scaler.state_dict()
    assert state["scaler"]["scale"] < 2.0**24  # it backed off from the overflow

    restored = MixedPrecision("16-mixed")
    restored.load_state_dict(round_trip(state))
    assert restored.state_dict() == state  # before setup: kept until the scaler exists
    restored.setup(torch.device("cpu"))
    assert restored.scaler is not None
    assert restored.scaler.get_scale() == scaler.get_scale()
    with pytest.raises(ValueError, match=r"saved with precision='16-mixed'.*uses 'bf16-mixed'"):
        MixedPrecision("bf16-mixed").load_state_dict(state)


async def test_fp16_state_loaded_into_a_running_precision() -> None:
    precision = MixedPrecision("16-mixed")
    trainer = Trainer(max_steps=2, precision=precision, device="cpu")
    await trainer.fit(TinyModule(), make_loader(n=32))
    saved = {"precision": "16-mixed", "scaler": {**precision.state_dict()["scaler"], "scale": 8.0}}
    precision.load_state_dict(saved)
    assert precision.scaler is not None
    assert precision.scaler.get_scale() == 8.0


def test_bf16_has_no_scaler() -> None:
    precision = MixedPrecision("bf16-mixed")
    precision.setup(torch.device("cpu"))
    assert precision.scaler is None
    assert precision.state_dict() == {"precision": "bf16-mixed"}


class DigitsNet(Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
        )
        self.dtypes: set[torch.dtype] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        self.dtypes.add(logits.dtype)
        return F.cross_entropy(logits, y)

    def validation_step(self, batch: Any, ctx: Any) -> None:
        x, y = batch
        self.put("val/acc", (self(x).argmax(1) == y).float().mean())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


async def test_bf16_on_cpu_trains_digits_to_95_percent() -> None:
    datasets = pytest.importorskip("sklearn.datasets")
    digits = datasets.load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    split = int(0.8 * len(x))
    loopbus.seed_everything(0)
    train = DataLoader(
        TensorDataset(x[:split], y[:split]),
        batch_size=64,
        shuffle=True,
        generator=torch.Generator().manual_seed(0),
    )
    val = DataLoader(TensorDataset(x[split:], y[split:]), batch_size=len(x) - split)
    module = DigitsNet()
    trainer = Trainer(max_epochs=20, precision="bf16-mixed", plugins=[], device="cpu")
    await trainer.fit(module, train, val)
    assert module.dtypes == {torch.bfloat16}  # the forward ran under bf16 autocast
    assert all(p.dtype == torch.float32 for p in module.parameters())  # weights stay fp32
    accuracy = trainer.latest["val/acc"].value
    assert accuracy >= 0.95, accuracy


def test_autocast_on_a_device_torch_lacks_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.amp, "is_autocast_available", lambda device_type: False)
    with pytest.raises(
        MisconfigurationError, match=r"precision='bf16-mixed' needs torch.autocast on 'cpu'"
    ):
        MixedPrecision("bf16-mixed").setup(torch.device("cpu"))
