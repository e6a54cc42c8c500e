"""A small training run for the preemption tests, run as a process of its own
(``python tests/stage/_preempt_script.py --dir D ...``).

With ``--wait-at epoch:batch`` the training step of that batch writes ``D/ready`` and
waits until the trainer was asked to stop, so that the test's signal lands at a known
batch (mid-epoch, inside an accumulation window). ``--resume`` continues from ``last``.
A run that ends writes ``D/<out>.rank<R>`` with the final weights and optimizer state
(whole tensors, also under FSDP); one that raises ``loopbus.Preempted`` writes
``D/preempted_rank<R>.json`` first and lets it end the process. Under ``torchrun`` (gloo)
every rank runs it: DDP by default, FSDP with ``--strategy fsdp``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import loopbus
from loopbus import Module, Plugin, Trainer, on
from loopbus.events import PreemptionRequested, Teardown, TrainBatchCompleted
from loopbus.plugins import Checkpoint, CSVLogger, JSONLLogger

N_TRAIN = 160
BATCH = 8
EPOCHS = 3
ACCUMULATE = 3
EVERY_N_STEPS = 5


class Net(Module):
    """An MLP with dropout, SGD with momentum: the generators, the optimizer's state and
    the gradients of an open accumulation window all matter for an exact resume."""

    def __init__(self, wait_at: tuple[int, int] | None, ready: Path, hang: bool = False) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2)
        )
        self.wait_at = wait_at
        self.ready = ready
        self.hang = hang

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.put("train/loss", loss)
        trainer = self.trainer
        if self.wait_at == (trainer.current_epoch, ctx.batch_idx) and trainer.is_global_zero:
            self.ready.write_text(str(trainer.global_step))
            # Until the signal asked for a stop (under DDP: pending until the ranks agree).
            state = trainer.state
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (
                state.stop_requested or state.pending_stop is not None
            ):
                time.sleep(0.002)
            if self.hang:  # a step that never ends: only the grace period ends the process
                time.sleep(60)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


class Seen(Plugin):
    """Writes what it saw of the preemption to ``D/events.json`` at the stage's end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seen: list[dict[str, Any]] = []

    @on(PreemptionRequested)
    def _preempted(self, event: PreemptionRequested) -> None:
        self.seen.append(
            {
                "event": "PreemptionRequested",
                "signal": event.signal,
                "step": event.step,
                "epoch": event.epoch,
                "deadline": event.deadline,
                "time": time.time(),
            }
        )

    @on(Teardown)
    def _teardown(self, event: Teardown) -> None:
        self.seen.append(
            {"event": "Teardown", "reason": event.reason, "step": event.step, "time": time.time()}
        )
        self.path.write_text(json.dumps(self.seen))


class KillRank1(Plugin):
    """SIGKILLs rank 1 after step ``at`` of the first attempt of a torchrun job."""

    delivery = loopbus.Delivery(priority=-1000)

    def __init__(self, at: int) -> None:
        self.at = at

    @on(TrainBatchCompleted)
    def _batch(self, event: TrainBatchCompleted) -> None:
        first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first and os.environ.get("RANK") == "1" and event.step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)


def _host_handler(directory: Path) -> Any:
    def handler(signum: int, frame: Any) -> None:
        with (directory / "host-handler").open("a") as f:
            f.write(f"{signal.Signals(signum).name}\n")

    return handler


def _slow_second_signal(ready: Path) -> None:
    """Once the signal's batch has started (``ready``), the checkpoint writer's file fsync
    sends SIGTERM again and waits: the second signal arrives while the checkpoint is
    being written."""
    from loopbus import _durable
    from loopbus.storage import LocalStore

    real = os.fsync
    real_write = LocalStore.publish

    class _Os:
        def __getattr__(self, name: str) -> Any:
            return getattr(os, name)

        @staticmethod
        def fsync(fd: int) -> None:
            real(fd)
            if ready.exists():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(10)

    def write_durably(*args: Any, **kwargs: Any) -> Any:
        # Checkpoint writes only: the loggers write through replace_atomically too.
        vars(_durable)["os"] = _Os()
        try:
            return real_write(*args, **kwargs)
        finally:
            vars(_durable)["os"] = os

    LocalStore.publish = write_durably  # type: ignore[method-assign]


