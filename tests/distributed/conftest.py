"""Fixtures of the distributed tests: a torchft Lighthouse for the fault-tolerance tests,
and every replica group a test started stopped at its end."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from tests.distributed.ft_helpers import STARTED


@pytest.fixture
def lighthouse() -> Iterator[str]:
    """A Lighthouse (``loopbus lighthouse``) that forms quorums of one group or more and
    drops a group silent for a second; its address."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "loopbus",
            "lighthouse",
            "--bind",
            "[::]:0",
            "--min-replicas",
            "1",
            "--join-timeout-ms",
            "300",
            "--quorum-tick-ms",
            "20",
            "--heartbeat-timeout-ms",
            "1000",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        proc.stdout.close()
        assert "listening on http://" in line, line
        yield line.split("listening on ")[1].split()[0]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(autouse=True)
def stop_started_groups() -> Iterator[None]:
    """Each test's groups are stopped at its end: SIGTERM (torchrun passes it on to its
    workers, which it starts in sessions of their own), then SIGKILL."""
    yield
    started = list(STARTED)
    STARTED.clear()
    for proc in started:
        if proc.poll() is None:
            proc.terminate()
    for proc in started:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
