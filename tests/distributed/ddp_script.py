"""A small training script that runs unchanged in one process (``python``) or under
``torchrun`` (DDP, or FSDP with ``--strategy fsdp``): the distributed tests launch it. It trains an MLP with dropout on a
synthetic separable task and writes, per rank, the final weights and a summary to
``--out``; with ``--csv``/``--ckpt`` it logs and checkpoints there.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torchmetrics
from torch.utils.data import DataLoader, TensorDataset

import loopbus
from loopbus import Module, Plugin, Trainer, on
from loopbus.events import FitStarted, TrainBatchCompleted, ValidationCompleted
from loopbus.plugins import Checkpoint, CSVLogger

N_TRAIN = 512
N_VAL = 256
FEATURES = 8


class Net(Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, 32),
            torch.nn.ReLU(),
            torch.nn.Dropout(0.1),
            torch.nn.Linear(32, 2),
        )
        self.correct = 0
        self.seen = 0
        # (rank, step): ask to stop inside the training step there (before backward).
        self.stop_in_step: tuple[int, int] | None = None
        self.record: Path | None = None
        # Synchronised over the ranks by compute() (torchmetrics' sync_on_compute=True).
        self.val_seen = torchmetrics.SumMetric()
        self.val_acc = torchmetrics.MeanMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch[0], batch[1]
        # Read the trainer only when asked to: a compiled step would see the step
        # number as a constant that changes every step.
        if self.record is not None:  # the sample indices of the batch (see --record)
            trainer = self.trainer
            entry = {"epoch": trainer.current_epoch, "step": trainer.global_step}
            with open(self.record, "a") as file:
                file.write(json.dumps({**entry, "idx": batch[2].tolist()}) + "\n")
        if self.stop_in_step is not None:
            trainer = self.trainer
            if self.stop_in_step == (trainer.global_rank, trainer.global_step):
                trainer.request_stop(
                    f"rank {trainer.global_rank} asked at step {trainer.global_step}"
                )
        loss = torch.nn.functional.cross_entropy(self(x), y)
        self.put("train/loss", loss)
        return loss

    def validation_step(self, batch: Any, ctx: Any) -> None:
        x, y = batch[0], batch[1]
        hits = self(x).argmax(1) == y
        self.correct += int(hits.sum())
        self.seen += len(y)
        self.val_seen.update(len(y))
        self.val_acc.update(hits.float())

    @on(ValidationCompleted)
    def _val_metrics(self, event: ValidationCompleted) -> None:
        # On every rank: compute() is a collective under DDP.
        self.put("val/seen", self.val_seen.compute())
        self.put("val/acc", self.val_acc.compute())
        self.val_seen.reset()
        self.val_acc.reset()

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class ManualNet(Net):
    """The same model stepped by hand (manual optimization)."""

    automatic_optimization = False

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        opt = self.optimizers()
        loss = super().training_step(batch, ctx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss.detach()


def data(n: int, seed: int, indexed: bool = False) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, FEATURES, generator=g)
    w = torch.arange(1, FEATURES + 1, dtype=torch.float32)
    y = (x @ w > 0).long()
    return TensorDataset(x, y, torch.arange(n)) if indexed else TensorDataset(x, y)


def full_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The module's full state dict and the optimizer's full ``state_dict()`` (keyed by
    position, as torch.optim saves it), on every rank; under FSDP gathered from the
    shards (a collective: every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.tensor import DTensor

    if not any(isinstance(p, DTensor) for p in module.parameters()):
        return {"module": module.state_dict(), "optimizer": optimizer.state_dict()}
    options = StateDictOptions(full_state_dict=True)
    weights, optim = get_state_dict(module, optimizer, options=options)
    names = [n for group in optim["param_groups"] for n in group["params"]]
    position = {n: i for i, n in enumerate(names)}
    groups = [dict(g, params=[position[n] for n in g["params"]]) for g in optim["param_groups"]]
    state = {position[n]: v for n, v in optim["state"].items()}
    return {"module": weights, "optimizer": {"state": state, "param_groups": groups}}


class Loaded(Plugin):
    """Writes, when fit starts (after a resume loaded its checkpoint), the step and the
    module's and optimizer's state as loaded."""

    def __init__(self, out: Path, rank: int) -> None:
        self.out = out
        self.rank = rank

    def setup(self, trainer: Trainer, stage: str) -> None:
        self._trainer = trainer

    @on(FitStarted)
    def _dump(self, event: FitStarted) -> None:
        trainer = self._trainer
        full = full_state(trainer.module, trainer.optimizers[0])
        state = {
            "step": trainer.global_step,
            "module": full["module"],
            "optimizer": full["optimizer"]["state"],
        }
        torch.save(state, self.out / f"loaded_rank{self.rank}.pt")


def _kill_inside_the_writer(step: int) -> None:
    """SIGKILL rank 1 (torchrun then stops the others) while it writes its shards of the
    sharded checkpoint of ``step``: in DCP's writer, in the background thread of an
    asynchronous save."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    original = FileSystemWriter.write_data

    def write_data(self: Any, plan: Any, planner: Any) -> Any:
        if f"step={step}." in str(self.path) and int(os.environ.get("RANK", "0")) == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, plan, planner)

    FileSystemWriter.write_data = write_data  # type: ignore[method-assign]


