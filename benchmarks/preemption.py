"""Preemption: the time from SIGTERM to the process's exit, on the preemption tests'
small model (``tests/stage/_preempt_script.py``: an MLP, batches of 8, windows of 3, a
``Checkpoint`` plus CSV and JSONL loggers), in one process and under ``torchrun`` (two
gloo ranks, the signal sent to the agent).

The signal lands while a known batch runs; the figure is split into: signal to
``PreemptionRequested`` (the stop taking effect at the next step boundary), to
``Teardown`` (the checkpoint written, the loggers flushed), to the exit of the process
(interpreter and, under torchrun, the agent's shutdown). Medians over ``--repeats`` runs.
For reference, the exit of a bare process that imported torch and loopbus and leaves
on SIGTERM through ``sys.exit``: what a clean Python exit costs on this machine.

    python benchmarks/preemption.py                 # one process and torchrun
    python benchmarks/preemption.py --repeats 5 --no-torchrun
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import launch_env, torchrun

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "engine" / "_preempt_script.py"


def once(under_torchrun: bool) -> tuple[float, float, float]:
    """(signal -> PreemptionRequested, -> Teardown, -> exit), in seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        script = [str(SCRIPT), "--dir", str(directory), "--wait-at", "1:7"]
        cmd = [*(torchrun(2) if under_torchrun else [sys.executable]), *script]
        proc = subprocess.Popen(
            cmd,
            env=launch_env(str(ROOT / "src")),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        while not (directory / "ready").exists():
            if proc.poll() is not None:
                raise SystemExit(f"the run ended early: {cmd}")
            time.sleep(0.005)
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        ended = time.time()
        events = json.loads((directory / "events_rank0.json").read_text())
        if proc.returncode == 0 or events[0]["event"] != "PreemptionRequested":
            raise SystemExit(f"not preempted as expected: rc={proc.returncode} {events}")
        return events[0]["time"] - sent, events[-1]["time"] - sent, ended - sent


_BARE = """
import signal, sys, time
from pathlib import Path
import torch, loopbus.plugins
signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
Path(sys.argv[1], "ready").write_text("")
while True:
    time.sleep(0.001)
"""


def bare_exit() -> float:
    """Signal to exit of a process that imported torch and loopbus and leaves on SIGTERM
    through ``sys.exit``: the interpreter's own clean exit, which every figure includes."""
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([sys.executable, "-c", _BARE, tmp], env=launch_env(str(ROOT / "src")))
        while not Path(tmp, "ready").exists():
            time.sleep(0.005)
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        return time.time() - sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-torchrun", action="store_true")
    args = parser.parse_args()
    cases = [False] if args.no_torchrun else [False, True]
    print("signal -> PreemptionRequested / Teardown / exit (medians, ms)")
    bare = statistics.median(bare_exit() for _ in range(args.repeats)) * 1000
    print(f"{'bare python+torch exit':24s} {'':7s} / {'':7s} / {bare:7.1f}")
    for under_torchrun in cases:
        runs = [once(under_torchrun) for _ in range(args.repeats)]
        medians = [statistics.median(r[i] for r in runs) * 1000 for i in range(3)]
        name = "torchrun, 2 gloo ranks" if under_torchrun else "one process"
        print(f"{name:24s} {medians[0]:7.1f} / {medians[1]:7.1f} / {medians[2]:7.1f}")


if __name__ == "__main__":
    main()
