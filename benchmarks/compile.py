"""Compiled steps: loopbus with ``Trainer(compile=...)`` against a hand-written loop that
compiles the same step the same way.

Work: a four-layer MLP (64 -> 256 -> 256 -> 256 -> 10, ReLU), batch 64, SGD (or AdamW,
``--optim adamw``), one torch thread, from a DataLoader whose last batch is short (3000
samples: 46 batches of 64 and one of 56), so every epoch exercises the second shape.
Both loops compile the forward and the loss (the module's ``training_step`` / the
hand-written ``loss_step``) with the same ``torch.compile`` options (inductor by
default); backward runs the compiled backward; the optimizer step is compiled in both
(loopbus's default, ``compile={"optimizer": "auto"}``) or, with ``--optimizer eager``,
eager in both. Cases:

* ``1 put``: loopbus puts the loss every step; the hand-written loop logs nothing.
* ``8 puts``: loopbus puts eight scalars every step (the loss and seven statistics);
  the hand-written compiled step returns the same eight values, detached (the cheapest
  way a hand-written loop keeps them for logging), which it never reads.

Before timing it prints, for each case, the training step's graph breaks
(``torch._dynamo`` counters, target 0 with 8 puts) and the compilations one fit of two
epochs costs (graphs captured, target <= 2 with the short last batch), both with the
optimizer step eager (compiled, it adds graphs of its own and torch's two breaks around
its no_grad region), and checks that loopbus's weights after two epochs match the
hand-written loop's within 1e-4 (the same compiled kernels).

Timing: fits of ``--epochs`` epochs, alternating (hand-written first, then loopbus) in
one process, each from a fresh compiler cache (``torch._dynamo.reset()``, as a new
process would; inductor's kernels come from its on-disk cache, warmed first). The ratio
is the median over ``--repeats`` rounds of loopbus's time over that round's hand-written
time for epochs 2..N, the steady state in which every step runs compiled code; the first
epoch, which compiles the step for both shapes, is printed apart (a fit that reused
the compiled function of an earlier fit would instead retrace it for the new module,
and after eight fits torch stops recompiling it). Wall time by default; ``--clock cpu``
times the process's CPU time instead (on a machine busy with other jobs).

    ./dev bench compile                         # inductor, asyncio
    ./dev bench compile --backend aot_eager --repeats 9 --event-loop trio
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
import torch._dynamo
from _harness import CLOCK
from torch._dynamo.utils import counters
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import loopbus
from loopbus import Module, Trainer
from loopbus.events import TrainEpochCompleted, TrainEpochStarted

torch.set_num_threads(1)


def layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )


def make_loader(n: int = 3000, batch_size: int = 64) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 64, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=False)


def statistics_of(logits: torch.Tensor, y: torch.Tensor, loss: torch.Tensor) -> list[torch.Tensor]:
    """The eight scalars of the ``8 puts`` case."""
    return [
        loss,
        (logits.argmax(-1) == y).float().mean(),
        logits.mean(),
        logits.std(),
        logits.max(),
        logits.min(),
        logits.abs().mean(),
        logits.softmax(-1).max(-1).values.mean(),
    ]


NAMES = ["loss", "acc", "mean", "std", "max", "min", "abs", "confidence"]


#: Which optimizer both loops use (``--optim``).
OPTIM = ["sgd"]


def make_optimizer(params: Any) -> torch.optim.Optimizer:
    if OPTIM[0] == "adamw":
        return torch.optim.AdamW(params, lr=1e-3)
    return torch.optim.SGD(params, lr=0.01)


# ---------------------------------------------------------------- hand-written loop
def hand_written(
    data: Any, epochs: int, puts: int, options: dict[str, Any], marks: list[float] | None = None
) -> torch.nn.Module:
    """The hand-written loop; ``marks`` gets the clock at each epoch's start and at the
    end of the last epoch."""
    net = layers()
    opt = make_optimizer(net.parameters())
    step_options = {k: v for k, v in options.items() if k != "optimizer"}

    def loss_step(x: torch.Tensor, y: torch.Tensor) -> Any:
        logits = net(x)
        loss = F.cross_entropy(logits, y)
        if puts == 1:
            return loss, ()
        # Kept for logging, as loopbus keeps put values: detached, so the backward
        # graph has no gradients to carry for them.
        return loss, [value.detach() for value in statistics_of(logits, y, loss)[1:]]

    step = torch.compile(loss_step, **step_options)
    optimizer_step = opt.step
    if options["optimizer"]:  # compiled as loopbus compiles it (no fullgraph: torch breaks it)
        optimizer_step = torch.compile(
            lambda: opt.step(), **{k: v for k, v in step_options.items() if k != "fullgraph"}
        )
    net.train()
    clock = CLOCK[0]
    for _ in range(epochs):
        if marks is not None:
            marks.append(clock())
        for x, y in data:
            loss, _kept = step(x, y)
            loss.backward()
            optimizer_step()
            opt.zero_grad(set_to_none=True)
    if marks is not None:
        marks.append(clock())
    return net


# ---------------------------------------------------------------- loopbus
class Chain(Module):
    def __init__(self, puts: int) -> None:
        super().__init__()
        self.net = layers()
        self.puts = puts

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        logits = self.net(x)
        loss = F.cross_entropy(logits, y)
        if self.puts == 1:
            self.put("loss", loss)
        else:
            for name, value in zip(NAMES, statistics_of(logits, y, loss), strict=True):
                self.put(name, value)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return make_optimizer(self.parameters())


def with_loopbus(
    data: Any,
    epochs: int,
    puts: int,
    options: dict[str, Any],
    event_loop: str,
    marks: list[float] | None = None,
) -> torch.nn.Module:
    """A loopbus fit; ``marks`` gets the clock at each training epoch's start and at the
    end of the last one (two handlers an epoch, nothing per step)."""
    module = Chain(puts)
    trainer = Trainer(max_epochs=epochs, plugins=[], leak_check=None, device="cpu", compile=options)
    if marks is not None:
        clock = CLOCK[0]
        trainer.subscribe(TrainEpochStarted, lambda _: marks.append(clock()))
        last = epochs - 1

        def ended(event: TrainEpochCompleted) -> None:
            if event.epoch == last:
                marks.append(clock())

        trainer.subscribe(TrainEpochCompleted, ended)
    loopbus.run(trainer.fit, module, data, backend=event_loop)
    return module.net


# ---------------------------------------------------------------- measurement
def compile_figures(
    data: Any, puts: int, options: dict[str, Any], event_loop: str
) -> tuple[int, int, int, float]:
    """Graph breaks and graphs captured by one fresh fit of two epochs (loopbus), the
    graphs of the hand-written loop's two epochs, and the largest weight difference
    between the two after those epochs."""
    # The step's own figures: the optimizer step, compiled, has two graph breaks by
    # torch's design (around its no_grad region) and graphs of its own.
    options = {**options, "optimizer": False}
    torch._dynamo.reset()
    counters.clear()
    ours = with_loopbus(data, 2, puts, options, event_loop)
    breaks = sum(counters["graph_break"].values())
    graphs = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    counters.clear()
    theirs = hand_written(data, 2, puts, options)
    hand_graphs = counters["stats"]["unique_graphs"]
    diff = max(
        (a - b).abs().max().item()
        for a, b in zip(ours.state_dict().values(), theirs.state_dict().values(), strict=True)
    )
    return breaks, graphs, hand_graphs, diff


def ratio_case(
    label: str, data: Any, puts: int, options: dict[str, Any], args: argparse.Namespace
) -> float:
    """Rounds of one fit each, hand-written first; each fit starts from a fresh compiler
    cache (``torch._dynamo.reset()``: as in a new process, the compiled kernels then
    come from inductor's on-disk cache), so neither loop runs into torch's limit on
    recompilations of one function. The ratio compares the steady state, epochs 2..N
    (every step compiled, both shapes seen); the first epoch, with the compilations,
    is printed apart."""
    epochs = args.epochs
    if epochs < 2:
        raise SystemExit("--epochs must be at least 2 (the first one compiles)")
    hand_written(data, 1, puts, options)  # warm inductor's cache on disk
    with_loopbus(data, 1, puts, options, args.event_loop)
    ratios: list[float] = []
    hand: list[float] = []
    ours: list[float] = []
    first: list[tuple[float, float]] = []
    for _ in range(args.repeats):
        times = []
        for run in (hand_written, with_loopbus):
            torch._dynamo.reset()
            marks: list[float] = []
            if run is hand_written:
                hand_written(data, epochs, puts, options, marks)
            else:
                with_loopbus(data, epochs, puts, options, args.event_loop, marks)
            if len(marks) != epochs + 1:
                raise SystemExit(f"expected {epochs + 1} epoch marks, got {len(marks)}")
            times.append((marks[1] - marks[0], marks[-1] - marks[1]))
        (h_first, h), (t_first, t) = times
        hand.append(h)
        ours.append(t)
        first.append((h_first, t_first))
        ratios.append(t / h)
    ratio = statistics.median(ratios)
    steps = (epochs - 1) * len(data)
    print(
        f"{label:<10} {args.event_loop:<8} hand {statistics.median(hand) / steps * 1e6:7.1f} us/step"
        f"   loopbus {statistics.median(ours) / steps * 1e6:7.1f} us/step = {ratio:.3f}x"
        f"   (epochs 2..{epochs}; first epoch, compiling: hand "
        f"{statistics.median(f[0] for f in first) * 1e3:.0f} ms, loopbus "
        f"{statistics.median(f[1] for f in first) * 1e3:.0f} ms)",
        flush=True,
    )
    return ratio


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="inductor", help="torch.compile backend")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--event-loop", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument("--puts", nargs="+", type=int, default=[1, 8], choices=[1, 8])
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--optim", choices=["sgd", "adamw"], default="sgd")
    parser.add_argument(
        "--optimizer",
        choices=["compiled", "eager"],
        default="compiled",
        help="the optimizer step compiled (loopbus's default) or eager, in both loops",
    )
    args = parser.parse_args(argv)
    CLOCK[0] = time.perf_counter if args.clock == "wall" else time.process_time
    OPTIM[0] = args.optim
    options: dict[str, Any] = {"backend": args.backend, "optimizer": args.optimizer == "compiled"}
    data = make_loader()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} torch thread, backend "
        f"{args.backend}, {args.optim} with its step {args.optimizer}, "
        f"{len(data)} batches an epoch (the last one short), "
        f"{args.epochs} epochs a fit, {args.repeats} alternating repeats, "
        f"python {sys.version.split()[0]}, {args.clock} clock",
        flush=True,
    )
    for puts in args.puts:
        breaks, graphs, hand_graphs, diff = compile_figures(data, puts, options, args.event_loop)
        print(
            f"{puts} put(s): graph breaks {breaks} (target 0); graphs compiled in a fit of "
            f"two epochs: loopbus {graphs}, hand-written {hand_graphs} (target <= 2); "
            f"largest weight difference after two epochs {diff:.2e}",
            flush=True,
        )
        if diff > 1e-4:
            raise SystemExit("the two loops diverged; the comparison would be meaningless")
    for puts in args.puts:
        ratio_case(f"{puts} put(s)", data, puts, options, args)


if __name__ == "__main__":
    main()