def _kill_inside_the_upload(step: int) -> None:
    """SIGKILL rank 0 (torchrun then stops the others) as it starts uploading the
    checkpoint file of ``step`` to the store, in the background save's worker."""
    from loopbus.storage import Store

    original = Store.upload

    def upload(self: Any, local: Any, name: str) -> None:
        if f"step={step}." in name:
            os.kill(os.getpid(), signal.SIGKILL)
        original(self, local, name)

    Store.upload = upload  # type: ignore[method-assign]


class Trouble(Plugin):
    """Asks to stop, raises or hangs on one rank at one step; SIGKILLs every rank at one
    step."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args

    @on(TrainBatchCompleted)
    def _check(self, event: TrainBatchCompleted) -> None:
        args, trainer = self.args, self._trainer
        step, rank = trainer.global_step, trainer.global_rank
        if args.stop_in == "handler" and args.stop_at == step and args.stop_rank == rank:
            trainer.request_stop(f"rank {rank} asked at step {step}")
        if args.raise_at == step and args.raise_rank == rank:
            raise RuntimeError(f"boom on rank {rank} at step {step}")
        if args.hang_at == step and args.hang_rank == rank:
            print(f"rank {rank} hangs at step {step}", flush=True)
            time.sleep(3600)  # stuck, not dead: the others wait in their next collective
        if args.kill_at == step:
            # Every rank dies here (torchrun puts its workers in sessions of their own).
            os.kill(os.getpid(), signal.SIGKILL)

    @on(ValidationCompleted)
    def _validated(self, event: ValidationCompleted) -> None:
        args, trainer = self.args, self._trainer
        step, rank = trainer.global_step, trainer.global_rank
        if args.stop_in == "validation" and args.stop_at == step and args.stop_rank == rank:
            trainer.request_stop(f"rank {rank} asked at step {step}")

    def setup(self, trainer: Trainer, stage: str) -> None:
        self._trainer = trainer


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--csv", action="store_true")
    parser.add_argument("--ckpt", type=int, default=0, help="checkpoint every N steps")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--manual", action="store_true", help="manual optimization")
    parser.add_argument("--strategy", default="auto", choices=["auto", "ddp", "fsdp", "single"])
    parser.add_argument("--stop-rank", type=int, default=-1)
    parser.add_argument("--stop-at", type=int, default=-1)
    parser.add_argument("--stop-in", choices=["handler", "step", "validation"], default="handler")
    parser.add_argument("--raise-rank", type=int, default=-1)
    parser.add_argument("--raise-at", type=int, default=-1)
    parser.add_argument("--kill-at", type=int, default=-1)
    parser.add_argument("--hang-rank", type=int, default=-1)
    parser.add_argument("--hang-at", type=int, default=-1)
    parser.add_argument("--timeout", type=float, default=60, help="process_group_timeout_s")
    parser.add_argument(
        "--stop-check-interval", type=float, default=0.05, help="stop_check_interval_s"
    )
    parser.add_argument(
        "--loader", choices=["plain", "stateful"], default="plain", help="training loader"
    )
    parser.add_argument("--compile", default="", help="compile the steps with this backend")
    parser.add_argument("--compile-target", default="", help="compile this target only")
    parser.add_argument("--sharded", action="store_true", help="sharded checkpoints (DCP)")
    parser.add_argument("--sync-save", action="store_true", help="no asynchronous save")
    parser.add_argument("--kill-in-save", type=int, default=-1, help="SIGKILL in that save")
    parser.add_argument("--kill-in-upload", type=int, default=-1, help="SIGKILL in that upload")
    parser.add_argument("--record", action="store_true", help="record the trained samples")
    parser.add_argument("--keep-last", type=int, default=1)
    parser.add_argument("--ckpt-url", default="", help="checkpoints to this URL")
    parser.add_argument("--storage-options", default="{}", help="their fsspec options (JSON)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    loopbus.seed_everything(0)
    module = ManualNet() if args.manual else Net()
    rank = int(os.environ.get("RANK", "0"))
    if args.record:
        module.record = out / f"samples_rank{rank}.jsonl"
    if args.kill_in_save >= 0:
        _kill_inside_the_writer(args.kill_in_save)
    if args.kill_in_upload >= 0:
        _kill_inside_the_upload(args.kill_in_upload)
    if args.stop_in == "step" and args.stop_rank >= 0:
        module.stop_in_step = (args.stop_rank, args.stop_at)
    if args.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "'set_vital' is deprecated")
            train: Any = StatefulDataLoader(data(N_TRAIN, 0), batch_size=args.batch, shuffle=True)
    else:
        train = DataLoader(data(N_TRAIN, 0, args.record), batch_size=args.batch, shuffle=True)
    val = DataLoader(data(N_VAL, 1), batch_size=128)
    # Directories named after the rank the process starts as (shared ones work too):
    # the tests check that only rank 0's appear.
    plugins: list[Plugin] = [Trouble(args), Loaded(out, rank)]
    if args.csv:
        plugins.append(CSVLogger(out / f"logs_rank{rank}", name="", version=""))
    if args.ckpt and args.sharded:
        # One directory that every rank writes its shards into.
        plugins.append(
            Checkpoint(
                args.ckpt_url or out / "ckpt_sharded",
                storage_options=json.loads(args.storage_options) if args.ckpt_url else None,
                every_n_steps=args.ckpt,
                keep_last=args.keep_last,
                sharded=True,
                background=not args.sync_save,
            )
        )
    elif args.ckpt and args.ckpt_url:  # checkpoint files, uploaded by rank 0
        options = json.loads(args.storage_options)
        plugins.append(
            Checkpoint(
                args.ckpt_url,
                storage_options=options,
                every_n_steps=args.ckpt,
                keep_last=args.keep_last,
            )
        )
    elif args.ckpt:
        plugins.append(Checkpoint(out / f"ckpt_rank{rank}", every_n_steps=args.ckpt, keep_last=1))
    trainer = Trainer(
        max_epochs=args.epochs,
        accumulate_grad_batches=args.accumulate,
        # Validation inside the epoch too when a validation handler is to stop the run.
        val_check_interval=5 if args.stop_in == "validation" else None,
        plugins=plugins,
        process_group_timeout_s=args.timeout,
        stop_check_interval_s=args.stop_check_interval,
        strategy=args.strategy,
        compile=(
            False
            if not args.compile
            else {"backend": args.compile, "target": args.compile_target}
            if args.compile_target
            else {"backend": args.compile}
        ),
    )
    loopbus.run(trainer.fit, module, train, val, ckpt_path="last" if args.resume else None)
    stop_reason, step = trainer.stop_reason, trainer.global_step
    module.correct = module.seen = 0
    loopbus.run(trainer.validate, module, val)
    assert rank == trainer.global_rank
    full = full_state(module, trainer.optimizers[0])
    torch.save(full["module"], out / f"weights_rank{rank}.pt")
    torch.save(full["optimizer"], out / f"optimizer_rank{rank}.pt")
    summary = {
        "rank": rank,
        "world_size": trainer.world_size,
        "strategy": trainer.strategy.name,
        "device": str(trainer.device),
        "backend": torch.distributed.get_backend() if torch.distributed.is_initialized() else None,
        "step": step,
        "epoch": trainer.current_epoch,
        "stop_reason": stop_reason,
        "accuracy": module.correct / max(module.seen, 1),
        "val_seen": trainer.latest["val/seen"].value,
        "val_acc": trainer.latest["val/acc"].value,
    }
    (out / f"summary_rank{rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
