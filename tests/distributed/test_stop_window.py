"""A stop asked inside a gradient-accumulation window. In one process a checkpoint holds
the window's gradients, so the stop takes effect at the next batch; under DDP and FSDP
(``Strategy.saves_window_gradients`` is False) it cannot, and the stop waits for the
window's end, so that the checkpoint a preemption saves there resumes exactly. Either
way the preemption checkpoint never replaces the one saved at the window's start.

``Unsaved`` is one process that declares what DDP and FSDP declare; the real thing under
``torchrun`` is in ``tests/distributed/test_preemption.py``."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from loopbus import DDPStrategy, FSDPStrategy, Plugin, Preempted, SingleProcess, Trainer, on
from loopbus.events import FitCompleted, PreemptionRequested, TrainBatchCompleted
from loopbus.plugins import Checkpoint
from tests.helpers import TinyModule, make_loader

ACCUMULATE = 4
#: 16 batches an epoch: windows 0-3, 4-7, 8-11, 12-15 (an optimizer step at 3, 7, ...).
N, BATCH = 64, 4
#: The second micro-batch of the second window: the stop is asked after it.
ASK_AT = 5


class Unsaved(SingleProcess):
    """One process whose checkpoints, as under DDP and FSDP, cannot hold the gradients
    of an unfinished accumulation window."""

    saves_window_gradients = False


class AskToStop(Plugin):
    """After batch ``at`` of the first epoch, asks to stop (``trainer.request_stop``) or
    sends ``signal`` to this process; records the batches trained and the stop events."""

    def __init__(self, at: int, signal: int | None = None) -> None:
        self.at = at
        self.signal = signal
        self.batches: list[tuple[int, int]] = []
        self.events: list[Any] = []

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer

    @on(TrainBatchCompleted)
    def _batch(self, event: TrainBatchCompleted) -> None:
        self.batches.append((event.batch_idx, event.step))
        if event.epoch == 0 and event.batch_idx == self.at:
            if self.signal is None:
                self.trainer.request_stop("asked mid-window")
            else:
                os.kill(os.getpid(), self.signal)

    @on(PreemptionRequested)
    def _preempted(self, event: PreemptionRequested) -> None:
        self.events.append(event)

    @on(FitCompleted)
    def _completed(self, event: FitCompleted) -> None:
        self.events.append(event)


def fit(strategy: Any, plugins: list[Plugin]) -> tuple[Trainer, TinyModule]:
    torch.manual_seed(7)
    module = TinyModule()
    trainer = Trainer(
        max_epochs=2,
        accumulate_grad_batches=ACCUMULATE,
        strategy=strategy,
        plugins=plugins,
        device="cpu",
        enable_model_summary=False,
    )
    return trainer, module


def test_what_the_strategies_declare() -> None:
    assert SingleProcess.saves_window_gradients
    assert not DDPStrategy.saves_window_gradients
    assert not FSDPStrategy.saves_window_gradients


@pytest.mark.parametrize(
    ("strategy", "last_batch", "step"),
    [(SingleProcess(), ASK_AT, 1), (Unsaved(), 7, 2)],
    ids=["window-saved", "window-unsaved"],
)
async def test_a_stop_inside_a_window_waits_for_its_end_only_where_it_cannot_be_saved(
    strategy: Any, last_batch: int, step: int
) -> None:
    ask = AskToStop(ASK_AT)
    trainer, module = fit(strategy, [ask])
    await trainer.fit(module, make_loader(N, BATCH))
    assert ask.batches[-1] == (last_batch, step)
    assert trainer.global_step == step
    (completed,) = ask.events
    assert (completed.stopped, completed.reason) == (True, "asked mid-window")


async def test_a_stop_at_a_window_end_or_when_the_epoch_ends_takes_effect_there() -> None:
    # Asked after the last micro-batch of a window: no batch more. Asked inside the
    # epoch's last window, which the data ends early (10 batches: windows 0-3, 4-7, 8-9):
    # the window ends with the data.
    ask = AskToStop(7)
    trainer, module = fit(Unsaved(), [ask])
    await trainer.fit(module, make_loader(N, BATCH))
    assert ask.batches[-1] == (7, 2)
    ask = AskToStop(8)
    trainer, module = fit(Unsaved(), [ask])
    await trainer.fit(module, make_loader(40, BATCH))
    assert ask.batches[-1] == (9, 3)
    assert trainer.current_epoch == 0


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.ckpt"))


def _progress(path: Path) -> tuple[int, int, bool]:
    """A checkpoint's step, the batches of its epoch trained, and whether it holds
    gradients of an unfinished window."""
    state = loopbus.load_checkpoint(path)
    epoch_loop = state["loops/fit"]["loops"]["epoch_loop"]
    grads = any(isinstance(g, torch.Tensor) for g in state["grads"].values())
    return state["run"]["step"], epoch_loop["progress"]["current"]["completed"], grads


async def test_a_preemption_inside_a_window_keeps_the_checkpoint_of_the_window_start(
    tmp_path: Path,
) -> None:
    # One process: the stop is taken inside the window, at step 1 like the periodic save
    # at the window's start; it holds the window's gradients and is named apart.
    ask = AskToStop(ASK_AT, signal=signal.SIGTERM)
    checkpoint = Checkpoint(tmp_path, every_n_steps=1, keep_last=None)
    trainer, module = fit(SingleProcess(), [checkpoint, ask])
    with pytest.raises(Preempted, match="SIGTERM"):
        await trainer.fit(module, make_loader(N, BATCH))
    assert _names(tmp_path) == [
        "epoch=0-step=1-v1.ckpt",
        "epoch=0-step=1.ckpt",
    ]
    assert _progress(tmp_path / "epoch=0-step=1.ckpt") == (1, 4, False)  # the window start
    assert _progress(tmp_path / "epoch=0-step=1-v1.ckpt") == (1, 6, True)  # inside it
    assert loopbus.latest_checkpoint(tmp_path) == tmp_path / "epoch=0-step=1-v1.ckpt"


# A plain loader: the resumed epoch skips its consumed batches by iterating.
@pytest.mark.filterwarnings("ignore:resuming mid-epoch by skipping")
async def test_a_preemption_where_the_window_cannot_be_saved_finishes_it_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    reference, module = fit(Unsaved(), [])
    await reference.fit(module, make_loader(N, BATCH))
    expected = module.state_dict()

    ask = AskToStop(ASK_AT, signal=signal.SIGTERM)
    checkpoint = Checkpoint(tmp_path, every_n_steps=1, keep_last=None)
    trainer, module = fit(Unsaved(), [checkpoint, ask])
    with pytest.raises(Preempted, match="SIGTERM") as preempted:
        await trainer.fit(module, make_loader(N, BATCH))
    assert preempted.value.step == 2
    assert ask.batches[-1] == (7, 2)  # the window's remaining micro-batches ran
    requested, completed = ask.events
    assert requested.step == 2
    assert (completed.stopped, completed.reason) == (True, "preempted (SIGTERM)")
    # The periodic save at the window's end is the preemption's: nothing more is saved.
    assert _names(tmp_path) == [
        "epoch=0-step=1.ckpt",
        "epoch=0-step=2.ckpt",
    ]
    assert _progress(tmp_path / "epoch=0-step=1.ckpt") == (1, 4, False)
    assert _progress(tmp_path / "epoch=0-step=2.ckpt") == (2, 8, False)
    assert loopbus.latest_checkpoint(tmp_path) == tmp_path / "epoch=0-step=2.ckpt"

    resumed, module = fit(Unsaved(), [Checkpoint(tmp_path, every_n_steps=1, keep_last=None)])
    await resumed.fit(module, make_loader(N, BATCH), ckpt_path="last")
    assert resumed.global_step == reference.global_step == 8
    for name, tensor in expected.items():
        assert torch.equal(module.state_dict()[name], tensor), name