def main(args: argparse.Namespace) -> None:
    directory = Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ.get("RANK", "0"))
    if rank == 0:
        with (directory / "attempts").open("a") as f:
            f.write(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "\n")
    loopbus.seed_everything(1234)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_TRAIN, 4, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    data = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)
    wait_at = None
    if args.wait_at:
        epoch, batch = args.wait_at.split(":")
        wait_at = (int(epoch), int(batch))
    module = Net(wait_at, directory / "ready", hang=args.grace is not None)
    checkpoint = Checkpoint(
        directory / "ckpt",
        every_n_steps=args.every_n_steps,
        keep_last=None,
        sharded=True if args.sharded else None,
    )
    plugins: list[Plugin] = [
        checkpoint,
        CSVLogger(directory / "logs", name="", version=""),
        JSONLLogger(directory / "logs", name="", version=""),
        Seen(directory / f"events_rank{rank}.json"),
    ]
    if args.kill_rank1_at_step is not None:
        plugins.append(KillRank1(args.kill_rank1_at_step))
    options: dict[str, Any] = {}
    if args.exit_code is not None:
        options["preemption_exit_code"] = args.exit_code
    if args.grace is not None:
        options["preemption_grace_s"] = args.grace
    if args.stop_check_interval is not None:
        options["stop_check_interval_s"] = args.stop_check_interval
    if args.strategy is not None:
        options["strategy"] = args.strategy
    trainer = Trainer(
        max_epochs=EPOCHS,
        accumulate_grad_batches=args.accumulate,
        plugins=plugins,
        executor=args.executor,
        num_sanity_val_steps=0,
        enable_model_summary=False,
        device="cpu",
        **options,
    )
    handler = None
    if args.host_handler:
        handler = _host_handler(directory)
        signal.signal(signal.SIGTERM, handler)
    if args.second_during_save:
        _slow_second_signal(directory / "ready")
    try:
        resume = "last" if args.resume else None
        loopbus.run(trainer.fit, module, data, ckpt_path=resume, backend=args.backend)
    except loopbus.Preempted as exc:
        restored = signal.getsignal(signal.SIGTERM)
        (directory / f"preempted_rank{rank}.json").write_text(
            json.dumps(
                {
                    "code": exc.code,
                    "signal": exc.signal,
                    "step": exc.step,
                    "global_step": trainer.global_step,
                    "handler_restored": restored is handler
                    if handler is not None
                    else restored == signal.SIG_DFL,
                    "last": str(checkpoint.last_checkpoint_path),
                }
            )
        )
        raise
    torch.save(
        _whole(
            {
                "global_step": trainer.global_step,
                "module": module.state_dict(),
                "optimizer": trainer.optimizers[0].state_dict(),
            }
        ),
        directory / f"{args.out}.rank{rank}",
    )


def _whole(value: Any) -> Any:
    """``value`` with every DTensor (FSDP's shards) gathered into a whole tensor; every
    rank calls it."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: _whole(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_whole(v) for v in value]
    return value


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument("--executor", default="inline", choices=["inline", "thread"])
    parser.add_argument("--wait-at", default="")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", default="final.pt")
    parser.add_argument("--exit-code", type=int, default=None)
    parser.add_argument("--grace", type=float, default=None)
    parser.add_argument("--kill-rank1-at-step", type=int, default=None)
    parser.add_argument("--host-handler", action="store_true")
    parser.add_argument("--second-during-save", action="store_true")
    parser.add_argument("--sharded", action="store_true", help="sharded (DCP) checkpoints")
    parser.add_argument("--strategy", default=None, choices=["ddp", "fsdp"])
    parser.add_argument("--accumulate", type=int, default=ACCUMULATE)
    parser.add_argument("--every-n-steps", type=int, default=EVERY_N_STEPS)
    parser.add_argument("--stop-check-interval", type=float, default=None)
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse(sys.argv[1:]))
