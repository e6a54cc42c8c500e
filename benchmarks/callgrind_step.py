"""What one pre-built training step costs, counted rather than timed.

Two deterministic figures, for the work of ``benchmarks/overhead.py`` (a tiny MLP,
batch 32, one torch thread, SGD, ``put("loss", loss)`` every step, no plugins and no
subscribers) from a list of pre-built batches, yields to the event loop off:

* **instructions per step** counted with callgrind (valgrind), for the hand-written loop
  and for loopbus: each runs N and 3N steps in a process of its own under
  ``valgrind --tool=callgrind`` (address-space randomization off with ``setarch -R``
  where there is one, ``PYTHONHASHSEED=0``), and (I(3N) - I(N)) / 2N cancels the
  start-up (importing torch, building the stage). Both processes build the same 3N
  batches whatever they run;
* **engine lines per step**: the Python lines executed in loopbus's own files
  (``sys.settrace`` line events), over N and 2N steps in this process so start-up
  cancels, with the files they are in.

    python benchmarks/callgrind_step.py                  # N = 300: both figures
    python benchmarks/callgrind_step.py --skip-callgrind # the line count only (seconds)

Under callgrind a run is about 50 times slower than natively, and importing torch
dominates: the four runs take several minutes. ``valgrind`` must be on the ``PATH``.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _batches(count: int) -> list[Any]:
    from overhead import make_loader

    return list(make_loader(32 * count))


def _loop(which: str, backend: str) -> Callable[[list[Any], int], Any]:
    from overhead import hand_written, with_loopbus

    if which == "hand":
        return hand_written
    return lambda data, steps: with_loopbus(
        data, steps, backend, subscribers=False, yield_interval=math.inf
    )


def child(which: str, steps: int, batches: int, backend: str) -> None:
    """One run, in the process callgrind counts: ``steps`` of ``batches`` pre-built.
    Both runs of a pair are handed the same list of ``batches`` (each stops after its
    ``steps``): a list of N batches for one and 3N for the other would leave the
    collector more to traverse in the longer run at each of the collections the start-up
    causes, a cost of the start-up counted as if it were the steps'."""
    data = _batches(batches)
    _loop(which, backend)(data, steps)


def instructions(which: str, steps: int, batches: int, backend: str, valgrind: str) -> int:
    """Instructions callgrind counts for a whole process that runs ``steps`` steps."""
    with tempfile.TemporaryDirectory(prefix="loopbus-callgrind-") as tmp:
        # Address-space randomization moves the start-up's count by up to a few million
        # instructions from one process to the next; without it, by a few hundred.
        setarch = shutil.which("setarch")
        fixed = [setarch, platform.machine(), "-R"] if setarch else []
        command = [
            *fixed,
            valgrind,
            "--tool=callgrind",
            f"--callgrind-out-file={tmp}/callgrind.out",
            sys.executable,
            str(Path(__file__).resolve()),
            "--child", which,
            "--steps", str(steps),
            "--batches", str(batches),
            "--backend", backend,
        ]
        env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"callgrind run failed ({' '.join(command)}):\n{done.stderr}")
        found = re.findall(r"Collected\s*:\s*(\d+)", done.stderr)
        if not found:
            raise SystemExit(f"no 'Collected' line in callgrind's output:\n{done.stderr}")
        return int(found[-1])


def engine_lines(steps: int, backend: str) -> tuple[float, dict[str, float]]:
    """Lines executed in loopbus's files per step, over ``steps`` and 2 x ``steps``
    pre-built steps (after a warm-up run), with the per-file counts per step."""
    import loopbus

    package = str(Path(loopbus.__file__).resolve().parent) + os.sep
    data = _batches(2 * steps)
    run = _loop("engine", backend)

    def count(k: int) -> Counter[str]:
        seen: Counter[str] = Counter()

        def local(frame: Any, event: str, arg: Any) -> Any:
            if event == "line":
                seen[frame.f_code.co_filename] += 1
            return local

        def tracer(frame: Any, event: str, arg: Any) -> Any:
            return local if frame.f_code.co_filename.startswith(package) else None

        sys.settrace(tracer)
        try:
            run(data, k)
        finally:
            sys.settrace(None)
        return seen

    run(data, steps)  # warm up imports and caches
    small, large = count(steps), count(2 * steps)
    per_file = {
        name[len(package) :]: (large[name] - small[name]) / steps
        for name in set(small) | set(large)
        if large[name] != small[name]
    }
    return (sum(large.values()) - sum(small.values())) / steps, per_file


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=300, help="N (default 300)")
    parser.add_argument("--backend", default="asyncio")
    parser.add_argument("--skip-callgrind", action="store_true")
    parser.add_argument("--skip-lines", action="store_true")
    parser.add_argument("--child", choices=["hand", "engine"], help=argparse.SUPPRESS)
    parser.add_argument("--batches", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    if args.child:
        child(args.child, args.steps, args.batches, args.backend)
        return

    import torch

    n = args.steps
    print(
        f"python {sys.version.split()[0]}, torch {torch.__version__}, one torch thread, "
        f"{args.backend}, pre-built batches, put every step, no plugins, yields off"
    )
    if not args.skip_lines:
        lines, per_file = engine_lines(n, args.backend)
        print(f"engine lines executed per step ({n} and {2 * n} steps): {lines:.1f}")
        for name, count in sorted(per_file.items(), key=lambda item: -item[1]):
            print(f"    {count:6.1f}  {name}")
    if not args.skip_callgrind:
        valgrind = shutil.which("valgrind")
        if valgrind is None:
            raise SystemExit("valgrind is not on the PATH; install it, or pass --skip-callgrind")
        per_step: dict[str, float] = {}
        for which in ("hand", "engine"):
            small = instructions(which, n, 3 * n, args.backend, valgrind)
            large = instructions(which, 3 * n, 3 * n, args.backend, valgrind)
            per_step[which] = (large - small) / (2 * n)
            print(
                f"{which:<6} {n} steps: {small} instructions, {3 * n} steps: {large}; "
                f"{per_step[which] / 1e3:.1f} k a step",
                flush=True,
            )
        extra = per_step["engine"] - per_step["hand"]
        print(
            f"instructions per pre-built step: hand-written {per_step['hand'] / 1e3:.0f} k, "
            f"loopbus {per_step['engine'] / 1e3:.0f} k, {extra / 1e3:+.1f} k "
            f"({extra / per_step['hand']:+.1%})"
        )


if __name__ == "__main__":
    main()
