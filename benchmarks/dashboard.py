"""What watching a run with ``loopbus dashboard`` costs its training.

The small training run of ``benchmarks/stream.py`` (an MLP 32 -> 32 -> 10, batch 32,
SGD, one torch thread) puts ``--records`` records per step and serves them with a
StreamServer on a Unix socket. Two cases alternate (ABBA) in this process:

(a) nobody watches;
(b) ``loopbus dashboard`` (a separate process) follows the run, and three
    browser-equivalent readers (threads of one more process, each streaming the page's
    Server-Sent Events with httpx) read everything it sends.

The figure is the median over the pairs of the ratio of training wall time (first batch
to teardown) b / a, and the same for the training process's CPU time; the target is
<= 1.03. By default the training process is pinned to the first CPU and the dashboard
and readers to the others, as they would run on another core or machine.

``--only pages`` measures what pages that never read cost the dashboard: a source in
this process (a stream ``Server``, no training) publishes ``--history`` records, which
the dashboard (a separate process) keeps as its history; then ``--pages`` connections
ask for its event stream and never read a byte, and leave. The figures are the dashboard
process's resident memory (RSS, from ``/proc``) before, with the pages open, and after
they left; the target is flat-ish (the history is sent in bounded chunks at each page's
pace, not copied per page).

``--only scale`` measures the runs page over logged runs: ``--runs`` CSV run folders
(what ``CSVLogger`` writes) of ``--names`` record names x ``--steps`` steps each, on
disk; the dashboard (a separate process) starts on the folder, and the figures are the seconds
until ``GET /api/runs`` lists every run, until the first chart's ``POST /api/lines``
(one record name, every run, 800 pixel columns: what the page asks to draw it) answers
with a line in it (``first_chart_drawn_s``: the chart is drawn, its runs filling in as
they are read) and with every run in it (``first_chart_s``), asked every 150 ms as the
page's chart asks again while its runs change (``REFRESH_MS``), and until every point of
every run is read;
the dashboard's CPU time until the first chart held every run (what does not depend on
other work on the machine); its peak resident memory (``VmHWM``); and, with a run still being written,
the seconds from a line appended to its file to the point in ``/api/lines``.

``--only tensorboard`` writes ``--tb-runs`` x ``--names`` x ``--tb-steps`` scalars as
TensorBoard event files, then times, on the same files, ``loopbus dashboard`` (until
``/api/scalars`` answers every series of every run, every point) and ``tensorboard
--logdir`` (until its scalars API, ``/data/plugin/scalars/scalars``, answers every
series of every run, with its own sampling); either that does not within ``--timeout``
seconds is reported as such (null), and the other still timed. ``--only logs`` runs
both, one after the other. Each phase's figure is printed (to stderr) as soon as it is
known, and a phase of ``--only scale`` that takes longer than ``--timeout`` seconds
stops the benchmark with a message naming it. The HTTP client asking is one
``httpx.Client`` per phase, as a page keeps its connection.

    python benchmarks/dashboard.py                  # cost and pages, about two minutes
    python benchmarks/dashboard.py --only scale --runs 200 --names 20 --steps 10000
    python benchmarks/dashboard.py --only tensorboard --tb-runs 10 --tb-steps 1000
    python benchmarks/dashboard.py --only logs      # scale, then tensorboard
    python benchmarks/dashboard.py --only cost --steps 4000 --repeats 9 --no-pin
    python benchmarks/dashboard.py --only pages --history 1000000 --pages 30
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import loopbus
from loopbus import Module, Plugin, Trainer, on
from loopbus.events import FitStarted, Teardown, TrainBatchStarted
from loopbus.plugins import StreamServer
from loopbus.stream import Server

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
#: CPUs for the dashboard and the readers when pinning (the training gets the first).
OTHERS: set[int] = set()
#: Seconds a phase of ``--only scale`` or ``--only tensorboard`` may take (``--timeout``).
PHASE_TIMEOUT = [300.0]


# ---------------------------------------------------------------- reader process
def read_events(url: str, clients: int) -> None:
    """``clients`` threads stream ``url`` (the dashboard's /events) until stdin closes;
    then print what each received, as JSON."""
    import httpx

    counts = [{"bytes": 0, "messages": 0} for _ in range(clients)]
    stop = threading.Event()

    def read(i: int) -> None:
        with httpx.stream("GET", url, timeout=None) as response:
            for chunk in response.iter_bytes():
                counts[i]["bytes"] += len(chunk)
                counts[i]["messages"] += chunk.count(b"event: data")
                if stop.is_set():
                    return

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    sys.stdin.read()
    stop.set()
    print(json.dumps(counts), flush=True)


# ---------------------------------------------------------------- training
class BenchModule(Module):
    def __init__(self, records: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1 = torch.nn.Linear(32, 32)
        self.fc2 = torch.nn.Linear(32, 10)
        self.names = [f"train/m{i}" for i in range(records - 1)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(x)))

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.put("train/loss", loss)
        for name in self.names:
            self.put(name, 0.5)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Window(Plugin):
    """Holds the run until ``clients`` subscribed; then wall and CPU time from the first
    training batch to the teardown."""

    def __init__(self, server: StreamServer, clients: int) -> None:
        self.server = server
        self.clients = clients
        self.wall = self.cpu = 0.0

    @on(FitStarted)
    async def hold(self, event: FitStarted) -> None:
        with anyio.fail_after(60):
            while self.server.subscribers < self.clients:  # noqa: ASYNC110
                await anyio.sleep(0.01)

    @on(TrainBatchStarted, once=1)
    def begin(self, event: TrainBatchStarted) -> None:
        self.wall, self.cpu = -time.perf_counter(), -time.process_time()

    @on(Teardown)
    def end(self, event: Teardown) -> None:
        self.wall += time.perf_counter()
        self.cpu += time.process_time()


def train(steps: int, records: int, data: Any, path: str, watched: bool) -> tuple[float, float]:
    server = StreamServer(host=None, path=path, announce=False)
    window = Window(server, 1 if watched else 0)
    trainer = Trainer(max_steps=steps, plugins=[server, window], leak_check=None, device="cpu")
    try:
        loopbus.run(trainer.fit, BenchModule(records), data)
    finally:
        server.close()  # the server serves for the trainer's lifetime: free its path
    return window.wall, window.cpu


def _pinned() -> Any:
    return (lambda: os.sched_setaffinity(0, OTHERS)) if OTHERS else None


def _drain(proc: subprocess.Popen[str]) -> None:
    """Read the rest of the server's stderr in a thread of its own: a pipe nobody reads
    fills up, and the server then blocks on its next write to it."""
    stream = proc.stderr
    assert stream is not None
    threading.Thread(target=lambda: [None for _ in stream], daemon=True).start()


def start_dashboard(address: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "loopbus", "dashboard", address],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_pinned(),
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    if not line.startswith("loopbus dashboard: http"):
        proc.kill()
        raise SystemExit(f"the dashboard did not start: {line}{proc.stderr.read()}")
    _drain(proc)
    return proc, line.split()[2]


def records_shown(url: str) -> int:
    import httpx

    # Each run on the address is a new job to the dashboard: a series (and a row) each.
    return sum(int(run["records"]) for run in httpx.get(url + "status", timeout=10).json()["runs"])


def bench(steps: int, records: int, repeats: int) -> dict[str, Any]:
    data = DataLoader(
        TensorDataset(torch.randn(32 * steps, 32), torch.randint(0, 10, (32 * steps,))),
        batch_size=32,
    )
    with tempfile.TemporaryDirectory() as tmp:
        watched_path, alone_path = f"{tmp}/watched.sock", f"{tmp}/alone.sock"
        dashboard, url = start_dashboard(f"unix://{watched_path}")
        readers = subprocess.Popen(
            [sys.executable, __file__, "--read", url + "events", "--clients", "3"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=_pinned(),
        )
        try:
            train(min(300, steps), records, data, watched_path, True)  # warm-up
            walls: dict[bool, list[float]] = {False: [], True: []}
            wall_ratios, cpu_ratios = [], []
            for i in range(repeats):
                order = (False, True) if i % 2 == 0 else (True, False)
                runs = {
                    w: train(steps, records, data, watched_path if w else alone_path, w)
                    for w in order
                }
                walls[False].append(runs[False][0])
                walls[True].append(runs[True][0])
                wall_ratios.append(runs[True][0] / runs[False][0])
                cpu_ratios.append(runs[True][1] / runs[False][1])
            time.sleep(1.0)  # the last records reach the dashboard and the readers
            shown = records_shown(url)
            out, _ = readers.communicate("", timeout=30)
        finally:
            if readers.poll() is None:
                readers.kill()
            dashboard.terminate()
            dashboard.wait(timeout=15)
            if dashboard.stderr is not None:
                dashboard.stderr.close()
    received = json.loads(out)
    return {
        "steps": steps,
        "records_per_step": records,
        "step_us": {
            "alone": 1e6 * statistics.median(walls[False]) / steps,
            "watched": 1e6 * statistics.median(walls[True]) / steps,
        },
        "wall_ratio": statistics.median(wall_ratios),
        "wall_ratios": wall_ratios,
        "cpu_ratio": statistics.median(cpu_ratios),
        "records_shown": shown,
        "records_put": (min(300, steps) + repeats * steps) * records,
        "reader_messages": [r["messages"] for r in received],
        "reader_mb": [round(r["bytes"] / 1e6, 1) for r in received],
    }


# ---------------------------------------------------------------- pages that never read
def rss_mib(pid: int) -> float:
    """The resident memory of process ``pid``, in MiB (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def dashboard_status(url: str) -> dict[str, Any]:
    import httpx

    return httpx.get(url + "status", timeout=30).json()


def fill(server: Any, url: str, records: int, names: int = 10, burst: int = 8192) -> int:
    """Publish ``records`` records of ``names`` names, a burst at a time (each waits
    until the dashboard took the previous one, so that none is dropped); returns the
    records the dashboard shows."""
    now = time.time()
    shown = 0
    for start in range(0, records, burst):
        end = min(records, start + burst)
        for i in range(start, end):
            server.publish_record(
                loopbus.PutRecord(
                    name=f"train/m{i % names}",
                    value=math.sin(i),  # a float of 16-18 digits, as a loss would be
                    step=i // names,
                    epoch=0,
                    time=now,
                    destinations=("external",),
                )
            )
        deadline = time.monotonic() + 60
        while True:
            runs = dashboard_status(url)["runs"]
            shown = sum(r["records"] for r in runs)
            if shown + sum(r["gaps"] for r in runs) >= end:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"the dashboard took {shown} of {end} records in 60 s")
            time.sleep(0.02)
    return shown


def settle(pid: int, url: str, pages: int | None, within: float = 60.0) -> float:
    """The dashboard's RSS once it stopped moving (and, where its status tells the open
    pages, once ``pages`` are open)."""
    deadline = time.monotonic() + within
    last = rss_mib(pid)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = rss_mib(pid)
        opened = dashboard_status(url).get("pages", pages)
        if abs(now - last) < 1.0 and (pages is None or opened == pages):
            return now
        last = now
    return last


def stalled_page(url: str) -> socket.socket:
    """A connection that asks for the event stream and never reads."""
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"GET /events HTTP/1.1\r\nHost: %s\r\nAccept: text/event-stream\r\n\r\n" % host.encode()
    )
    return sock


