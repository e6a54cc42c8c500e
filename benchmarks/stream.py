"""The stream server: records per second delivered over loopback, and what serving eight
clients costs the training step.

1. Throughput. A producer publishes pre-built put records on the trainer's bus as fast
   as it can (yielding to the event loop every ``yield_interval_s``, as the training loop
   does); one client, then eight, read them in a separate process with
   ``loopbus.connect``. The figure is records received per second at the clients, from
   the first record any client got to the last (all clients together for eight), with
   the records dropped because a client fell behind.
2. Overhead. The same small training run as ``benchmarks/overhead.py`` (an MLP
   32 -> 32 -> 10, batch 32, SGD, one torch thread), putting two records per step, with a
   StreamServer and (a) no client, (b) eight clients reading everything from one other
   process (which stays up and reconnects for each run). Runs alternate in one process
   (ABBA); the figure is the median of the per-pair ratios of wall time (b / a) over the
   training window (first batch to teardown), and the same for the training process's
   CPU time. A run without any server is shown for reference. By default the training
   process is pinned to the first CPU and the clients to the others, as a dashboard on
   another core or machine would be.

3. ``loopbus watch`` start-up. A server (``loopbus.stream.Server`` in its thread)
   publishes a record every 5 ms from the moment ``loopbus watch --jsonl ADDRESS`` is
   started; the figure is the time from the server's first record to the command's
   first line on stdout (median of ``--watch-repeats``), and the same with torch
   imported first, as the command did before it stopped importing the engine.

    ./dev bench stream                        # defaults below
    ./dev bench stream --records 400000 --steps 4000 --repeats 31
    ./dev bench stream --no-pin               # clients may share the training CPU
    ./dev bench stream --only watch           # one section (throughput, overhead, watch)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import anyio
import anyio.lowlevel
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import loopbus
from loopbus import Module, Plugin, PutRecord, Trainer, on
from loopbus.events import FitStarted, Teardown, TrainBatchStarted
from loopbus.plugins import ServerStarted, StreamServer

torch.set_num_threads(1)


# ---------------------------------------------------------------- client process
async def _session(address: str, n: int, retry: bool) -> list[dict[str, Any]]:
    """Connect ``n`` clients (retrying while nothing listens, if ``retry``) and read
    until the stage ends. One result per client."""
    results: list[dict[str, Any]] = [{} for _ in range(n)]

    async def read(i: int, stream: loopbus.stream.Stream) -> None:
        count = 0
        first = 0.0
        async for _ in stream:
            if not count:
                first = time.time()
            count += 1
        results[i] = {"records": count, "gaps": stream.gaps, "first": first, "last": time.time()}

    streams = []
    try:
        while len(streams) < n:
            try:
                streams.append(await loopbus.connect(address).__aenter__())
            except loopbus.StreamError:
                if not retry or streams:
                    raise
                await anyio.sleep(0.02)
        async with anyio.create_task_group() as tg:
            for i, stream in enumerate(streams):
                tg.start_soon(read, i, stream)
    finally:
        for stream in streams:
            await stream.aclose()
    return results


async def _client_main(address: str, n: int, sessions: int) -> None:
    """Run ``sessions`` sessions of ``n`` clients; print one JSON line per session."""
    for _ in range(sessions):
        results = await _session(address, n, retry=sessions > 1)
        print(json.dumps(results), flush=True)


#: With --pin: the training process runs on the first CPU, the clients on the others
#: (a dashboard on another core or machine), so the clients' decoding does not compete
#: with the step for a core.
PIN: dict[str, set[int]] = {}


def spawn_clients(address: str, n: int, sessions: int = 1) -> subprocess.Popen[str]:
    clients = PIN.get("clients")
    return subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--client",
            address,
            "--clients",
            str(n),
            "--sessions",
            str(sessions),
        ],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, clients)) if clients else None,
    )


class Gate(Plugin):
    """Starts the clients when the server listens; holds the run until they subscribed."""

    delivery = loopbus.Delivery(priority=100)

    def __init__(self, server: StreamServer, clients: int, spawn: bool = True) -> None:
        self.server = server
        self.clients = clients
        self.spawn = spawn
        self.process: subprocess.Popen[str] | None = None

    @on(ServerStarted)
    def started(self, event: ServerStarted) -> None:
        if self.clients and self.spawn:
            self.process = spawn_clients(event.address, self.clients)

    @on(FitStarted)
    async def hold(self, event: FitStarted) -> None:
        with anyio.fail_after(120):
            while self.server.subscribers < self.clients:  # noqa: ASYNC110 - a counter
                await anyio.sleep(0.01)

    def results(self) -> list[dict[str, Any]]:
        if self.process is None:
            return []
        out, _ = self.process.communicate(timeout=120)
        return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


# ---------------------------------------------------------------- throughput
class Producer(Plugin):
    """Publishes ``n`` records on the bus as fast as it can, once the clients are in."""

    delivery = loopbus.Delivery(priority=-100)  # after the gate

    def __init__(self, n: int) -> None:
        self.n = n
        self.seconds = 0.0

    @on(FitStarted)
    async def produce(self, event: FitStarted) -> None:
        trainer = self._trainer
        records = [
            PutRecord(
                name=f"bench/metric{i % 8}",
                value=float(i),
                step=i,
                time=time.time(),
                source="Producer",
                destinations=("external",),
            )
            for i in range(1024)
        ]
        publish = trainer.publish
        interval = trainer.yield_interval_s
        start = time.perf_counter()
        next_yield = start + interval
        for i in range(self.n):
            await publish(records[i & 1023])
            if not i & 255 and time.perf_counter() >= next_yield:
                await anyio.lowlevel.checkpoint()
                next_yield = time.perf_counter() + interval
        self.seconds = time.perf_counter() - start

    def setup(self, trainer: Trainer, stage: str) -> None:
        self._trainer = trainer


class IdleModule(Module):
    """One step that does nothing: the producer is the workload."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    automatic_optimization = False

    def training_step(self, batch: Any, ctx: Any) -> None:
        return None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)


