"""DDP overhead: loopbus ``Trainer(strategy="ddp")`` against a hand-written DDP loop doing
the same work, on 2 processes, gloo, CPU, one torch thread each.

Work: an MLP (32 -> H -> H -> 10, H = ``--hidden``), batch 32 per rank, an in-memory
``TensorDataset`` behind a shuffled ``DistributedSampler`` (``set_epoch`` every epoch),
SGD, ``--steps`` optimizer steps (several epochs). The hand-written loop wraps the model
in ``DistributedDataParallel`` and runs forward, backward, step, ``zero_grad``. loopbus
gets a plain shuffled ``DataLoader`` (it adds the ``DistributedSampler`` itself), puts
``"loss"`` every step, has no plugins and no leak check; its cost over the hand-written
loop includes what makes stop requests collective (a small asynchronous all-reduce on
the host every ``stop_check_interval_s``, 50 ms by default: about 40 in a run here).

Run plainly, the script launches itself under ``torch.distributed.run`` (a free port,
``OMP_NUM_THREADS=1``) in worker mode. Every rank first runs both loops once and rank 0
checks that they end with bit-identical weights (same seeds, same sampler); then rounds
alternate the two loops (the order swaps every round), each timed between barriers, and
rank 0 prints the per-round times, the median of the per-round ratios and the number of
rounds. The headline is that median of wall-time ratios: set-up, data loading, every
step and every stall are in it.

Before every timed run each rank collects garbage (outside the timing): the trainers of
earlier rounds die in reference cycles, and a full collection of a heap with torch
loaded takes 100-200 ms, which would land on whichever run came next (one fit per
process in real use has no such debris). Both loops also note the time at the start of
every step (one ``perf_counter`` and one ``append``, the same in both), from which rank
0 prints the median step time of each loop: the steady-state cost per step, which
sheds the shared machine's stalls that the wall-time ratio keeps.

It also times a bare blocking all-reduce of one integer; ``--breakdown`` adds, to every
round, the hand-written loop doing such an all-reduce after every step (what a stop
check with a collective of its own per step costs, for comparison).

    ./dev bench ddp                                 # defaults below
    ./dev bench ddp --steps 2000 --rounds 15 --hidden 128
    ./dev bench ddp --breakdown
    ./dev bench ddp --stop-check-interval 0        # a stop exchange at every step
    python benchmarks/ddp.py --backend trio
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
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _harness import launch_env, torchrun
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import loopbus
from loopbus import Module, Trainer

BATCH = 32  # per rank
TARGET = 1.05


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps per run")
    parser.add_argument("--rounds", type=int, default=20, help="timed rounds (pairs)")
    parser.add_argument("--hidden", type=int, default=64, help="width of the hidden layers")
    parser.add_argument(
        "--epoch-steps", type=int, default=500, help="steps per epoch (sets the data size)"
    )
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument(
        "--stop-check-interval",
        type=float,
        default=0.05,
        help="loopbus's stop_check_interval_s (s; 0: an exchange at every step boundary)",
    )
    parser.add_argument(
        "--breakdown",
        action="store_true",
        help="also time the hand-written loop plus a blocking stop all-reduce per step",
    )
    parser.add_argument("--nproc", type=int, default=2, help="processes (ranks)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# ---------------------------------------------------------------- the work
class MLP(torch.nn.Module):
    """32 -> hidden -> hidden -> 10, the model both loops train."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(32, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.fc3 = torch.nn.Linear(hidden, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def make_dataset(samples: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 32, generator=g)
    y = torch.randint(0, 10, (samples,), generator=g)
    return TensorDataset(x, y)


# When each step started (both loops note it the same way), for the steady-state figure.
STAMPS: list[float] = []


def hand_written(
    dataset: TensorDataset, steps: int, hidden: int, stop_check: bool = False
) -> torch.nn.Module:
    """The hand-written DDP loop; with ``stop_check`` it also all-reduces a stop flag
    after every step and reads it (a stop check with a collective of its own)."""
    torch.manual_seed(0)
    net = MLP(hidden)
    model = DistributedDataParallel(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, shuffle=True)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    net.train()
    flag = torch.zeros(1, dtype=torch.int32)
    n, epoch = 0, 0
    stamp, now = STAMPS.append, time.perf_counter
    while n < steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            stamp(now())
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            n += 1
            if stop_check:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                if flag.item():
                    break
            if n >= steps:
                break
        epoch += 1
    return net


