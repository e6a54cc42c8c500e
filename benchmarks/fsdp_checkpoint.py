"""How long a checkpoint save holds up the training step on 2 ranks, by kind of save:
sharded and asynchronous (``dcp.async_save``), sharded and synchronous (``dcp.save``),
and a rank-0 full file (the format before sharded checkpoints), for a model whose state
is over 100 MB.

Work: an MLP of four 2304-wide layers (15.9 M parameters: 61 MiB of weights and as much
of SGD momentum), batch 32 a rank, one torch thread a rank, DDP over gloo, a save every
``--every`` steps. Around the ``Checkpoint`` handler (inline at ``TrainBatchCompleted``)
a stopwatch plugin on every rank first waits until the previous save is complete (so a
save is measured alone), then times a hand-written host copy of the same state
(``copy.deepcopy`` of the module's and the optimizer's state dicts: the least an
asynchronous save must do on the step), then times the handler: how long the step is
held up. The figures are rank 0's medians over the saves, all kinds in one run.

The same model then runs under FSDP (``strategy="fsdp"``: each rank holds half of the
weights and momentum): the Checkpoint plugin's sharded saves (asynchronous, synchronous),
and a full file written by rank 0 from the state dict gathered by hand
(``get_state_dict(..., full_state_dict=True, cpu_offload=True)``, the only full file an
FSDP run can write). Under FSDP the host copy is of this rank's shards.

    ./dev bench fsdp_checkpoint                # launches itself under torchrun
    ./dev bench fsdp_checkpoint --saves 12 --width 2048
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio
import torch
import torch.distributed as dist
from _harness import launch_env, torchrun
from torch.utils.data import DataLoader, TensorDataset

import loopbus
from loopbus import Module, Plugin, Trainer, on
from loopbus.events import TrainBatchCompleted
from loopbus.plugins import Checkpoint

torch.set_num_threads(1)

KINDS: dict[str, tuple[str, dict[str, bool] | None]] = {
    "sharded, async (dcp.async_save)": ("ddp", {"sharded": True, "background": True}),
    "sharded, sync (dcp.save)": ("ddp", {"sharded": True, "background": False}),
    "rank-0 full file, sync": ("ddp", {"sharded": False, "background": False}),
    "rank-0 full file, background": ("ddp", {"sharded": False, "background": True}),
    # The model itself sharded: the Checkpoint plugin's saves, and a full file that rank 0
    # writes from the state dict gathered by hand (the usual FSDP recipe).
    "FSDP sharded, async (dcp.async_save)": ("fsdp", {"background": True}),
    "FSDP sharded, sync (dcp.save)": ("fsdp", {"background": False}),
    "FSDP rank-0 full file (gathered)": ("fsdp", None),
}


class Wide(Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 10),
        )

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class FullFile(Plugin):
    """Every ``every`` steps: the full state dict gathered to rank 0
    (``get_state_dict(full_state_dict=True, cpu_offload=True)``), which writes it to one
    file (``torch.save``, fsync, rename); every rank waits for it. At Checkpoint's
    priority."""

    def __init__(self, directory: Path, every: int) -> None:
        self.directory = directory
        self.every = every
        self.trainer: Trainer | None = None

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer

    @on(TrainBatchCompleted, priority=-100)
    def save(self, event: TrainBatchCompleted) -> None:
        if event.step % self.every:
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        trainer = self.trainer
        assert trainer is not None
        assert trainer.module is not None
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model, optim = get_state_dict(trainer.module, trainer.optimizers, options=options)
        if dist.get_rank() == 0:
            temp = self.directory / ".full.tmp"
            with open(temp, "wb") as file:
                torch.save({"module": model, "optim": optim}, file)
                file.flush()
                os.fsync(file.fileno())
            for old in self.directory.glob("step=*.pt"):
                old.unlink()  # one kept, as keep_last=1
            os.replace(temp, self.directory / f"step={event.step}.pt")
        dist.barrier()


class Stopwatch(Plugin):
    """Checkpoint's handler has priority -100: ``before`` runs just ahead of it, ``after``
    just behind it."""

    def __init__(self, directory: Path, every: int, settle: bool = True) -> None:
        self.directory = directory
        self.every = every
        self.settle = settle
        self.blocked: list[float] = []
        self.host_copy: list[float] = []
        self.previous: Path | None = None
        self.t0 = 0.0
        self.trainer: Trainer | None = None

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer

    def _settled(self) -> bool:
        if self.previous is None or not self.settle:
            return True
        return loopbus.latest_checkpoint(self.directory) == self.previous and not any(
            p.name.startswith(".") for p in self.directory.iterdir()
        )

    @on(TrainBatchCompleted, priority=-99)
    async def before(self, event: TrainBatchCompleted) -> None:
        if event.step % self.every:
            return
        while not self._settled():  # noqa: ASYNC110 - polling files: there is no event
            await anyio.sleep(0.002)
        trainer = self.trainer
        assert trainer is not None
        assert trainer.module is not None
        trainer.strategy.barrier()  # every rank starts the save together
        module, optimizer = trainer.module, trainer.optimizers[0]
        for _ in range(2):  # the first warms the allocator, as earlier saves did
            start = time.perf_counter()
            copy.deepcopy(module.state_dict())
            copy.deepcopy(optimizer.state_dict())
            elapsed = time.perf_counter() - start
        self.host_copy.append(elapsed)
        trainer.strategy.barrier()
        self.t0 = time.perf_counter()

    @on(TrainBatchCompleted, priority=-101)
    async def after(self, event: TrainBatchCompleted) -> None:
        if event.step % self.every:
            return
        self.blocked.append(time.perf_counter() - self.t0)
        self.previous = self.directory / f"epoch={event.epoch}-step={event.step}.ckpt"


def measure(
    strategy: str, kind: dict[str, bool] | None, width: int, saves: int, every: int
) -> dict[str, float]:
    torch.manual_seed(0)
    steps = every * saves
    x = torch.randn(32 * steps * dist.get_world_size(), 32)
    y = torch.randint(0, 10, (len(x),))
    data = DataLoader(TensorDataset(x, y), batch_size=32)
    shared = [tempfile.mkdtemp(prefix="loopbus-bench-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared)
    directory = Path(str(shared[0]))
    watch = Stopwatch(directory, every, settle=kind is not None)
    saver: Plugin = (
        FullFile(directory, every)
        if kind is None
        else Checkpoint(directory, every_n_steps=every, keep_last=1, save_on_end=False, **kind)
    )
    trainer = Trainer(max_epochs=1, plugins=[saver, watch], device="cpu", strategy=strategy)
    loopbus.run(trainer.fit, Wide(width), data)
    if dist.get_rank() == 0 and kind is not None:
        last = loopbus.latest_checkpoint(directory)
        assert last is not None
        info = loopbus.checkpoint_info(last)  # the completeness marker: the save is complete
        assert info is not None
        assert info["global_step"] == steps, info
    dist.barrier()
    ratios = [b / h for b, h in zip(watch.blocked, watch.host_copy, strict=True)]
    return {
        "blocked_ms": statistics.median(watch.blocked) * 1e3,
        "host_copy_ms": statistics.median(watch.host_copy) * 1e3,
        "ratio": statistics.median(ratios),
        "saves": len(ratios),
    }


def worker(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")  # the trainers' DDP strategy joins this one
    results = {
        name: measure(strategy, kind, args.width, args.saves, args.every)
        for name, (strategy, kind) in KINDS.items()
    }
    if dist.get_rank() == 0:
        print(json.dumps(results))
    dist.destroy_process_group()  # made here, so left here


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2304)
    parser.add_argument("--saves", type=int, default=8)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    params = sum(p.numel() for p in Wide(args.width).parameters())
    print(
        f"model: {params / 1e6:.1f} M parameters ({params * 4 / 2**20:.0f} MiB, and as much "
        f"momentum); 2 ranks (gloo), {args.saves} saves every {args.every} steps; "
        f"torch {torch.__version__}"
    )
    cmd = [
        *torchrun(2), __file__, "--worker", "--width", str(args.width),
        "--saves", str(args.saves), "--every", str(args.every),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=launch_env(), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-6000:])
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name, r in results.items():
        base = "FSDP sharded, async" if name.startswith("FSDP") else "sharded, async"
        async_ms = results[f"{base} (dcp.async_save)"]["blocked_ms"]
        print(
            f"{name:>36}: step blocked {r['blocked_ms']:8.1f} ms, hand-written host copy "
            f"{r['host_copy_ms']:6.1f} ms, blocked/host copy {r['ratio']:5.2f}, "
            f"blocked/async {r['blocked_ms'] / async_ms:5.2f} (median of {r['saves']})"
        )


if __name__ == "__main__":
    main()