SCOPE: dict[str, Any] = {"scope": "trainer"}


def throughput(records: int, clients: int) -> dict[str, Any]:
    server = StreamServer(announce=False, **SCOPE)
    gate = Gate(server, clients)
    producer = Producer(records)
    trainer = Trainer(max_steps=1, plugins=[server, gate, producer], leak_check=None, device="cpu")
    loopbus.run(trainer.fit, IdleModule(), [torch.zeros(1)])
    server.close()  # the clients read until the server closes
    results = gate.results()
    received = sum(r["records"] for r in results)
    # All clients together, from the first record any of them got to the last.
    span = max(r["last"] for r in results) - min(r["first"] for r in results)
    per_client = statistics.median(r["records"] / (r["last"] - r["first"]) for r in results)
    return {
        "clients": clients,
        "produced_per_s": records / producer.seconds,
        "delivered_per_s": received / span,
        "per_client_per_s": per_client,
        "received": received,
        "dropped": server.dropped,
    }


# ---------------------------------------------------------------- overhead
class BenchModule(Module):
    """benchmarks/overhead.py's MLP; puts the loss and the learning rate every step."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(32, 32)
        self.fc2 = torch.nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.put("train/loss", loss)
        self.put("train/lr", 0.01)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Window(Plugin):
    """Wall and process CPU time from the first training batch to the teardown."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    @on(TrainBatchStarted, once=1)
    def begin(self, event: TrainBatchStarted) -> None:
        self.wall, self.cpu = -time.perf_counter(), -time.process_time()

    @on(Teardown)
    def end(self, event: Teardown) -> None:
        self.wall += time.perf_counter()
        self.cpu += time.process_time()


def make_loader(n: int) -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 32, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=32, shuffle=False)


def train(steps: int, data: Any, server: StreamServer | None, clients: int = 0) -> tuple[float, float]:
    """One run; the ``clients`` (already running, see :func:`overhead`) are waited for
    before the first step. Returns the training window's wall and CPU seconds."""
    window = Window()
    plugins: list[Plugin] = [window]
    if server is not None:
        plugins = [server, Gate(server, clients, spawn=False), window]
    trainer = Trainer(max_steps=steps, plugins=plugins, leak_check=None, device="cpu")
    loopbus.run(trainer.fit, BenchModule(), data)
    if server is not None:
        server.close()  # the clients read until the server closes, then reconnect
    return window.wall, window.cpu


def overhead(steps: int, repeats: int) -> dict[str, Any]:
    data = make_loader(32 * steps)
    # Eight clients in one process for the whole comparison: each session they connect
    # to the server on `port`, read until the stage ends, and reconnect for the next.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    pool = spawn_clients(f"tcp://127.0.0.1:{port}", 8, sessions=repeats + 1)

    def serving(clients: int) -> StreamServer:
        # The clients only ever connect to `port`; the no-client runs use another one.
        return StreamServer(port=port if clients else 0, announce=False, **SCOPE)

    train(min(steps, 300), data, serving(8), 8)  # warm-up, the pool's first session
    wall_ratios, cpu_ratios = [], []
    walls: dict[str, list[float]] = {"none": [], "server": [], "eight": []}
    for i in range(repeats):
        # Alternate the order within pairs (ABBA) so slow drifts of the machine cancel.
        order = (0, 8) if i % 2 == 0 else (8, 0)
        runs = {clients: train(steps, data, serving(clients), clients) for clients in order}
        walls["none"].append(train(steps, data, None)[0])
        (wall0, cpu0), (wall8, cpu8) = runs[0], runs[8]
        walls["server"].append(wall0)
        walls["eight"].append(wall8)
        wall_ratios.append(wall8 / wall0)
        cpu_ratios.append(cpu8 / cpu0)
    out, _ = pool.communicate(timeout=120)
    sessions = [json.loads(line) for line in out.strip().splitlines()][1:]
    received = [sum(r["records"] for r in session) for session in sessions]
    quartiles = statistics.quantiles(wall_ratios, n=4) if len(wall_ratios) > 1 else wall_ratios * 3
    return {
        "steps": steps,
        "step_us": {k: 1e6 * statistics.median(v) / steps for k, v in walls.items()},
        "wall_ratio": statistics.median(wall_ratios),
        "wall_iqr": (quartiles[0], quartiles[-1]),
        "cpu_ratio": statistics.median(cpu_ratios),
        "received_by_eight": min(received),
        "expected_by_eight": 8 * 2 * steps,
    }


