"""``loopbus dashboard`` as a command, and what importing the dashboard loads."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers import ROOT

pytestmark = pytest.mark.external

SRC = ROOT / "src" / "loopbus"


def test_the_dashboard_imports_neither_torch_nor_the_engine() -> None:
    # Load the package without its __init__ (which re-exports the engine), the way the
    # command's own process loads only what it needs.
    code = (
        "import importlib.util, sys, pathlib;"
        f"root = pathlib.Path({str(SRC)!r});"
        "spec = importlib.util.spec_from_file_location('loopbus', root / '__init__.py', submodule_search_locations=[str(root)]);"
        "pkg = importlib.util.module_from_spec(spec); sys.modules['loopbus'] = pkg;"
        "import loopbus.dashboard;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(('loopbus.engine', 'loopbus.plugins'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_the_command_serves_the_page_and_follows_a_job(tmp_path: Path) -> None:
    socket_path = tmp_path / "job.sock"
    dashboard = subprocess.Popen(
        [sys.executable, "-m", "loopbus", "dashboard", f"unix://{socket_path}", "--label", "mine"],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    job = None
    try:
        assert dashboard.stderr is not None
        line = dashboard.stderr.readline()
        assert line.startswith("loopbus dashboard: http://127.0.0.1:"), line
        url = line.split()[2]
        assert f"watching unix://{socket_path}" in line
        assert "Ctrl-C stops" in line
        page = httpx.get(url, timeout=10)
        assert page.status_code == 200
        assert "uPlot.iife.min.js" in page.text
        job = subprocess.Popen(
            [sys.executable, "-m", "tests.dashboard.job", f"unix://{socket_path}", "--wait"],
            cwd=ROOT,
        )
        assert job.wait(timeout=120) == 0
        deadline = time.monotonic() + 30
        while True:
            [run] = httpx.get(url + "status", timeout=10).json()["runs"]
            if run["detail"] == "test completed" or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert (run["label"], run["state"], run["detail"]) == (
            "mine",
            "between stages",
            "test completed",
        )
        # 3 epochs of 16 steps: 3 training records per step, 2 validation records per
        # batch (4 batches), 1 test record per batch (4 batches).
        assert run["records"] == 3 * (16 * 3 + 4 * 2) + 4
    finally:
        if job is not None and job.poll() is None:
            job.kill()
        dashboard.terminate()
        dashboard.wait(timeout=15)
        if dashboard.stderr is not None:
            dashboard.stderr.close()


def test_the_command_refuses_a_public_page_without_a_token() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "loopbus", "dashboard", "tcp://127.0.0.1:9", "--host", "0.0.0.0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "anyone who can reach '0.0.0.0'" in result.stderr
    assert "--web-token" in result.stderr
