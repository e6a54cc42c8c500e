"""One replica group of a fault-tolerant run (``strategy="ft"``, one process), as the
fault-tolerance tests launch it: a small MLP trained for one epoch or more over a dataset
whose samples carry their ids, SGD with momentum and a per-step LR schedule.

It writes to ``--out``: ``ledger-<group>.jsonl`` (one line per committed step: the step,
the plan's cursor, participants and replica rank, the sample ids it trained, the LR),
``events-<group>.jsonl`` (StepAborted, ReplicaLost, ReplicaHealed), ``kills.jsonl`` and,
at the end, ``final-<group>.pt`` (the weights) and ``summary-<group>.json``.

With ``--ckpt DIR`` the group saves a checkpoint every ``--every`` committed steps into
``DIR/group-<group>`` (each group its own folder); ``--resume`` resumes from the newest
checkpoint there (``fit(ckpt_path="last")``); ``--samples`` trains on the dataset's
first samples only, for ``--epochs`` epochs (one by default).

``--kill AFTER:PHASE`` is the test-only hook: the process SIGKILLs itself in the step
``AFTER`` committed steps past the first step it trains, ``before`` the cross-group
all-reduce (after backward), ``during`` it (once issued) or ``after`` it (the step
committed, before the optimizer step).

Launched by ``torchrun --nproc_per_node=N``, a group is N processes sharding the module
with FSDP2 (HSDP): each process writes ``ledger-<group>.<rank>.jsonl``,
``events-<group>.<rank>.jsonl`` and ``summary-<group>.<rank>.json``, and rank 0 the
whole ``final-<group>.pt``. ``--kill-per-restart SPEC,SPEC,...`` gives torchrun's
incarnations of the group their kills in turn (``$TORCHELASTIC_RESTART_COUNT`` picks;
empty: none), each ``AFTER:PHASE:RANK``, done by that group rank only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import loopbus
from loopbus import Module, Plugin, Trainer, on
from loopbus.distributed import FaultTolerantStrategy
from loopbus.events import (
    AfterBackward,
    BeforeOptimizerStep,
    PutRecord,
    ReplicaHealed,
    ReplicaLost,
    StepAborted,
    TrainBatchCompleted,
)
from loopbus.plugins import Checkpoint

N_SAMPLES = 3200
FEATURES = 6
BATCH = 4
LR = 0.1
DECAY = 0.995
SEED = 0


def dataset(samples: int = N_SAMPLES) -> TensorDataset:
    """The first ``samples`` of the dataset (the same ones whatever the number)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N_SAMPLES, FEATURES, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(N_SAMPLES, 1, generator=g)
    return TensorDataset(x[:samples], y[:samples], torch.arange(samples))


def network() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
    )


