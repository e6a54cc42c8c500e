"""FSDP overhead and memory: loopbus ``Trainer(strategy=FSDPStrategy(units=[Block]))``
against a hand-written FSDP2 loop doing the same work, on 2 processes, gloo, CPU, one
torch thread each; and the parameter and optimizer-state bytes each rank holds under FSDP
against DDP on the same model.

Work: a small transformer language model (token and position embeddings, ``--layers``
blocks of causal self-attention and MLP with LayerNorm, a head; width ``--dim``), batch
``--batch`` sequences of ``--seq`` tokens per rank, an in-memory ``TensorDataset`` behind
a shuffled ``DistributedSampler``, AdamW, ``--steps`` optimizer steps. The hand-written
loop applies ``fully_shard`` to every block and then to the model, builds AdamW over the
sharded parameters and runs forward, backward, step, ``zero_grad``. loopbus gets a plain
shuffled ``DataLoader`` (it adds the ``DistributedSampler``), puts ``"loss"`` every step,
has no plugins and no leak check; its cost includes the collective stop's periodic
asynchronous all-reduce.

Run plainly, the script launches itself under ``torch.distributed.run`` in worker mode.
Every rank first runs both loops once and checks that they end with identical full
weights (gathered with ``get_model_state_dict(full_state_dict=True)``); then rounds
alternate the two loops (the order swaps every round), each timed between barriers
after a garbage collection, and rank 0 prints the per-round times, the median of the
per-round ratios (the headline) and its bootstrap interval, and the median step time of
each loop (steady state).

Memory: on the CPU, the bytes of the parameters and of the optimizer state each rank
holds (local shards under FSDP; whole tensors under DDP, measured on a loopbus DDP run
of the same model), after training. On a GPU (``--device cuda``, one per rank) it also
prints ``torch.cuda.max_memory_allocated`` of a run of each.

    ./dev bench fsdp                                 # defaults below
    ./dev bench fsdp --steps 60 --rounds 11 --dim 256 --layers 4
    python benchmarks/fsdp.py --nproc 4
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import random
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any, cast

import torch
import torch.distributed as dist
from _harness import launch_env, torchrun
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import loopbus
from loopbus import FSDPStrategy, Module, Trainer

# The transformer block of examples/fsdp_transformer.py: the benchmark trains that model.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from fsdp_transformer import Block

TARGET = 1.05


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=9, help="timed rounds (pairs)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank")
    parser.add_argument("--device", default="cpu", help="'cpu' or 'cuda' (cuda:LOCAL_RANK)")
    parser.add_argument("--nproc", type=int, default=2, help="processes (ranks)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---------------------------------------------------------------- the work
class GPT(torch.nn.Module):
    """The model both loops train (same seed, same layers)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok = torch.nn.Embedding(args.vocab, args.dim)
        self.pos = torch.nn.Embedding(args.seq, args.dim)
        self.blocks = torch.nn.ModuleList([Block(args.dim, args.heads) for _ in range(args.layers)])
        self.ln_f = torch.nn.LayerNorm(args.dim)
        self.head = torch.nn.Linear(args.dim, args.vocab)
        self.vocab = args.vocab

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))  # type: ignore[no-any-return]

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(x).reshape(-1, self.vocab), y.reshape(-1))


class BenchModule(Module):
    """GPT as a loopbus Module: the same layers, seed and forward, a training step that
    puts the loss."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.gpt = GPT(args)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gpt(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        STAMPS.append(time.perf_counter())
        x, y = batch
        loss = self.gpt.loss(x, y)
        self.put("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def make_dataset(args: argparse.Namespace, samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (samples, args.seq + 1), generator=g)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


STAMPS: list[float] = []


def hand_written(args: argparse.Namespace, dataset: TensorDataset, device: torch.device) -> Any:
    """FSDP2 by hand: ``fully_shard`` each block, then the model (the root); AdamW over
    the sharded parameters; forward, backward, step, ``zero_grad``."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(args).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
    model.train()
    n, epoch = 0, 0
    stamp, now = STAMPS.append, time.perf_counter
    while n < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            stamp(now())
            x, y = x.to(device), y.to(device)
            loss = model.loss(x, y)
            loss.backward()  # type: ignore[no-untyped-call]
            opt.step()
            opt.zero_grad(set_to_none=True)
            n += 1
            if n >= args.steps:
                break
        epoch += 1
    return model, opt


def with_loopbus(
    args: argparse.Namespace, dataset: TensorDataset, device: torch.device, strategy: Any
) -> tuple[BenchModule, Trainer]:
    module = BenchModule(args)
    loader = DataLoader(dataset, batch_size=args.batch, shuffle=True)
    trainer = Trainer(
        max_steps=args.steps, strategy=strategy, device=device, plugins=[], leak_check=None
    )
    loopbus.run(trainer.fit, module, loader)
    return module, trainer


def fsdp_strategy() -> FSDPStrategy:
    return FSDPStrategy(units=[Block])