class BenchModule(Module):
    """The same layers, seed and forward as MLP, plus a training step that puts the loss."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(32, hidden)
        self.fc2 = torch.nn.Linear(hidden, hidden)
        self.fc3 = torch.nn.Linear(hidden, 10)

    forward = MLP.forward

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        STAMPS.append(time.perf_counter())
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.put("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def with_loopbus(
    dataset: TensorDataset, steps: int, hidden: int, backend: str, stop_check_interval: float
) -> Module:
    module = BenchModule(hidden)
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True)
    trainer = Trainer(
        max_steps=steps,
        strategy="ddp",
        device="cpu",
        plugins=[],
        leak_check=None,
        stop_check_interval_s=stop_check_interval,
    )
    loopbus.run(trainer.fit, module, loader, backend=backend)
    return module


# ---------------------------------------------------------------- measurement
def timed(fn: Callable[[], Any]) -> float:
    """Wall time of ``fn`` on every rank, between barriers (so: until the last rank ends),
    after a garbage collection outside the timing."""
    gc.collect()
    STAMPS.clear()
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def median_step_us() -> float:
    """The median time between the starts of consecutive steps of the last timed run
    (this rank's), in microseconds."""
    return statistics.median(b - a for a, b in itertools.pairwise(STAMPS)) * 1e6


def allreduce_us(n: int = 2000) -> float:
    """Microseconds per blocking all-reduce (MAX) of one int32."""
    flag = torch.zeros(1, dtype=torch.int32)
    for _ in range(100):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        int(flag.item())
    dist.barrier()
    return (time.perf_counter() - start) / n * 1e6


def median_interval(values: list[float], n: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values`` (resampled with a fixed seed):
    how far the headline could move with another draw of the machine's noise."""
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
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    zero = rank == 0
    dataset = make_dataset(BATCH * world * args.epoch_steps)
    steps, hidden = args.steps, args.hidden

    def say(text: str) -> None:
        if zero:
            print(text, flush=True)

    say(
        f"torch {torch.__version__}, gloo, {world} ranks x {torch.get_num_threads()} torch "
        f"thread, {cpu_model()} ({os.cpu_count()} CPUs), python {sys.version.split()[0]}, "
        f"loopbus on {args.backend}, stop_check_interval_s={args.stop_check_interval:g} s"
    )
    say(
        f"MLP 32 -> {hidden} -> {hidden} -> 10, batch {BATCH} per rank, {steps} steps "
        f"({args.epoch_steps} per epoch), {args.rounds} rounds"
    )

    # Same work: both loops, once each (also the warm-up), must end with the same weights.
    a = hand_written(dataset, steps, hidden).state_dict()
    b = with_loopbus(dataset, steps, hidden, args.backend, args.stop_check_interval).state_dict()
    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    box: list[Any] = [same]
    dist.broadcast_object_list(box, src=0)  # rank 0's verdict, on every rank
    say(f"same work: final weights after {steps} steps identical on rank 0: {box[0]}")
    if not box[0]:
        dist.destroy_process_group()
        raise SystemExit("the two loops diverged; the comparison would be meaningless")

    reduce_us = allreduce_us()
    runs: dict[str, Callable[[], Any]] = {
        "hand": lambda: hand_written(dataset, steps, hidden),
        "loopbus": lambda: with_loopbus(
            dataset, steps, hidden, args.backend, args.stop_check_interval
        ),
    }
    if args.breakdown:
        runs["hand+stop"] = lambda: hand_written(dataset, steps, hidden, stop_check=True)
    names = list(runs)
    times: dict[str, list[float]] = {name: [] for name in names}
    step_medians: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names[1:]}
    for i in range(args.rounds):
        # The order rotates from round to round, so that drift favours no loop.
        order = names[i % len(names) :] + names[: i % len(names)]
        took = {}
        for name in order:
            took[name] = timed(runs[name])
            step_medians[name].append(median_step_us())
        line = f"round {i + 1:>2}: hand {took['hand'] * 1e3:8.1f} ms"
        for name in names:
            times[name].append(took[name])
            if name != "hand":
                ratios[name].append(took[name] / took["hand"])
                line += f"   {name} {took[name] * 1e3:8.1f} ms = {ratios[name][-1]:.3f}x"
        say(line)

    hand_s = statistics.median(times["hand"])
    step_us = hand_s / steps * 1e6
    lb = ratios["loopbus"]
    ratio = statistics.median(lb)
    say(
        f"median over {args.rounds} rounds: hand {hand_s * 1e3:.1f} ms ({step_us:.0f} us/step), "
        f"loopbus {statistics.median(times['loopbus']) * 1e3:.1f} ms, ratio {ratio:.3f}x "
        f"(per-round {min(lb):.3f}-{max(lb):.3f}); target <= {TARGET:.2f}x: "
        f"{'met' if ratio <= TARGET else 'NOT met'}"
    )
    low, high = median_interval(lb)
    say(f"95% bootstrap interval of that median: {low:.3f}x-{high:.3f}x")
    hand_step = statistics.median(step_medians["hand"])
    lb_step = statistics.median(step_medians["loopbus"])
    say(
        f"steady state (rank 0, median time from one step's start to the next's): hand "
        f"{hand_step:.0f} us, loopbus {lb_step:.0f} us = {lb_step / hand_step:.3f}x "
        f"(+{lb_step - hand_step:.0f} us a step)"
    )
    if args.breakdown:
        sync = statistics.median(ratios["hand+stop"])
        per_round = [a / b for a, b in zip(times["loopbus"], times["hand+stop"], strict=True)]
        say(
            f"hand-written + a blocking stop all-reduce per step: {sync:.3f}x the hand-written loop; "
            f"loopbus / that: {statistics.median(per_round):.3f}x"
        )
    say(
        f"one blocking all-reduce of one int32 (what a stop check with a collective of its "
        f"own would cost per step): "
        f"{reduce_us:.0f} us = {reduce_us / step_us * 100:.1f}% of a hand-written step"
    )
    # Free the trainers' DDP wrappers (held in reference cycles) before leaving the group.
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
