"""Resuming between epochs after an epoch that ended before its loader ran out
(``limit_train_batches``, ``max_steps``): the next epoch starts from its beginning, with
a plain loader and with a stateful one (whose own state is then partway through the
cut epoch), with batches fetched inline or ahead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from loopbus import Plugin, Trainer, on
from loopbus.checkpoint._parts import LoopPart
from loopbus.events import TrainBatchStarted
from loopbus.loop import FitLoop
from tests.ckpt_scenario import N_TRAIN, SEED, Net, make_data

pytestmark = pytest.mark.anyio

LOADERS = ["plain", "stateful", "stateful-generator"]


class Batches(Plugin):
    """Notes (epoch, the first feature of every sample) for every batch trained."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, tuple[float, ...]]] = []

    @on(TrainBatchStarted)
    def note(self, event: TrainBatchStarted) -> None:
        x = event.ctx.batch[0]
        self.seen.append((event.epoch, tuple(x[:, 0].tolist())))


async def train(
    loader: str, ckpt: Path | None = None, save: Path | None = None, **options: Any
) -> tuple[Net, list[tuple[int, tuple[float, ...]]], Trainer]:
    torch.manual_seed(SEED)
    module = Net()
    train_data, val = make_data(loader)
    batches = Batches()
    trainer = Trainer(
        plugins=[batches], enable_model_summary=False, num_sanity_val_steps=0, **options
    )
    await trainer.fit(module, train_data, val, ckpt_path=ckpt)
    if save is not None:
        await trainer.save_checkpoint_async(save)
    return module, batches.seen, trainer


def same_weights(a: Net, b: Net) -> bool:
    return all(
        torch.equal(x, y)
        for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("loader", LOADERS)
async def test_limited_epochs_resume_exactly(loader: str, prefetch: int, tmp_path: Path) -> None:
    options = {"limit_train_batches": 10, "prefetch": prefetch}
    full, seen_full, _ = await train(loader, max_epochs=3, **options)
    path = tmp_path / "two.ckpt"
    await train(loader, save=path, max_epochs=2, **options)
    resumed, seen_resumed, _ = await train(loader, ckpt=path, max_epochs=3, **options)
    assert seen_resumed == seen_full[20:]
    assert same_weights(resumed, full)


@pytest.mark.parametrize("loader", LOADERS)
async def test_after_max_steps_mid_epoch_the_next_epoch_is_whole(
    loader: str, tmp_path: Path
) -> None:
    per_epoch = N_TRAIN // 8
    path = tmp_path / "cut.ckpt"
    _, seen_cut, _ = await train(loader, save=path, max_steps=per_epoch + 7, max_epochs=10)
    assert [epoch for epoch, _ in seen_cut[per_epoch:]] == [1] * 7
    _, seen, trainer = await train(loader, ckpt=path, max_steps=3 * per_epoch, max_epochs=10)
    # The cut epoch counted; the next one trains on every batch of the data, not on the
    # cut epoch's leftovers.
    epochs = [epoch for epoch, _ in seen]
    assert epochs[:per_epoch] == [2] * per_epoch
    assert trainer.global_step == 3 * per_epoch
    samples = [value for _, batch in seen[:per_epoch] for value in batch]
    assert len(samples) == N_TRAIN
    assert set(samples) == {float(v) for v in make_data(loader)[0].dataset.tensors[0][:, 0]}


def test_a_loop_tree_reads_whether_its_saved_state_was_inside_an_epoch() -> None:
    # What the sharded load asks before resharding: the loops read their own state.
    fit = FitLoop()
    part = LoopPart(fit)
    saved = fit.state_dict()  # a loop that has not started: between epochs
    assert part.saved_inside_epoch(saved) is False
    saved["loops"]["epoch_loop"]["state"]["in_epoch"] = True
    assert part.saved_inside_epoch(saved) is True
    del saved["loops"]["epoch_loop"]["state"]["in_epoch"]  # read as loading reads it
    assert part.saved_inside_epoch(saved) is True
    assert part.saved_inside_epoch({"loops": []}) is False  # a state of another shape
    assert part.saved_inside_epoch(None) is False
