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

    ./dev bench fsdp_checkpoint                # launches itself under torchrun
    ./dev bench fsdp_checkpoint --saves 12 --width 2048
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
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
from torch.utils.data import DataLoader, TensorDataset

import loopbus
from loopbus import Module, Plugin, Trainer, on
from loopbus.engine._checkpoint_io import checkpoint_info
from loopbus.events import TrainBatchCompleted
from loopbus.plugins import Checkpoint

torch.set_num_threads(1)

KINDS = {
    "sharded, async (dcp.async_save)": {"sharded": True, "background": True},
    "sharded, sync (dcp.save)": {"sharded": True, "background": False},
    "rank-0 full file, sync": {"sharded": False, "background": False},
    "rank-0 full file, background": {"sharded": False, "background": True},
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


class Stopwatch(Plugin):
    """Checkpoint's handler has priority -100: ``before`` runs just ahead of it, ``after``
    just behind it."""

    def __init__(self, directory: Path, every: int) -> None:
        self.directory = directory
        self.every = every
        self.blocked: list[float] = []
        self.host_copy: list[float] = []
        self.previous: Path | None = None
        self.t0 = 0.0
        self.trainer: Trainer | None = None

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer

    def _settled(self) -> bool:
        if self.previous is None:
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


def measure(kind: dict[str, bool], width: int, saves: int, every: int) -> dict[str, float]:
    torch.manual_seed(0)
    steps = every * saves
    x = torch.randn(32 * steps * dist.get_world_size(), 32)
    y = torch.randint(0, 10, (len(x),))
    data = DataLoader(TensorDataset(x, y), batch_size=32)
    shared = [tempfile.mkdtemp(prefix="loopbus-bench-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared)
    directory = Path(str(shared[0]))
    watch = Stopwatch(directory, every)
    checkpoint = Checkpoint(directory, every_n_steps=every, keep_last=1, save_on_end=False, **kind)
    trainer = Trainer(max_epochs=1, plugins=[checkpoint, watch], device="cpu", strategy="ddp")
    loopbus.run(trainer.fit, Wide(width), data)
    if dist.get_rank() == 0:
        last = loopbus.latest_checkpoint(directory)
        assert last is not None
        info = checkpoint_info(last)  # the completeness marker: the save is complete
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
        name: measure(kind, args.width, args.saves, args.every) for name, kind in KINDS.items()
    }
    if dist.get_rank() == 0:
        print(json.dumps(results))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        f"--master_port={_free_port()}", __file__, "--worker", "--width", str(args.width),
        "--saves", str(args.saves), "--every", str(args.every),
    ]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        sys.exit(proc.stdout[-3000:] + proc.stderr[-6000:])
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    async_ms = results["sharded, async (dcp.async_save)"]["blocked_ms"]
    for name, r in results.items():
        print(
            f"{name:>32}: step blocked {r['blocked_ms']:8.1f} ms, hand-written host copy "
            f"{r['host_copy_ms']:6.1f} ms, blocked/host copy {r['ratio']:5.2f}, "
            f"blocked/async {r['blocked_ms'] / async_ms:5.2f} (median of {r['saves']})"
        )


if __name__ == "__main__":
    main()