def bench_pages(history: int, pages: int) -> dict[str, Any]:
    """The dashboard's RSS with ``history`` records kept: before, with ``pages`` pages
    that never read, and after they left."""
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/source.sock"
        server = Server(host=None, path=path)
        server.start_in_thread()
        dashboard, url = start_dashboard(f"unix://{path}")
        try:
            deadline = time.monotonic() + 60
            while server.subscribers < 1:
                if time.monotonic() > deadline:
                    raise SystemExit("the dashboard did not subscribe to the source in 60 s")
                time.sleep(0.02)
            started = time.perf_counter()
            shown = fill(server, url, history)
            filled_s = time.perf_counter() - started
            time.sleep(1.0)  # the last flush
            before = settle(dashboard.pid, url, 0)
            socks = [stalled_page(url) for _ in range(pages)]
            with_pages = settle(dashboard.pid, url, pages)
            status = dashboard_status(url)  # the open pages and the bytes queued for them
            for sock in socks:
                sock.close()
            after = settle(dashboard.pid, url, 0)
            left = dashboard_status(url).get("pages")
        finally:
            dashboard.terminate()
            dashboard.wait(timeout=15)
            if dashboard.stderr is not None:
                dashboard.stderr.close()
            server.close()
            server.join(10)
    return {
        "history_records": shown,
        "history_mib": round(status["history_bytes"] / 2**20, 1)
        if "history_bytes" in status
        else None,
        "fill_s": round(filled_s, 1),
        "pages": pages,
        "rss_mib": {
            "before": round(before, 1),
            "with_pages": round(with_pages, 1),
            "after": round(after, 1),
        },
        "pages_open": status.get("pages"),
        "queued_bytes": status.get("queued"),
        "pages_left_after": left,
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_csv_runs(root: Path, runs: int, names: int, steps: int) -> None:
    """``runs`` run folders of ``metrics.csv`` (the CSV logger's layout), every name at
    every step."""
    header = "step,epoch,time," + ",".join(f"train/m{j:02d}" for j in range(names)) + "\n"
    for i in range(runs):
        folder = root / f"exp{i // 10}" / f"version_{i % 10}"
        folder.mkdir(parents=True)
        (folder / "run.json").write_text(json.dumps({"name": f"exp{i // 10}", "version": i % 10}))
        (folder / "config.yaml").write_text(f"model:\n  lr: {0.001 * (1 + i % 7)}\n  seed: {i}\n")
        rows = [
            f"{s},{s // 1000},{1.7e9 + s * 0.01 + i},"
            + ",".join(repr(1.0 / (s + j + 1) + 0.001 * i) for j in range(names))
            for s in range(1, steps + 1)
        ]
        (folder / "metrics.csv").write_text(header + "\n".join(rows) + "\n")


def _serve_folder(folder: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "loopbus", "dashboard", str(folder)],
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert proc.stderr is not None
    line = proc.stderr.readline()
    if not line.startswith("loopbus dashboard: http"):
        raise RuntimeError(f"the dashboard did not start: {line}")
    _drain(proc)
    return proc, line.split()[2]


def _until(what: Any, timeout: float | None = None, every: float = 0.02) -> float:
    """Seconds until ``what(client)`` holds; TimeoutError (naming it) after ``timeout``
    (``--timeout``) seconds; asked every ``every`` seconds. ``client`` is one
    ``httpx.Client`` for every ask, as a page keeps its connection: a client of its own
    per request (``httpx.get``) costs about 25 ms of CPU time to make, on the machine
    the server runs on."""
    import httpx

    timeout = PHASE_TIMEOUT[0] if timeout is None else timeout
    start = time.perf_counter()  # making the client counts: the phases add up to the wall time
    with httpx.Client() as client:
        while time.perf_counter() - start < timeout:
            try:
                if what(client):
                    return time.perf_counter() - start
            except httpx.HTTPError:
                pass
            time.sleep(every)
    name = getattr(what, "__name__", "the condition")
    raise TimeoutError(f"gave up waiting for {name} after {timeout:.0f} s (--timeout)")


def _phase(name: str, figure: float, unit: str = "s") -> float:
    """Print a phase's figure as soon as it is known (a long run shows its progress)."""
    print(f"  {name}: {figure:.2f} {unit}", file=sys.stderr, flush=True)
    return figure


def cpu_s(pid: int) -> float:
    """The CPU time (user and system) process ``pid`` used so far, in seconds (Linux):
    the figure that does not depend on what else runs on the machine."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def bench_scale(runs: int, names: int, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "runs"
        started = time.perf_counter()
        write_csv_runs(root, runs, names, steps)
        os.sync()  # on disk now: the kernel does not write them back while the dashboard runs
        written = _phase("CSV files written", time.perf_counter() - started)
        size = sum(p.stat().st_size for p in root.rglob("metrics.csv"))
        started = time.perf_counter()
        proc, url = _serve_folder(root)
        try:
            t0 = _phase("server answering", time.perf_counter() - started)
            start_cpu = _phase("  the server's CPU time until then", cpu_s(proc.pid))
            ids: list[str] = []

            def listed(client: Any) -> bool:
                got = client.get(url + "api/runs", timeout=30).json()
                ids[:] = [r["id"] for r in got]
                return len(got) == runs

            listed_s = _phase("every run listed", t0 + _until(listed))
            body = {"runs": ids, "names": ["train/m00"], "width": 800}

            def first_drawn(client: Any) -> bool:  # the chart holds a line (runs fill in)
                got = client.post(url + "api/lines", json=body, timeout=60).json()
                return len(got["runs"]) > 0

            # A chart asks again at most every REFRESH_MS (150 ms) while its runs change.
            drawn_s = _phase("first chart holds a line", listed_s + _until(first_drawn, every=0.15))

            def first_chart(client: Any) -> bool:
                got = client.post(url + "api/lines", json=body, timeout=60).json()
                return len(got["runs"]) == runs

            chart_s = _phase(
                "first chart holds every run", drawn_s + _until(first_chart, every=0.15)
            )
            chart_cpu = _phase("  the server's CPU time until then", cpu_s(proc.pid))

            def everything(client: Any) -> bool:
                got = client.get(url + "api/runs", timeout=60).json()
                return sum(r["points"] for r in got) == runs * names * steps

            all_s = _phase("every point read", chart_s + _until(everything))
            answer = _phase(
                "first chart again",
                _until(lambda client: client.post(url + "api/lines", json=body, timeout=60)),
            )
            live_s = _phase("a live point shown (median)", _live_latency(root, url))
            rss = _phase("server peak RSS", peak_rss_mib(proc.pid), "MiB")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return {
        "runs": runs,
        "names": names,
        "steps": steps,
        "points": runs * names * steps,
        "csv_mib": round(size / 2**20, 1),
        "write_s": round(written, 1),
        "started_s": round(t0, 2),
        "listed_s": round(listed_s, 2),
        "first_chart_drawn_s": round(drawn_s, 2),
        "first_chart_s": round(chart_s, 2),
        "started_server_cpu_s": round(start_cpu, 2),
        "first_chart_server_cpu_s": round(chart_cpu, 2),
        "all_points_s": round(all_s, 2),
        "first_chart_again_s": round(answer, 3),
        "live_point_s": live_s,
        "peak_rss_mib": round(rss, 1),
    }


def _live_latency(root: Path, url: str) -> float:
    """Seconds from a line appended to a run's file to its point in ``/api/lines``."""
    folder = root / "live" / "version_0"
    folder.mkdir(parents=True)
    path = folder / "records.jsonl"
    path.write_text("")
    run_id = "runs/live/version_0"
    _until(lambda client: any(r["id"] == run_id for r in client.get(url + "api/runs").json()))
    delays = []
    for step in range(1, 11):
        with path.open("a") as f:
            f.write(
                json.dumps({"name": "x", "value": float(step), "step": step, "time": time.time()})
                + "\n"
            )
        body = {"runs": [run_id], "names": ["x"], "width": 100}
        delays.append(
            _until(
                lambda client, s=step, b=body: (
                    client.post(url + "api/lines", json=b).json()["points"] == s
                )
            )
        )
    return round(statistics.median(delays), 3)


def write_event_runs(root: Path, runs: int, names: int, steps: int) -> None:
    from tensorboard.compat.proto import event_pb2, summary_pb2
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    for i in range(runs):
        writer = EventFileWriter(str(root / f"run{i:03d}"))
        for s in range(1, steps + 1):
            values = [
                summary_pb2.Summary.Value(tag=f"train/m{j:02d}", simple_value=1.0 / (s + j + i))
                for j in range(names)
            ]
            writer.add_event(
                event_pb2.Event(
                    wall_time=1.7e9 + s, step=s, summary=summary_pb2.Summary(value=values)
                )
            )
        writer.close()


def bench_tensorboard(runs: int, names: int, steps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "tb"
        started = time.perf_counter()
        write_event_runs(root, runs, names, steps)
        _phase("event files written", time.perf_counter() - started)
        tags = [f"train/m{j:02d}" for j in range(names)]
        started = time.perf_counter()
        proc, url = _serve_folder(root)
        try:

            def ours(client: Any) -> bool:
                listed = client.get(url + "api/runs", timeout=60).json()
                if len(listed) < runs or not all(
                    r["loaded"] and not r["pending"] and r["points"] == names * steps
                    for r in listed
                ):
                    return False  # not every point read yet: no series asked for
                for r in listed:
                    for tag in tags:
                        got = client.get(
                            url + "api/scalars", params={"run": r["id"], "name": tag}, timeout=60
                        )
                        if got.status_code != 200 or len(got.json()["step"]) != steps:
                            return False
                return True

            loopbus_s = _timed(
                "loopbus dashboard: every point of every series", started, lambda: _until(ours)
            )
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        port = _free_port()
        started = time.perf_counter()
        board = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tensorboard.main",
                "--logdir",
                str(root),
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        base = f"http://127.0.0.1:{port}/data"
        try:

            def theirs(client: Any) -> bool:
                listed = client.get(base + "/runs", timeout=60).json()
                if len(listed) < runs:
                    return False
                for run in listed:
                    for tag in tags:
                        got = client.get(
                            base + "/plugin/scalars/scalars",
                            params={"run": run, "tag": tag},
                            timeout=60,
                        )
                        if (
                            got.status_code != 200
                            or len(got.json()) == 0
                            or got.json()[-1][1] != steps
                        ):
                            return False
                return True

            tensorboard_s = _timed(
                "tensorboard: its scalars API answers every series", started, lambda: _until(theirs)
            )
            sample = None
            if tensorboard_s is not None:
                sample = len(
                    __import__("httpx")
                    .get(
                        base + "/plugin/scalars/scalars",
                        params={"run": "run000", "tag": tags[0]},
                        timeout=60,
                    )
                    .json()
                )
        finally:
            board.terminate()
            board.wait(timeout=30)
    return {
        "runs": runs,
        "names": names,
        "steps": steps,
        "loopbus_s": None if loopbus_s is None else round(loopbus_s, 2),
        "loopbus_points_per_series": steps,
        "tensorboard_s": None if tensorboard_s is None else round(tensorboard_s, 2),
        "tensorboard_points_per_series": sample,
        "timeout_s": PHASE_TIMEOUT[0],
    }


def _timed(name: str, started: float, wait: Any) -> float | None:
    """Seconds from ``started`` until ``wait()`` returned, printed as a phase; None (and
    a line saying so) when it gave up after ``--timeout`` seconds: a comparison at a
    scale one side cannot serve in time still reports the other."""
    try:
        wait()
    except TimeoutError:
        print(f"  {name}: not within {PHASE_TIMEOUT[0]:.0f} s (--timeout)", file=sys.stderr)
        return None
    return _phase(name, time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--only",
        choices=("cost", "pages", "scale", "tensorboard", "logs"),
        help="one section (default: cost and pages; logs: scale, then tensorboard)",
    )
    parser.add_argument("--runs", type=int, default=200, help="runs (scale)")
    parser.add_argument("--names", type=int, default=20, help="record names (scale, tensorboard)")
    parser.add_argument("--tb-runs", type=int, default=10, help="runs (tensorboard)")
    parser.add_argument("--tb-steps", type=int, default=1000, help="steps (tensorboard)")
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--records", type=int, default=2, help="records put per step")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-pin", dest="pin", action="store_false")
    parser.add_argument("--history", type=int, default=1_000_000, help="records (pages)")
    parser.add_argument("--pages", type=int, default=30, help="pages that never read")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds a phase may take (scale, tensorboard)"
    )
    parser.add_argument("--read", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--clients", type=int, default=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.read:
        read_events(args.read, args.clients)
        return
    PHASE_TIMEOUT[0] = args.timeout
    if args.only in ("scale", "logs"):
        steps = args.steps if args.steps != 3000 else 10_000
        print(f"scale: {args.runs} runs x {args.names} names x {steps} steps", file=sys.stderr)
        print(json.dumps(bench_scale(args.runs, args.names, steps), indent=1), flush=True)
    if args.only in ("tensorboard", "logs"):
        print(
            f"tensorboard: {args.tb_runs} runs x {args.names} names x {args.tb_steps} steps",
            file=sys.stderr,
        )
        tb = bench_tensorboard(args.tb_runs, args.names, args.tb_steps)
        print(json.dumps(tb, indent=1), flush=True)
    if args.only in ("scale", "tensorboard", "logs"):
        return
    if args.only in (None, "pages"):
        pages = bench_pages(args.history, args.pages)
        print(json.dumps(pages, indent=1))
        rss = pages["rss_mib"]
        print(
            f"dashboard with {pages['history_records']} records of history: RSS "
            f"{rss['before']:.0f} MiB, with {args.pages} pages that never read "
            f"{rss['with_pages']:.0f} MiB, after they left {rss['after']:.0f} MiB",
            flush=True,
        )
    if args.only == "pages":
        return
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if args.pin and len(cpus) >= 2:
        OTHERS.update(cpus[1:])
        os.sched_setaffinity(0, {cpus[0]})
    result = bench(args.steps, args.records, args.repeats)
    print(json.dumps(result, indent=1))
    print(
        f"dashboard + 3 SSE readers: training wall time x{result['wall_ratio']:.3f} "
        f"(CPU x{result['cpu_ratio']:.3f}; target <= 1.03), "
        f"{result['step_us']['alone']:.0f} -> {result['step_us']['watched']:.0f} us/step, "
        f"{result['records_shown']}/{result['records_put']} records shown"
    )


if __name__ == "__main__":
    main()
