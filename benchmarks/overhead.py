"""Engine overhead against a hand-written PyTorch loop doing the same work.

Work: a tiny MLP (32 -> 32 -> 10), batch 32, one torch thread, SGD, either from a plain
DataLoader over in-memory tensors or from a list of pre-built batches. loopbus also does
``put("loss", loss)`` every step. Cases:

* ``core``: put every step, no plugins, no subscribers (the issue's target case), with
  the DataLoader and with pre-built batches; Ignite's ``Engine`` on the same work (its
  process function returns ``loss.item()``, as an Ignite user's does) is timed in the
  same alternation, for reference.
* ``subscribers``: the same with one inline and one queued PutRecord subscriber.
* ``plugins``: progress bar and CSV logger.
* ``tools``: the tuning tools that stay in a run: ``ThroughputMonitor`` (records every 10
  steps) with ``WeightAveraging`` (an EMA updated every 10 steps), and ``Profiler``
  present but outside its window (its schedule starts after the run ends), each against
  the run without plugins measured just before it: the per-step cost they add (the
  ratio of the two runs' ratios to the hand-written loop, and the calls per step).

Runs alternate (hand-written first, then the others in a rotating order) in one
process; each figure is the median of the per-round ratios to the hand-written loop.
Runs are timed by wall time, or with ``--clock cpu`` by the process's CPU time (on a
machine busy with other jobs, where wall time also counts the waits for a core).

It also prints the deterministic figure from DESIGN.md's performance budget: Python-level
calls per step (``call`` + ``c_call`` profile events) that loopbus adds over the
hand-written loop, measured over N and 2N pre-built batches so start-up cancels.

    ./dev bench overhead                       # both backends, defaults below
    ./dev bench overhead --steps 3000 --repeats 9 --backends asyncio
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from _harness import CLOCK, count_calls, timed
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import loopbus
from loopbus import Module, PutRecord, Trainer

torch.set_num_threads(1)


class MLP(torch.nn.Module):
    """32 -> 32 -> 10, the model both loops train."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(32, 32)
        self.fc2 = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))


def make_net(seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP()


def make_loader(n: int = 3200) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False)


# ---------------------------------------------------------------- hand-written loop
def hand_written(data: Iterable[Any], steps: int) -> torch.nn.Module:
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    net.train()
    n = 0
    while n < steps:
        for x, y in data:
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            n += 1
            if n >= steps:
                break
    return net


