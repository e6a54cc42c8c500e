"""Tensor parallelism x FSDP2 overhead: loopbus
``Trainer(strategy=ModelParallelStrategy(tp=2, units=[Block]))`` against a hand-written
TP + FSDP2 loop doing the same work on the same mesh, 4 processes, gloo, CPU, one torch
thread each.

Work: the Llama-style model of ``examples/tp_transformer.py`` (RMSNorm, causal attention,
a SwiGLU MLP, ``--layers`` blocks of width ``--dim``), ``--batch`` sequences of ``--seq``
tokens per data-parallel replica, an in-memory ``TensorDataset``, AdamW, ``--steps``
optimizer steps. Both loops build the mesh ``(dp_replicate=1, dp_shard=world/2, tp=2)``,
apply the model's own plan (``configure_model(mesh)``: torchtitan's for Llama, tensor
and sequence parallel on ``tp``), ``fully_shard`` every block and then the model on
``dp_shard``, build AdamW over the DTensor parameters, and read the batches of a shuffled
``DistributedSampler`` over the data-parallel replicas (the tp peers read the same
batch). The hand-written loop runs forward, backward, step, ``zero_grad``; loopbus gets a
plain shuffled ``DataLoader`` (it shards it over the replicas), puts ``"loss"`` every
step, has no plugins and no leak check; its cost includes the collective stop's
periodic asynchronous all-reduce.

As ``benchmarks/fsdp.py``: run plainly, the script launches itself under
``torch.distributed.run``. Every rank first runs both loops once and checks that they
end with identical full weights; then rounds alternate the two loops (ABBA: the order
swaps every round), each timed between barriers after a garbage collection, and rank 0
prints the per-round times, the median of the per-round ratios (the headline) with its
bootstrap interval, and the median step time of each loop (steady state).

    ./dev bench tp                                   # defaults below
    ./dev bench tp --steps 40 --rounds 11 --dim 256
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _harness import launch_env, torchrun
from fsdp import STAMPS, cpu_model, full_state, median_interval, median_step_ms, timed
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import loopbus
from loopbus import ModelParallelStrategy, Trainer

# The model and plan of examples/tp_transformer.py: the benchmark trains that model.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from tp_transformer import Block, TinyLlama

TARGET = 1.05
TP = 2
MESH_DIMS = ("dp_replicate", "dp_shard", "tp")


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (pairs)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="sequences per replica")
    parser.add_argument("--nproc", type=int, default=4, help="processes (ranks), a multiple of 2")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---------------------------------------------------------------- the work
class BenchModule(TinyLlama):
    """The example's model with a training step that stamps the clock and puts the
    loss (the example prints the last loss when ``fit`` ends an epoch, at the run's end
    here)."""

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        STAMPS.append(time.perf_counter())
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.put("loss", loss)
        self.last_loss = loss.detach()  # what the example prints when fit ends an epoch
        return loss


def build(args: argparse.Namespace) -> BenchModule:
    torch.manual_seed(0)  # the same weights in both loops, on every rank
    return BenchModule(args.vocab, args.dim, args.layers, args.heads, lr=1e-3)


def make_dataset(args: argparse.Namespace, samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (samples, args.seq + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def hand_written(args: argparse.Namespace, dataset: TensorDataset) -> Any:
    """TP + FSDP2 by hand: the mesh, the model's plan on ``tp``, ``fully_shard`` each
    block and then the model on ``dp_shard``; AdamW; forward, backward, step,
    ``zero_grad``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (1, world // TP, TP), mesh_dim_names=MESH_DIMS)
    model = build(args)
    model.configure_model(mesh)
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    dp = mesh["dp_shard"]
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=dp.size(), rank=dp.get_local_rank(), shuffle=True
    )
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
    model.train()
    n, epoch = 0, 0
    stamp, now = STAMPS.append, time.perf_counter
    while n < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            stamp(now())
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad(set_to_none=True)
            n += 1
            if n >= args.steps:
                break
        epoch += 1
    return model, opt


def with_loopbus(args: argparse.Namespace, dataset: TensorDataset) -> BenchModule:
    module = build(args)
    loader = DataLoader(dataset, batch_size=args.batch, shuffle=True)
    strategy = ModelParallelStrategy(tp=TP, units=[Block])
    trainer = Trainer(max_steps=args.steps, strategy=strategy, plugins=[], leak_check=None)
    loopbus.run(trainer.fit, module, loader)
    return module


