"""A small, deterministic training run with checkpoints, shared by the checkpoint tests.

:func:`run_scenario` trains (in a process of its own), can SIGKILL itself at a chosen
point, and can resume from ``last``; the final weights, optimizer state and the warnings
it saw are written to ``out``. The kill tests fork it from a server process that
imported this module once; ``python -m tests.ckpt_scenario --help`` runs one by
hand.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import warnings
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler, TensorDataset

import loopbus
from loopbus import Module, Plugin, Trainer, on
from loopbus.events import EpochCompleted, TrainBatchCompleted, ValidationCompleted
from loopbus.plugins import Checkpoint

N_TRAIN = 320
N_VAL = 32
BATCH = 8
EPOCHS = 3
EVERY_N_STEPS = 7
VAL_EVERY = 15
SEED = 1234
STATEFUL_WARNING = "'set_vital' is deprecated"


class Net(Module):
    """An MLP with dropout (so the random generators matter), SGD with momentum and a
    per-epoch StepLR (so optimizer and scheduler state matter)."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, hidden),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.2),
            torch.nn.Linear(hidden, 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.put("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, ctx: Any) -> None:
        x, y = batch
        self.put("val/loss", torch.nn.functional.cross_entropy(self(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
        return {"optimizer": opt, "lr_scheduler": sched}


def dataset(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return TensorDataset(x, y)


class PythonAndNumpyShuffle(Sampler[int]):
    """A user's sampler whose order comes from Python's and NumPy's global generators
    (not torch's): a plain loader over it resumes mid-epoch only if those are restored."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        import numpy as np

        order = list(range(self.n))
        random.shuffle(order)
        shift = int(np.random.randint(self.n))
        return iter(order[shift:] + order[:shift])


def make_data(loader: str, n_train: int = N_TRAIN, batch: int = BATCH) -> tuple[Any, Any]:
    """Shuffled training data (a plain DataLoader, one over a sampler that shuffles with
    Python's and NumPy's generators, or torchdata's StatefulDataLoader) and unshuffled
    validation data. Call after seeding: shuffling draws on the global generators."""
    train_set = dataset(n_train, 0)
    val = DataLoader(dataset(N_VAL, 1), batch_size=16)
    if loader == "plain":
        return DataLoader(train_set, batch_size=batch, shuffle=True), val
    if loader == "custom-sampler":
        sampler = PythonAndNumpyShuffle(n_train)
        return DataLoader(train_set, batch_size=batch, sampler=sampler), val
    if loader in ("stateful", "stateful-generator"):
        from torchdata.stateful_dataloader import StatefulDataLoader

        # "stateful-generator": the loader shuffles with a torch.Generator of its own.
        generator = (
            torch.Generator().manual_seed(SEED) if loader == "stateful-generator" else None
        )
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", STATEFUL_WARNING)
            return StatefulDataLoader(
                train_set, batch_size=batch, shuffle=True, generator=generator
            ), val
    raise ValueError(f"unknown loader kind {loader!r}")


class Killer(Plugin):
    """SIGKILLs the process at a chosen point, after every other handler of the event."""

    delivery = loopbus.Delivery(priority=-1000)

    def __init__(self, when: str, at: int) -> None:
        self.when = when
        self.at = at
        self.validations = 0
        self.trainer: Trainer | None = None

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer

    def _die(self) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    @on(TrainBatchCompleted)
    def _batch(self, event: TrainBatchCompleted) -> None:
        if self.when == "step" and event.step == self.at:
            self._die()

    @on(ValidationCompleted)
    def _validation(self, event: ValidationCompleted) -> None:
        self.validations += 1
        if self.when == "val" and self.validations == self.at:
            self._die()

    @on(EpochCompleted)
    def _epoch(self, event: EpochCompleted) -> None:
        if self.when == "epoch" and event.epoch == self.at:
            self._die()


class SaveAtStep(Plugin):
    """Saves a checkpoint when the run reaches ``step``, after the module's own handlers
    of the same event."""

    delivery = loopbus.Delivery(priority=-100)

    def __init__(self, path: Any, step: int) -> None:
        self.path = path
        self.step = step
        self.trainer: Trainer | None = None

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer

    @on(TrainBatchCompleted)
    def _batch(self, event: TrainBatchCompleted) -> None:
        if event.step == self.step and self.trainer is not None:
            self.trainer.save_checkpoint(self.path)


def build(
    dirpath: str, loader: str, *, background: bool = False, plugins: list[Plugin] | None = None
) -> tuple[Trainer, Net, Any, Any]:
    loopbus.seed_everything(SEED)
    module = Net()
    train, val = make_data(loader)
    checkpoint = Checkpoint(
        dirpath,
        every_n_steps=EVERY_N_STEPS,
        every_n_epochs=1,
        monitor="val/loss",
        mode="min",
        keep_last=2,
        keep_best=2,
        background=background,
    )
    trainer = Trainer(
        max_epochs=EPOCHS,
        val_check_interval=VAL_EVERY,
        plugins=[checkpoint, *(plugins or [])],
        device="cpu",
    )
    return trainer, module, train, val


def final_state(trainer: Trainer, module: Net) -> dict[str, Any]:
    return {
        "module": module.state_dict(),
        "optimizer": trainer.optimizers[0].state_dict(),
        "global_step": trainer.global_step,
    }


def run_scenario(
    dirpath: str,
    out: str,
    *,
    loader: str = "plain",
    kill: str = "",
    resume: bool = False,
    background: bool = False,
) -> None:
    """Train (or resume from ``last`` in ``dirpath``) and save the final state to ``out``;
    ``kill`` is ``"step:N"``, ``"val:N"`` or ``"epoch:N"``."""
    torch.set_num_threads(1)
    plugins: list[Plugin] = []
    if kill:
        when, at = kill.split(":")
        plugins.append(Killer(when, int(at)))
    trainer, module, train, val = build(dirpath, loader, background=background, plugins=plugins)
    resumed_mid_epoch = None
    if resume:
        last = loopbus.load_checkpoint(dirpath)
        resumed_mid_epoch = last["loops/fit"]["loops"]["epoch_loop"]["state"]["in_epoch"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loopbus.run(trainer.fit, module, train, val, ckpt_path="last" if resume else None)
    state = final_state(trainer, module)
    state["warnings"] = [str(w.message) for w in caught]
    state["resumed_mid_epoch"] = resumed_mid_epoch
    torch.save(state, out)


def write_then_die(dirpath: str, second: str, die_after: int) -> None:
    """Write ``a.ckpt`` (and the last pointer), then start writing ``second`` and SIGKILL
    this process once ``die_after`` bytes of it are written: a torn write."""
    from loopbus.checkpoint import _write as _checkpoint_io

    torch.set_num_threads(1)
    loopbus.seed_everything(SEED)
    module = Net()
    train, val = make_data("plain")
    trainer = Trainer(max_steps=2, plugins=[], device="cpu")
    loopbus.run(trainer.fit, module, train, val)
    loopbus.write_checkpoint(
        trainer.state_dict(), os.path.join(dirpath, "a.ckpt"), update_last=True
    )
    second_state = trainer.state_dict()
    second_state["loopbus"]["global_step"] += 1000  # make it recognisably different
    real_write = _checkpoint_io._ChecksumWriter.write

    def write(self: Any, data: Any) -> int:
        if self.size + len(data) > die_after:
            self.file.write(bytes(data)[: die_after - self.size])
            self.file.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(self, data)

    _checkpoint_io._ChecksumWriter.write = write  # type: ignore[method-assign]
    loopbus.write_checkpoint(second_state, os.path.join(dirpath, second), update_last=True)


# Warm torch's lazy imports (the first optimizer pulls in torch._dynamo, about a second)
# so that processes forked from one that imported this module start at once.
torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument(
        "--loader", choices=["plain", "stateful", "stateful-generator"], default="plain"
    )
    parser.add_argument("--kill", default="", help="step:N, val:N or epoch:N")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--background", action="store_true")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    run_scenario(
        args.dir,
        args.out,
        loader=args.loader,
        kill=args.kill,
        resume=args.resume,
        background=args.background,
    )


if __name__ == "__main__":
    main()