# ---------------------------------------------------------------- loopbus
class BenchModule(Module):
    """The same layers and forward as MLP, plus a training step that puts the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(32, 32)
        self.fc2 = torch.nn.Linear(32, 10)

    forward = MLP.forward

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.put("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


PluginFactory = Callable[[], list[loopbus.Plugin]]


def with_loopbus(
    data: Any,
    steps: int,
    backend: str,
    subscribers: bool = True,
    plugins: PluginFactory | None = None,
    yield_interval: float = 0.005,
) -> BenchModule:
    module = BenchModule()
    trainer = Trainer(
        max_steps=steps,
        plugins=plugins() if plugins else [],
        leak_check=None,
        device="cpu",
        yield_interval_s=yield_interval,
    )
    if subscribers:
        seen = [0.0]

        def inline(record: PutRecord) -> None:
            seen[0] = record.value

        sunk: list[float] = []

        def queued(record: PutRecord) -> None:
            sunk.append(record.value)

        trainer.subscribe(PutRecord, inline)
        trainer.subscribe(PutRecord, queued, mode="queued", destination="loggers")
    loopbus.run(trainer.fit, module, data, backend=backend)
    return module


# ---------------------------------------------------------------- Ignite (reference)
def with_ignite(data: Any, steps: int) -> torch.nn.Module:
    from ignite.engine import Engine

    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    net.train()

    def process(engine: Any, batch: Any) -> float:
        x, y = batch
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    engine = Engine(process)
    epoch_length = len(data)
    engine.run(data, max_epochs=math.ceil(steps / epoch_length), epoch_length=epoch_length)
    return net


def ignite_available() -> bool:
    try:
        import ignite.engine  # noqa: F401
    except ImportError:
        return False
    return True


# ---------------------------------------------------------------- measurement
def extra_calls_per_step(
    backend: str, subscribers: bool, n: int = 200, plugins: PluginFactory | None = None
) -> float:
    """(loopbus(2N) - loopbus(N)) - (hand(2N) - hand(N)), per step, pre-built batches.
    Yields to the event loop are time-based, so they are switched off here to keep the
    count deterministic; `checkpoint_calls` reports what one yield costs. Only the event
    loop's thread is counted (a logger's writer thread is not)."""
    batches = list(make_loader(32 * 2 * n))
    small, large = batches[:n], batches[: 2 * n]

    def lb(data: list[Any]) -> Callable[[], Any]:
        return lambda: with_loopbus(
            data,
            len(data),
            backend,
            subscribers=subscribers,
            plugins=plugins,
            yield_interval=math.inf,
        )

    def hw(data: list[Any]) -> Callable[[], Any]:
        return lambda: hand_written(data, len(data))

    lb(small)()  # warm up imports and caches
    hw(small)()
    d_lb = count_calls(lb(large)) - count_calls(lb(small))
    d_hw = count_calls(hw(large)) - count_calls(hw(small))
    return (d_lb - d_hw) / n


def checkpoint_calls(backend: str) -> float:
    import anyio
    from anyio.lowlevel import checkpoint

    async def many(k: int) -> None:
        for _ in range(k):
            await checkpoint()

    a = count_calls(lambda: anyio.run(many, 100, backend=backend))
    b = count_calls(lambda: anyio.run(many, 200, backend=backend))
    return (b - a) / 100


def ratio_case(
    name: str,
    backend: str,
    loader: Any,
    steps: int,
    repeats: int,
    plugins: PluginFactory | None = None,
    subscribers: bool = False,
    ignite: bool = False,
) -> dict[str, float]:
    """Median per-round ratios to the hand-written loop; Ignite (optional) in the same
    rounds. Each round runs the hand-written loop, then the others in rotating order."""
    others: dict[str, Callable[[], Any]] = {
        "loopbus": lambda: with_loopbus(
            loader, steps, backend, subscribers=subscribers, plugins=plugins
        )
    }
    if ignite:
        others["ignite"] = lambda: with_ignite(loader, steps)
    # one warm-up of each
    hand_written(loader, min(steps, 200))
    with_loopbus(loader, min(steps, 200), backend, subscribers=subscribers, plugins=plugins)
    if ignite:
        with_ignite(loader, min(steps, 200))
    hand_times: list[float] = []
    times: dict[str, list[float]] = {k: [] for k in others}
    ratios: dict[str, list[float]] = {k: [] for k in others}
    names = list(others)
    for i in range(repeats):
        h = timed(lambda: hand_written(loader, steps))
        hand_times.append(h)
        order = names[i % len(names) :] + names[: i % len(names)]
        for key in order:
            t = timed(others[key])
            times[key].append(t)
            ratios[key].append(t / h)
    result = {"hand_s": statistics.median(hand_times)}
    line = f"{name:<40} {backend:<8} hand {result['hand_s'] * 1e3:8.1f} ms"
    for key in names:
        result[f"{key}_s"] = statistics.median(times[key])
        result[f"{key}_ratio"] = statistics.median(ratios[key])
        line += f"   {key} {result[f'{key}_s'] * 1e3:8.1f} ms = {result[f'{key}_ratio']:.3f}x"
    print(line, flush=True)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--backends", nargs="+", default=["asyncio", "trio"])
    parser.add_argument("--skip-calls", action="store_true", help="skip the call count")
    parser.add_argument(
        "--cases", nargs="+", default=["core", "subscribers", "plugins", "tools"],
        choices=["core", "subscribers", "plugins", "tools"],
    )
    parser.add_argument("--no-ignite", action="store_true", help="skip the Ignite reference")
    parser.add_argument(
        "--clock", choices=["wall", "cpu"], default="wall",
        help="time runs by wall time or by the process's CPU time (on a busy machine)",
    )
    args = parser.parse_args(argv)
    CLOCK[0] = time.perf_counter if args.clock == "wall" else time.process_time

    loader = make_loader()
    prebuilt = list(make_loader())
    ignite = not args.no_ignite and ignite_available()
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} torch thread, "
        f"{args.steps} steps, {args.repeats} alternating repeats, python {sys.version.split()[0]}, "
        f"{args.clock} clock"
    )
    for backend in args.backends:
        a = hand_written(loader, 200).state_dict()
        b = with_loopbus(loader, 200, backend).state_dict()
        same = all(torch.equal(a[k], b[k]) for k in a)
        print(f"same work ({backend}): final weights after 200 steps identical: {same}")
        if not same:
            raise SystemExit("the two loops diverged; the comparison would be meaningless")
    if not args.skip_calls:
        for backend in args.backends:
            bare = extra_calls_per_step(backend, subscribers=False)
            subs = extra_calls_per_step(backend, subscribers=True)
            print(
                f"extra Python calls per step ({backend}): {bare:.1f} with put and no plugins "
                f"(target 18, budget 30); {subs:.1f} with one inline and one queued subscriber; "
                f"+{checkpoint_calls(backend):.1f} per yield to the event loop "
                "(at most one per yield_interval_s)",
                flush=True,
            )
    for backend in args.backends:
        if "core" in args.cases:
            for label, data in (("DataLoader", loader), ("pre-built batches", prebuilt)):
                ratio_case(
                    f"put, no plugins, {label}", backend, data, args.steps, args.repeats,
                    ignite=ignite,
                )
        if "subscribers" in args.cases:
            ratio_case(
                "put + inline + queued subscriber", backend, loader, args.steps, args.repeats,
                subscribers=True,
            )
        if "plugins" in args.cases:
            factory = plugins_factory()
            if factory is not None:
                for label, make in factory:
                    if not args.skip_calls and "non-tty" in label:
                        calls = extra_calls_per_step(backend, subscribers=False, plugins=make)
                        print(
                            f"extra Python calls per step ({backend}) with put and "
                            f"{label}: {calls:.1f}",
                            flush=True,
                        )
                    ratio_case(label, backend, loader, args.steps, args.repeats, plugins=make)
        if "tools" in args.cases:
            tools_case(backend, loader, args.steps, args.repeats, calls=not args.skip_calls)


def tools_factory(folder: str) -> list[tuple[str, PluginFactory]]:
    """The 'tools' case: the tuning tools that stay in a run, and the profiler idle."""
    from loopbus.plugins.tuning import Profiler, ThroughputMonitor, WeightAveraging

    def monitor_and_ema() -> list[loopbus.Plugin]:
        return [ThroughputMonitor(every_n_steps=10), WeightAveraging.ema(decay=0.999, every_n_steps=10)]

    def idle_profiler() -> list[loopbus.Plugin]:
        # Its window would open after 10**9 batches: present, never profiling.
        return [Profiler(folder, skip_first=10**9)]

    return [
        ("ThroughputMonitor + WeightAveraging(every 10)", monitor_and_ema),
        ("Profiler outside its window", idle_profiler),
    ]


def tools_case(backend: str, loader: Any, steps: int, repeats: int, *, calls: bool) -> None:
    """Each tool's run against the run without plugins measured just before it: the
    ratio of their ratios to the hand-written loop, the difference of their medians per
    step, and the calls per step."""
    with tempfile.TemporaryDirectory() as folder:
        bare = ratio_case("put, no plugins (tools' baseline)", backend, loader, steps, repeats)
        if calls:
            base_calls = extra_calls_per_step(backend, subscribers=False)
        for label, make in tools_factory(folder):
            result = ratio_case(label, backend, loader, steps, repeats, plugins=make)
            cost_us = (result["loopbus_s"] - bare["loopbus_s"]) / steps * 1e6
            line = (
                f"  {label}: {result['loopbus_ratio'] / bare['loopbus_ratio']:.3f}x the run "
                f"without plugins, {cost_us:+.1f} us a step"
            )
            if calls:
                extra = extra_calls_per_step(backend, subscribers=False, plugins=make)
                line += f"; Python calls per step {extra:.1f} (without plugins {base_calls:.1f})"
            print(line, flush=True)


def plugins_factory() -> list[tuple[str, PluginFactory]] | None:
    """The 'plugins' case: progress bar and CSV logger (when the plugins exist)."""
    try:
        from loopbus import plugins as standard
    except ImportError:  # pragma: no cover
        return None
    if not all(hasattr(standard, n) for n in ("ProgressBar", "CSVLogger")):
        return None
    out_dir = tempfile.mkdtemp(prefix="loopbus-bench-")
    devnull = open(os.devnull, "w")

    def non_terminal() -> list[loopbus.Plugin]:
        return [standard.ProgressBar(file=devnull), standard.CSVLogger(out_dir)]

    cases: list[tuple[str, PluginFactory]] = [("progress bar (non-tty) + CSV logger", non_terminal)]
    tty = pseudo_terminal()
    if tty is not None:

        def terminal() -> list[loopbus.Plugin]:
            return [standard.ProgressBar(file=tty), standard.CSVLogger(out_dir)]

        cases.append(("progress bar (pty) + CSV logger", terminal))
    return cases


def pseudo_terminal() -> Any:
    """A text file on a pseudo-terminal whose output another process reads and discards
    (as a terminal emulator would), so the progress bar draws its live display."""
    try:
        import pty
    except ImportError:  # pragma: no cover - not on Windows
        return None
    import atexit
    import subprocess

    master, slave = pty.openpty()
    drain = "import os\nwhile True:\n    try:\n        if not os.read(0, 1 << 16): break\n    except OSError: break"
    reader = subprocess.Popen([sys.executable, "-c", drain], stdin=master, stdout=subprocess.DEVNULL)
    os.close(master)  # the reader holds it now
    atexit.register(reader.kill)
    if os.environ.get("TERM", "").lower() in ("", "dumb", "unknown"):
        os.environ["TERM"] = "xterm-256color"  # a terminal that can draw the bars
    return open(slave, "w", encoding="utf-8", closefd=True)  # lives for the whole benchmark


if __name__ == "__main__":
    main()
