"""Resuming with torchdata's StatefulDataLoader is exact across the epoch boundary: the
epochs after the resumed one are shuffled as in an uninterrupted run, whether the loader
has a torch.Generator of its own or draws on torch's global one, with and without
worker processes."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

import loopbus
from loopbus import Module, Plugin, Trainer, on
from loopbus.events import EpochCompleted, TrainBatchCompleted

pytest.importorskip("torchdata.stateful_dataloader")

STATEFUL_WARNING = "'set_vital' is deprecated"
pytestmark = [
    pytest.mark.external,
    pytest.mark.filterwarnings(f"ignore:{STATEFUL_WARNING}:UserWarning"),
]

N_TRAIN = 24
BATCH = 4
PER_EPOCH = N_TRAIN // BATCH  # 6
EPOCHS = 2
SEED = 11
LOADER_SEED = 123


class Tiny(Module):
    """A linear model with dropout; records the sample indices of every batch it trains
    on, so a test can compare the order of the data as well as the weights."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.Linear(4, 2))
        self.seen: list[list[int]] = []

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y, index = batch
        self.seen.append(index.tolist())
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class SaveAt(Plugin):
    """Saves a checkpoint after the n-th training batch of the run, or at the end of an
    epoch; the run goes on to its end. (A run stopped mid-epoch would leave a loader's
    worker processes running until the loader is garbage collected, which can take the
    shutdown's timeout.)"""

    delivery = loopbus.Delivery(priority=-50)

    def __init__(self, path: Path, *, batch: int | None = None, epoch: int | None = None):
        self.path = path
        self.batch = batch
        self.epoch = epoch
        self.seen = 0
        self.saved_at: int | None = None
        self.trainer: Trainer | None = None

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer

    @on(TrainBatchCompleted)
    def _batch(self, event: TrainBatchCompleted) -> None:
        assert self.trainer is not None
        self.seen += 1
        if self.seen == self.batch:
            self.trainer.save_checkpoint(self.path)
            self.saved_at = self.seen

    @on(EpochCompleted)
    def _epoch(self, event: EpochCompleted) -> None:
        assert self.trainer is not None
        if event.epoch == self.epoch:
            self.trainer.save_checkpoint(self.path)
            self.saved_at = self.seen


def build(
    generator: str, num_workers: int, plugins: list[Plugin] | None = None
) -> tuple[Trainer, Tiny, Any]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    loopbus.seed_everything(SEED)
    module = Tiny()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN, 4, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long(), torch.arange(N_TRAIN))
    own = torch.Generator().manual_seed(LOADER_SEED) if generator == "own" else None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", STATEFUL_WARNING)
        loader = StatefulDataLoader(
            data, batch_size=BATCH, shuffle=True, generator=own, num_workers=num_workers
        )
    trainer = Trainer(max_epochs=EPOCHS, plugins=list(plugins or []), device="cpu")
    return trainer, module, loader


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("generator", ["own", "none"])
@pytest.mark.parametrize(
    "point",
    [
        pytest.param({"batch": 3}, id="mid-epoch"),
        pytest.param({"batch": PER_EPOCH}, id="last-batch-of-epoch"),
        pytest.param({"epoch": 0}, id="epoch-end"),
    ],
)
async def test_resume_is_exact_across_the_epoch_boundary(
    tmp_path: Path, generator: str, num_workers: int, point: dict[str, int]
) -> None:
    trainer, module, loader = build(generator, num_workers)
    await trainer.fit(module, loader)
    expected_weights = {k: v.clone() for k, v in module.state_dict().items()}
    expected_order = module.seen
    assert len(expected_order) == EPOCHS * PER_EPOCH
    # The epochs are shuffled differently (a resumed run repeating one would be wrong).
    assert expected_order[:PER_EPOCH] != expected_order[PER_EPOCH : 2 * PER_EPOCH]

    path = tmp_path / "run.ckpt"
    saver = SaveAt(path, **point)
    trainer, module, loader = build(generator, num_workers, [saver])
    await trainer.fit(module, loader)
    assert saver.saved_at is not None
    # Taking the checkpoint does not disturb the run.
    assert module.seen == expected_order
    done = saver.saved_at

    trainer, module, loader = build(generator, num_workers)
    await trainer.fit(module, loader, ckpt_path=path)
    assert trainer.global_step == EPOCHS * PER_EPOCH
    assert module.seen == expected_order[done:], "the resumed run saw another data order"
    for name, tensor in expected_weights.items():
        assert torch.equal(module.state_dict()[name], tensor), f"{name} differs after resume"
