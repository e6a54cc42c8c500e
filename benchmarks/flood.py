"""The stream server against a client that floods it with Subscribe frames: what that
costs the training step, and the training process's memory.

The same small training run as ``benchmarks/stream.py``'s overhead section (an MLP
32 -> 32 -> 10, batch 32, SGD, one torch thread, two records put per step) with a
``StreamServer`` (its default ``scope="trainer"``: its own thread) and (a) no client,
(b) a hostile client in another process: it connects (no token is needed on loopback),
says ``Hello``, then sends the largest Subscribe frames there are (64 patterns of 256
characters, new ones each frame) as fast as it can and never reads; when the server
closes it, it connects again at once and goes on. Runs alternate in one process (ABBA);
the figures are the median of the per-pair ratios (b / a) of wall time and of the
process's CPU time over the training window (first batch to teardown; CPU time is the
steadier figure on a busy machine, where other processes' load moves wall time), the
CPU time of the server's thread as a share of the training window (median), the
connections the server took from the flooder a second, and the growth of the training
process's resident memory during each run (the largest minus the size at its start,
sampled every 10 ms; median and largest over the runs). By default the training process
is pinned to the first CPU and the flooding client to the others.

    ./dev bench flood                          # defaults below
    ./dev bench flood --steps 4000 --repeats 21
    ./dev bench flood --no-pin
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import anyio
import torch
from stream import BenchModule, Window, make_loader

import loopbus
from loopbus import Plugin, Trainer, on
from loopbus.events import FitStarted
from loopbus.plugins import ServerStarted, StreamServer

torch.set_num_threads(1)

#: The flooding client: plain sockets and msgspec, no loopbus, no torch. Its argument is
#: the server's "HOST:PORT"; it runs until it is killed, and prints one line when its
#: first connection is in (after the server's Welcome).
FLOODER = r"""
import socket, sys, time, msgspec
host, port = sys.argv[1].rsplit(":", 1)
def frame(message):
    payload = msgspec.msgpack.encode(message)
    return len(payload).to_bytes(4, "big") + payload
hello = frame({"type": "Hello", "version": 2})
n = 0
told = False
while True:
    try:
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(hello)
            if not told:
                sock.recv(4)  # the Welcome's length prefix: the server took the client
                print("in", flush=True)
                told = True
            while True:
                n += 1
                names = [f"flood/{n}/{j}/".ljust(256, "?") for j in range(64)]
                sock.sendall(frame({"type": "Subscribe", "names": names, "topics": ["records"]}))
    except OSError:
        time.sleep(0.01)
"""

#: With --pin: the training process runs on the first CPU, the flooder on the others.
PIN: dict[str, set[int]] = {}


def rss() -> int:
    """The process's resident memory now (bytes)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Memory:
    """Samples the resident memory every 10 ms while it is entered; ``growth`` is the
    largest sample minus the first."""

    def __init__(self) -> None:
        self.growth = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        start = largest = rss()
        while not self._done.wait(0.01):
            largest = max(largest, rss())
        self.growth = max(largest, rss()) - start

    def __enter__(self) -> Memory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


class Flood(Plugin):
    """Starts the flooding client when the server listens; holds the run until the
    server took it in. Kill it with :meth:`kill`."""

    delivery = loopbus.Delivery(priority=100)

    def __init__(self) -> None:
        self.process: subprocess.Popen[str] | None = None

    @on(ServerStarted)
    def started(self, event: ServerStarted) -> None:
        flooders = PIN.get("flooder")
        self.process = subprocess.Popen(
            [sys.executable, "-c", FLOODER, event.address.removeprefix("tcp://")],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, flooders)) if flooders else None,
        )

    @on(FitStarted)
    async def hold(self, event: FitStarted) -> None:
        assert self.process is not None
        assert self.process.stdout is not None
        with anyio.fail_after(60):
            await anyio.to_thread.run_sync(self.process.stdout.readline)

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait()


@dataclass
class Run:
    """What one run measured: the training window's wall and process CPU seconds, the
    server thread's CPU seconds, the connections the server accepted, and the growth of
    resident memory (bytes)."""

    wall: float
    cpu: float
    server_cpu: float
    connections: int
    growth: int


