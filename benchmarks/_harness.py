"""What several benchmark scripts share: the clock runs are timed with, one timed run,
the count of Python calls a run makes, and launching a script under ``torchrun``.

The scripts run from this folder (``./dev bench NAME`` or ``python benchmarks/NAME.py``),
which Python puts first on the import path, so they import this module by its name.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

#: The clock runs are timed with: wall time (default), or with a script's ``--clock cpu``
#: the process's CPU time, which on a machine busy with other jobs leaves out the time
#: spent waiting for a core. A script that offers the choice sets ``CLOCK[0]``.
CLOCK: list[Callable[[], float]] = [time.perf_counter]


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` takes by :data:`CLOCK`."""
    clock = CLOCK[0]
    start = clock()
    fn()
    return clock() - start


def count_calls(fn: Callable[[], Any]) -> int:
    """Python-level calls (``call`` and ``c_call`` profile events) ``fn()`` makes on this
    thread: the deterministic figure the wall-time ratios are paired with."""
    n = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal n
        if event == "call" or event == "c_call":
            n += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return n


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch_env(src: str | None = None) -> dict[str, str]:
    """This process's environment for a process a benchmark launches (under ``torchrun``
    or not): one torch thread (per rank), none of a surrounding launch's rank variables,
    and ``src`` (if given) first on ``PYTHONPATH``."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    if src is not None:
        path = env.get("PYTHONPATH")
        env["PYTHONPATH"] = os.pathsep.join([src, path]) if path else src
    return env


def torchrun(nproc: int) -> list[str]:
    """The command that starts ``torch.distributed.run`` with ``nproc`` ranks on a free
    port; append the script and its arguments."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={free_port()}",
    ]
