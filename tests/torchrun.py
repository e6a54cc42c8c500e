"""Launching test scripts under ``torchrun`` (gloo, CPU): one place for the launcher, the
environment the workers get, and what the tests read back of a run.

* ``launch(out, *args)``: one real launch of ``tests/distributed/ddp_script.py`` (or another
  script), as a user would start it. Scenarios that kill ranks, restart a job, expect
  the job to fail, or test the launcher itself use it.
* ``Scenarios``: several scenarios of one script in a single launch
  (``tests/scenario_worker.py``), each reported as its own result. Scenarios that train
  to their end and are judged by what they wrote share one launch: the interpreters,
  torch's import and the process group are started once for them all. ``run_once``
  launches once per test session, however many pytest-xdist workers read the results.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock

from tests.helpers import ROOT

DDP_SCRIPT = ROOT / "tests" / "distributed" / "ddp_script.py"
FSDP_SCRIPT = ROOT / "tests" / "distributed" / "fsdp_script.py"
WORKER = ROOT / "tests" / "scenario_worker.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def env(*, tests: bool = False) -> dict[str, str]:
    """This process's environment for a launched job: loopbus's source on the path (and
    the repository's root with ``tests=True``, for a script that imports ``tests``), one
    intra-op thread, and none of the variables a launcher sets for its workers."""
    variables = dict(os.environ)
    paths = [str(ROOT / "src"), *([str(ROOT)] if tests else [])]
    if variables.get("PYTHONPATH"):
        paths.append(variables["PYTHONPATH"])
    variables["PYTHONPATH"] = os.pathsep.join(paths)
    variables["OMP_NUM_THREADS"] = "1"
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        variables.pop(name, None)
    return variables


def torchrun(*launcher: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launcher]


def launch(
    out: Path,
    *args: str,
    nproc: int = 2,
    timeout: float = 120,
    script: Path = DDP_SCRIPT,
) -> subprocess.CompletedProcess[str]:
    """One launch of ``script --out OUT ARGS`` on ``nproc`` local ranks."""
    launcher = [f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]
    cmd = [*torchrun(*launcher, str(script)), "--out", str(out), *args]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)


def ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]


def summary(out: Path, rank: int) -> dict[str, Any]:
    """What ``distributed_script.py`` wrote of rank ``rank``'s run."""
    return json.loads((out / f"summary_rank{rank}.json").read_text())  # type: ignore[no-any-return]


def weights(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"weights_rank{rank}.pt", weights_only=True)  # type: ignore[no-any-return]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Scenarios:
    """Scenarios of one script, declared up front, run in one launch by ``run``.

    Each scenario is an id and the script's arguments; it writes to ``<root>/<id>``
    (passed as ``--out``). ``run`` returns the finished ``Scenarios``; ``out(id)`` is
    then that scenario's folder, or fails the calling test with the scenario's error
    (its traceback, or the launch's output when it never finished).
    """

    def __init__(
        self,
        script: Path,
        scenarios: dict[str, Sequence[str]],
        *,
        nproc: int = 2,
        timeout_s: float = 120,
    ) -> None:
        self.script = script
        self.scenarios = {sid: list(argv) for sid, argv in scenarios.items()}
        self.nproc = nproc
        self.timeout_s = timeout_s
        self.root: Path | None = None
        self.output = ""

    def run(self, root: Path, prepare: Callable[[Path], None] | None = None) -> Scenarios:
        """Launch once and wait for every scenario (``nproc=0``: one plain process).
        ``prepare(root)``, if given, runs first (files a scenario is to find)."""
        self.root = root
        if prepare is not None:
            prepare(root)
        plan = {
            "script": str(self.script),
            "timeout_s": self.timeout_s,
            "scenarios": [
                {"id": sid, "argv": ["--out", str(root / sid), *argv]}
                for sid, argv in self.scenarios.items()
            ],
        }
        plan_path = root / "plan.json"
        plan_path.write_text(json.dumps(plan))
        if self.nproc:
            launcher = [f"--nproc_per_node={self.nproc}", f"--master_port={free_port()}"]
            cmd = torchrun(*launcher, str(WORKER), str(plan_path))
        else:
            cmd = [sys.executable, str(WORKER), str(plan_path)]
        # Every scenario's own deadline, and a margin for the start and the exit.
        deadline = self.timeout_s * len(self.scenarios) + 60
        try:
            proc = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=deadline)
            self.output = proc.stdout[-6000:] + proc.stderr[-10000:]
        except subprocess.TimeoutExpired as error:
            self.output = f"the launch outlived {deadline} s: {error}"
        return self

    def run_once(
        self,
        tmp_path_factory: pytest.TempPathFactory,
        name: str,
        prepare: Callable[[Path], None] | None = None,
    ) -> Scenarios:
        """``run`` once per test session. Under pytest-xdist the first worker to ask
        launches into a folder all the session's workers share (beside their own
        temporary folders) while the others wait for it, then all read that folder: its
        scenarios' results are read, never changed, by the tests."""
        if "PYTEST_XDIST_WORKER" not in os.environ:
            return self.run(tmp_path_factory.mktemp(name), prepare)
        shared = tmp_path_factory.getbasetemp().parent / f"shared-{name}"
        with FileLock(f"{shared}.lock"):
            log = shared / "launch.log"
            if log.exists():
                self.root, self.output = shared, log.read_text()
                return self
            shared.mkdir()
            self.run(shared, prepare)
            log.write_text(self.output)
        return self

    def out(self, sid: str) -> Path:
        """The folder of scenario ``sid``, which finished on every rank."""
        if self.root is None:
            raise RuntimeError("Scenarios.out() before run()")
        if sid not in self.scenarios:
            raise KeyError(f"no scenario {sid!r}: declared are {sorted(self.scenarios)}")
        for rank in range(max(self.nproc, 1)):
            result_file = self.root / f"{sid}.rank{rank}.json"
            if not result_file.exists():
                pytest.fail(
                    f"scenario {sid!r} did not finish on rank {rank} (it timed out, its "
                    f"process died, or a scenario before it failed). The launch's output:\n"
                    f"{self.output}",
                    pytrace=False,
                )
            result = json.loads(result_file.read_text())
            if not result["ok"]:
                pytest.fail(
                    f"scenario {sid!r} failed on rank {rank}:\n{result['error']}", pytrace=False
                )
        return self.root / sid