def loss_of(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(net(x), y)


def optimizer_of(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def lr_at(step: int) -> float:
    return LR * DECAY**step


class Net(Module):
    def __init__(self, sleep_s: float) -> None:
        super().__init__()
        self.net = network()
        self.sleep_s = sleep_s

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y, _ = batch
        if self.sleep_s:
            time.sleep(self.sleep_s)  # a step long enough for a group to restart meanwhile
        loss = loss_of(self.net, x, y)
        self.put("loss", loss.detach())
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = optimizer_of(self.parameters())
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: DECAY**s)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Killer:
    """When and where this process kills itself (see the module docstring)."""

    def __init__(self, spec: str | None, out: Path, group: str) -> None:
        fields = spec.split(":") if spec else []
        if len(fields) == 3 and int(fields[2]) != int(os.environ.get("RANK", "0")):
            fields = []  # another rank of the group dies
        self.after, self.phase = (int(fields[0]), fields[1]) if fields else (-1, "")
        self.first: int | None = None
        self.out, self.group = out, group

    def due(self, step: int, phase: str) -> bool:
        if self.first is None:
            self.first = step
        return phase == self.phase and step == self.first + self.after

    def kill(self, step: int) -> None:
        with open(self.out / "kills.jsonl", "a") as f:
            entry = {"group": self.group, "phase": self.phase, "step": step, "pid": os.getpid()}
            f.write(json.dumps(entry) + "\n")
        os.kill(os.getpid(), signal.SIGKILL)


class KillingStrategy(FaultTolerantStrategy):
    """The strategy, with the ``during`` kill (the all-reduce issued, then death) and,
    with ``alone_sleep_s``, slower steps while a group trains alone: a restart on a busy
    machine then still finds it training."""

    killer: Killer
    trainer: Trainer
    alone_sleep_s = 0.0

    def average(self, tensor: torch.Tensor) -> None:
        if self.alone_sleep_s and self.manager.num_participants() == 1:
            time.sleep(self.alone_sleep_s)
        step = self.trainer.global_step
        if self.killer.due(step, "during"):
            self.manager.allreduce(tensor)
            time.sleep(0.002)
            self.killer.kill(step)
        super().average(tensor)


class Ledger(Plugin):
    trainer: Trainer

    def __init__(self, out: Path, group: str, killer: Killer) -> None:
        self.out, self.group, self.killer = out, group, killer
        self.records = 0
        self.ledger = open(out / f"ledger-{group}.jsonl", "a")
        self.events = open(out / f"events-{group}.jsonl", "a")

    @on(AfterBackward)
    def _backward(self, event: AfterBackward) -> None:
        if self.killer.due(event.step, "before"):
            self.killer.kill(event.step)

    @on(BeforeOptimizerStep)
    def _committed(self, event: BeforeOptimizerStep) -> None:
        if self.killer.due(event.step, "after"):
            self.killer.kill(event.step)

    @on(PutRecord)
    def _record(self, record: PutRecord) -> None:
        self.records += record.name == "loss"

    @on(TrainBatchCompleted)
    def _step(self, event: TrainBatchCompleted) -> None:
        trainer = self.trainer
        plan = trainer.strategy.last_plan
        entry = {
            "pid": os.getpid(),
            "step": trainer.global_step,
            "epoch": plan.epoch,
            "run_epoch": trainer.current_epoch,
            "cursor": plan.cursor,
            "participants": plan.participants,
            "rank": plan.replica_rank,
            "group_rank": plan.group_rank,
            "group_size": plan.group_size,
            "consumed": plan.consumed,
            "ids": event.ctx.batch[2].tolist(),
            "lr": trainer.optimizers[0].param_groups[0]["lr"],
        }
        self.ledger.write(json.dumps(entry) + "\n")
        self.ledger.flush()

    @on(StepAborted)
    @on(ReplicaLost)
    @on(ReplicaHealed)
    def _event(self, event: Any) -> None:
        fields = {k: getattr(event, k) for k in event.__struct_fields__ if k not in ("ctx", "loop")}
        fields["type"] = type(event).__name__
        fields["pid"] = os.getpid()
        self.events.write(json.dumps(fields, default=list) + "\n")
        self.events.flush()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--group", required=True)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--min-replicas", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--kill", default=None)
    parser.add_argument("--kill-per-restart", default=None)
    parser.add_argument("--sleep-s", type=float, default=0.0)
    parser.add_argument("--alone-sleep-s", type=float, default=0.0)
    parser.add_argument("--ckpt", type=Path, default=None)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--samples", type=int, default=N_SAMPLES)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    kill, rank = args.kill, int(os.environ.get("RANK", "0"))
    if args.kill_per_restart is not None:
        kills = args.kill_per_restart.split(",")
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        kill = (kills[restart] if restart < len(kills) else "") or None
    tag = args.group if int(os.environ.get("WORLD_SIZE", "1")) == 1 else f"{args.group}.{rank}"
    killer = Killer(kill, args.out, args.group)
    strategy = KillingStrategy(
        replica_group=args.group,
        replica_groups=args.groups,
        min_replicas=args.min_replicas,
        timeout_s=10,
        quorum_timeout_s=60,
        seed=SEED,
    )
    strategy.alone_sleep_s = args.alone_sleep_s
    ledger = Ledger(args.out, tag, killer)
    plugins: list[Plugin] = [ledger]
    if args.ckpt is not None:
        folder = args.ckpt / f"group-{args.group}"
        plugins.append(Checkpoint(folder, every_n_steps=args.every))
    trainer = Trainer(
        max_epochs=args.epochs, strategy=strategy, plugins=plugins, enable_model_summary=False
    )
    strategy.killer, strategy.trainer, ledger.trainer = killer, trainer, trainer
    module = Net(args.sleep_s)
    data = DataLoader(dataset(args.samples), batch_size=BATCH, shuffle=True)
    loopbus.run(trainer.fit, module, data, ckpt_path="last" if args.resume else None)
    from torch.distributed.tensor import DTensor

    weights = {  # whole (gathered over the group's processes when sharded)
        k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
        for k, v in module.net.state_dict().items()
    }
    if rank == 0:
        torch.save(weights, args.out / f"final-{args.group}.pt")
    summary = {
        "pid": os.getpid(),
        "step": trainer.global_step,
        "epoch": trainer.current_epoch,
        "lr": trainer.optimizers[0].param_groups[0]["lr"],
        "loss_records": ledger.records,
    }
    (args.out / f"summary-{tag}.json").write_text(json.dumps(summary))
    strategy.close()


if __name__ == "__main__":
    main()