# ---------------------------------------------------------------- watch start-up
_WATCH_WITH_TORCH = (
    "import sys, torch; from loopbus.__main__ import main; sys.exit(main(sys.argv[1:]))"
)


def first_line_after_first_record(with_torch: bool) -> float:
    """Start ``loopbus watch --jsonl`` while a server publishes a record every 5 ms from
    that moment on; seconds from the first record to the first line on stdout."""
    server = loopbus.stream.Server(flush_interval=0.0)
    server.start_in_thread()
    assert server.address is not None
    command = (
        [sys.executable, "-c", _WATCH_WITH_TORCH] if with_torch else [sys.executable, "-m", "loopbus"]
    )
    seen = threading.Event()
    arrived = [0.0]
    process = subprocess.Popen(
        [*command, "watch", "--jsonl", server.address], stdout=subprocess.PIPE
    )
    first = time.perf_counter()

    def read() -> None:
        assert process.stdout is not None
        process.stdout.readline()
        arrived[0] = time.perf_counter()
        seen.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        step = 0
        while not seen.wait(0.005):
            server.publish_record(
                PutRecord(name="m", value=1.0, step=step, time=time.time(), destinations=("external",))
            )
            step += 1
            if time.perf_counter() - first > 30:
                raise RuntimeError("loopbus watch printed nothing within 30 s")
    finally:
        server.close()
        server.join(5)
        process.wait(10)
    return arrived[0] - first


def watch_latency(repeats: int) -> dict[str, float]:
    light = [first_line_after_first_record(False) for _ in range(repeats)]
    heavy = [first_line_after_first_record(True) for _ in range(repeats)]
    return {"light": statistics.median(light), "heavy": statistics.median(heavy)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--watch-repeats", type=int, default=7)
    parser.add_argument(
        "--scope",
        choices=("trainer", "stage"),
        default="trainer",
        help="the StreamServer's scope: its own thread (trainer) or the trainer's event loop",
    )
    parser.add_argument(
        "--only",
        choices=("throughput", "overhead", "watch"),
        action="append",
        help="run only this section (repeatable); default all",
    )
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="do not pin the training process and the clients to different CPUs",
    )
    parser.add_argument("--client", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--clients", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--sessions", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        anyio.run(_client_main, args.client, args.clients, args.sessions)
        return

    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) >= 2:
        PIN["clients"] = set(cpus[1:])
        os.sched_setaffinity(0, {cpus[0]})
    print(
        f"stream server benchmark (python {sys.version.split()[0]}, torch {torch.__version__}, "
        f"{len(cpus)} CPUs; StreamServer(scope={args.scope!r}); "
        + (f"training on CPU {cpus[0]}, clients on {sorted(PIN['clients'])})" if PIN else "unpinned)")
    )
    SCOPE["scope"] = args.scope
    sections = set(args.only or ("throughput", "overhead", "watch"))
    for clients in (1, 8) if "throughput" in sections else ():
        r = throughput(args.records, clients)
        print(
            f"throughput, {clients} client{'s' if clients > 1 else ''}: "
            f"{r['delivered_per_s']:,.0f} records/s delivered"
            + (f" in all ({r['per_client_per_s']:,.0f} per client, median)" if clients > 1 else "")
            + f"; produced at {r['produced_per_s']:,.0f}/s; "
            f"{r['received']:,} received, {r['dropped']:,} dropped"
        )
    if "watch" in sections:
        w = watch_latency(args.watch_repeats)
        print(
            f"loopbus watch, server's first record to first output line (median of "
            f"{args.watch_repeats}): {w['light']:.3f} s; {w['heavy']:.3f} s with torch imported"
        )
    if "overhead" not in sections:
        return
    o = overhead(args.steps, args.repeats)
    us = o["step_us"]
    print(
        f"training step ({o['steps']} steps, 2 records/step, median of {args.repeats}): "
        f"no server {us['none']:.0f} us, server without clients {us['server']:.0f} us, "
        f"server with 8 clients {us['eight']:.0f} us"
    )
    print(
        f"overhead with 8 clients vs none: wall {o['wall_ratio']:.3f}x "
        f"(interquartile {o['wall_iqr'][0]:.3f}-{o['wall_iqr'][1]:.3f}), "
        f"training-process CPU {o['cpu_ratio']:.3f}x; "
        f"{o['received_by_eight']:,} of {o['expected_by_eight']:,} records delivered "
        "(fewest in a run)"
    )


if __name__ == "__main__":
    main()