# ---------------------------------------------------------------- measurement
def full_state(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k.removeprefix(prefix): cast(torch.Tensor, v) for k, v in state.items()}


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    """Bytes of the parameters and of the optimizer state this rank holds (a DTensor's
    local shard)."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if isinstance(t, DTensor) else t
        return t.numel() * t.element_size()

    params = sum(local(p) for p in model.parameters())
    state = sum(
        local(v)
        for s in optimizer.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    return params, state


def timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    STAMPS.clear()
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def median_step_ms() -> float:
    return statistics.median(b - a for a, b in itertools.pairwise(STAMPS)) * 1e3


def median_interval(values: list[float], n: int = 2000) -> tuple[float, float]:
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return medians[int(0.025 * n)], medians[int(0.975 * n) - 1]


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def worker(args: argparse.Namespace) -> None:
    # torch's advice on in-place ops on views a unit returns: true, and irrelevant here.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    dataset = make_dataset(args, args.batch * world * 64)
    n_params = sum(p.numel() for p in GPT(args).parameters())
    where = torch.cuda.get_device_name(device) if cuda else f"{cpu_model()} ({os.cpu_count()} CPUs)"
    say(
        f"torch {torch.__version__}, {dist.get_backend()}, {world} ranks x "
        f"{torch.get_num_threads()} torch thread, {where}, python {sys.version.split()[0]}"
    )
    say(
        f"GPT: dim {args.dim}, {args.layers} blocks, seq {args.seq}, vocab {args.vocab}: "
        f"{n_params / 1e6:.2f} M parameters; batch {args.batch} per rank, AdamW, "
        f"{args.steps} steps, {args.rounds} rounds"
    )

    # Same work: both loops once (also the warm-up), identical full weights at the end.
    hand_model, _ = hand_written(args, dataset, device)
    a = full_state(hand_model)
    module, _ = with_loopbus(args, dataset, device, fsdp_strategy())
    b = full_state(module, prefix="gpt.")
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    verdicts: list[Any] = [None] * world
    dist.all_gather_object(verdicts, same)
    say(
        f"same work: full weights after {args.steps} steps identical on every rank: {all(verdicts)}"
    )
    if not all(verdicts):
        dist.destroy_process_group()
        raise SystemExit("the two loops diverged; the comparison would be meaningless")
    del hand_model, module, a, b

    runs: dict[str, Callable[[], Any]] = {
        "hand": lambda: hand_written(args, dataset, device),
        "loopbus": lambda: with_loopbus(args, dataset, device, fsdp_strategy()),
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
            f"round {i + 1:>2}: hand {took['hand'] * 1e3:8.1f} ms   loopbus "
            f"{took['loopbus'] * 1e3:8.1f} ms = {ratios[-1]:.3f}x"
        )
    ratio = statistics.median(ratios)
    low, high = median_interval(ratios)
    hand_s = statistics.median(times["hand"])
    say(
        f"median over {args.rounds} rounds: hand {hand_s * 1e3:.1f} ms "
        f"({hand_s / args.steps * 1e3:.1f} ms/step), loopbus "
        f"{statistics.median(times['loopbus']) * 1e3:.1f} ms, ratio {ratio:.3f}x "
        f"(per-round {min(ratios):.3f}-{max(ratios):.3f}; 95% bootstrap interval "
        f"{low:.3f}-{high:.3f}); target <= {TARGET:.2f}x: {'met' if ratio <= TARGET else 'NOT met'}"
    )
    hand_step, lb_step = statistics.median(steps["hand"]), statistics.median(steps["loopbus"])
    say(
        f"steady state (rank 0, median time from one step's start to the next's): hand "
        f"{hand_step:.2f} ms, loopbus {lb_step:.2f} ms = {lb_step / hand_step:.3f}x"
    )

    # Memory: what each rank holds, FSDP against DDP on the same model.
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    module, trainer = with_loopbus(args, dataset, device, fsdp_strategy())
    fsdp_peak = torch.cuda.max_memory_allocated(device) if cuda else None
    fsdp_p, fsdp_s = held_bytes(module, trainer.optimizers[0])
    del module, trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    module, trainer = with_loopbus(args, dataset, device, "ddp")
    ddp_peak = torch.cuda.max_memory_allocated(device) if cuda else None
    ddp_p, ddp_s = held_bytes(module, trainer.optimizers[0])
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, (fsdp_p, fsdp_s, ddp_p, ddp_s, fsdp_peak, ddp_peak))
    for r, (fp, fs, dp, ds, fpk, dpk) in enumerate(rows):
        line = (
            f"rank {r}: parameters + optimizer state held: FSDP {(fp + fs) / 2**20:.2f} MiB "
            f"({fp / 2**20:.2f} + {fs / 2**20:.2f}), DDP {(dp + ds) / 2**20:.2f} MiB "
            f"({dp / 2**20:.2f} + {ds / 2**20:.2f}): {(fp + fs) / (dp + ds):.3f}x "
            f"(1/{world} = {1 / world:.3f})"
        )
        if fpk is not None:
            line += (
                f"; cuda max_memory_allocated FSDP {fpk / 2**20:.1f} MiB, DDP {dpk / 2**20:.1f} MiB"
            )
        say(line)
    del module, trainer
    gc.collect()
    dist.destroy_process_group()


# ---------------------------------------------------------------- launcher
def launch(args: argparse.Namespace, argv: list[str]) -> int:
    cmd = [*torchrun(args.nproc), os.path.abspath(__file__), "--worker", *argv]
    return subprocess.call(cmd, env=launch_env())


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.worker:
        worker(args)
    else:
        raise SystemExit(launch(args, argv))


if __name__ == "__main__":
    main()