def thread_cpu(name: str) -> float:
    """CPU seconds the live thread called ``name`` used so far."""
    for thread in threading.enumerate():
        if thread.name == name and thread.ident is not None:
            return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    raise RuntimeError(f"no thread named {name!r}")


def train(steps: int, data: Any, flood: bool) -> Run:
    """One run with a StreamServer (in its thread), flooded or not."""
    window = Window()
    server = StreamServer(announce=False)
    flooder = Flood()
    plugins: list[Plugin] = [server, window] + ([flooder] if flood else [])
    trainer = Trainer(max_steps=steps, plugins=plugins, leak_check=None, device="cpu")
    try:
        with Memory() as memory:
            loopbus.run(trainer.fit, BenchModule(), data)
        flooder.kill()
        server_cpu = thread_cpu("loopbus stream server")
        connections = server.accepted
    finally:
        flooder.kill()
        server.close()
        server.server.join(10)
    return Run(window.wall, window.cpu, server_cpu, connections, memory.growth)


def compare(steps: int, repeats: int) -> dict[str, Any]:
    data = make_loader(32 * steps)
    train(min(steps, 300), data, False)  # warm-up
    runs: dict[bool, list[Run]] = {False: [], True: []}
    ratios = []
    cpu_ratios = []
    for i in range(repeats):
        # Alternate the order within pairs (ABBA) so slow drifts of the machine cancel.
        order = (False, True) if i % 2 == 0 else (True, False)
        pair = {flood: train(steps, data, flood) for flood in order}
        for flood, run in pair.items():
            runs[flood].append(run)
        ratios.append(pair[True].wall / pair[False].wall)
        cpu_ratios.append(pair[True].cpu / pair[False].cpu)

    def median(of: Any, flood: bool) -> float:
        return statistics.median(of(run) for run in runs[flood])

    return {
        "step_us": {k: 1e6 * median(lambda r: r.wall, k) / steps for k in runs},
        "ratio": statistics.median(ratios),
        "ratio_range": (min(ratios), max(ratios)),
        "cpu_ratio": statistics.median(cpu_ratios),
        "cpu_ratio_range": (min(cpu_ratios), max(cpu_ratios)),
        "server_share": {k: 100 * median(lambda r: r.server_cpu / r.wall, k) for k in runs},
        "connections": median(lambda r: r.connections / r.wall, True),
        "growth_mb": {k: median(lambda r: r.growth, k) / 2**20 for k in runs},
        "growth_max_mb": {k: max(r.growth for r in runs[k]) / 2**20 for k in runs},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="do not pin the training process and the flooder to different CPUs",
    )
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if args.pin and len(cpus) >= 2:
        PIN["flooder"] = set(cpus[1:])
        os.sched_setaffinity(0, {cpus[0]})
    print(
        f"stream server flood benchmark (python {sys.version.split()[0]}, torch "
        f"{torch.__version__}, {len(cpus)} CPUs, "
        + (
            f"training on CPU {cpus[0]}, flooder on {sorted(PIN['flooder'])})"
            if PIN
            else "unpinned)"
        )
    )
    start = time.perf_counter()
    r = compare(args.steps, args.repeats)
    us = r["step_us"]
    print(
        f"training step ({args.steps} steps, 2 records/step, median of {args.repeats}): "
        f"{us[False]:.0f} us without a client, {us[True]:.0f} us flooded"
    )
    print(
        f"flooded vs no client: wall {r['ratio']:.3f}x (range {r['ratio_range'][0]:.3f}-"
        f"{r['ratio_range'][1]:.3f}), process CPU {r['cpu_ratio']:.3f}x (range "
        f"{r['cpu_ratio_range'][0]:.3f}-{r['cpu_ratio_range'][1]:.3f})"
    )
    share = r["server_share"]
    print(
        f"server thread CPU (over its life) per training-window second: {share[False]:.2f}% "
        "without a client, "
        f"{share[True]:.2f}% flooded; the flooder's connections taken: "
        f"{r['connections']:.1f} a second"
    )
    print(
        "resident memory growth during a run: "
        f"{r['growth_mb'][False]:.1f} MB without a client, {r['growth_mb'][True]:.1f} MB "
        f"flooded (median; largest {r['growth_max_mb'][False]:.1f} / "
        f"{r['growth_max_mb'][True]:.1f} MB) [{time.perf_counter() - start:.0f} s]"
    )


if __name__ == "__main__":
    main()