# ---------------------------------------------------------------- measurement
def worker(args: argparse.Namespace) -> None:
    # torch's advice on in-place ops on views a unit returns, and on the two all-reduces
    # of a norm over two mesh dimensions: true, and the same for both loops.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    replicas = world // TP
    dataset = make_dataset(args, args.batch * replicas * 64)
    n_params = sum(p.numel() for p in build(args).parameters())
    say(
        f"torch {torch.__version__}, gloo, {world} ranks x {torch.get_num_threads()} torch "
        f"thread, {cpu_model()} ({os.cpu_count()} CPUs), python {sys.version.split()[0]}"
    )
    say(
        f"mesh (dp_replicate=1, dp_shard={replicas}, tp={TP}); Llama: dim {args.dim}, "
        f"{args.layers} blocks, {args.heads} heads, seq {args.seq}, vocab {args.vocab}: "
        f"{n_params / 1e6:.2f} M parameters; batch {args.batch} per replica, AdamW, "
        f"{args.steps} steps, {args.rounds} rounds"
    )

    # Same work: both loops once (also the warm-up), identical full weights at the end.
    hand_model, _ = hand_written(args, dataset)
    a = full_state(hand_model)
    b = full_state(with_loopbus(args, dataset))
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    verdicts: list[Any] = [None] * world
    dist.all_gather_object(verdicts, same)
    say(
        f"same work: full weights after {args.steps} steps identical on every rank: {all(verdicts)}"
    )
    if not all(verdicts):
        dist.destroy_process_group()
        raise SystemExit("the two loops diverged; the comparison would be meaningless")
    del hand_model, a, b

    runs: dict[str, Callable[[], Any]] = {
        "hand": lambda: hand_written(args, dataset),
        "loopbus": lambda: with_loopbus(args, dataset),
    }
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    steps: dict[str, list[float]] = {name: [] for name in names}
    ratios: list[float] = []
    for i in range(args.rounds):
        order = names if i % 2 == 0 else names[::-1]
        took = {}
        for name in order:
            took[name] = timed(runs[name])
            steps[name].append(median_step_ms())
        for name in names:
            times[name].append(took[name])
        ratios.append(took["loopbus"] / took["hand"])
        say(
            f"round {i + 1:>2} ({'-'.join(order)}): hand {took['hand'] * 1e3:8.1f} ms   "
            f"loopbus {took['loopbus'] * 1e3:8.1f} ms = {ratios[-1]:.3f}x"
        )
    ratio = statistics.median(ratios)
    low, high = median_interval(ratios)
    hand_s, lb_s = statistics.median(times["hand"]), statistics.median(times["loopbus"])
    say(
        f"median over {args.rounds} rounds: hand {hand_s * 1e3:.1f} ms "
        f"({hand_s / args.steps * 1e3:.1f} ms/step), loopbus {lb_s * 1e3:.1f} ms "
        f"({lb_s / args.steps * 1e3:.1f} ms/step), ratio {ratio:.3f}x (per-round "
        f"{min(ratios):.3f}-{max(ratios):.3f}; 95% bootstrap interval {low:.3f}-{high:.3f}); "
        f"target <= {TARGET:.2f}x: {'met' if ratio <= TARGET else 'NOT met'}"
    )
    hand_step, lb_step = statistics.median(steps["hand"]), statistics.median(steps["loopbus"])
    say(
        f"steady state (rank 0, median time from one step's start to the next's): hand "
        f"{hand_step:.2f} ms, loopbus {lb_step:.2f} ms = {lb_step / hand_step:.3f}x"
    )
    dist.destroy_process_group()


# ---------------------------------------------------------------- launcher
def launch(args: argparse.Namespace, argv: list[str]) -> int:
    cmd = [*torchrun(args.nproc), os.path.abspath(__file__), "--worker", *argv]
    return subprocess.call(cmd, env=launch_env())


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.nproc % TP:
        raise SystemExit(f"--nproc must be a multiple of tp={TP}, got {args.nproc}")
    if args.worker:
        worker(args)
    else:
        raise SystemExit(launch(args, argv))


if __name__ == "__main__":
    main()
