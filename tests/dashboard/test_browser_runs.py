"""The runs page in a real (headless) Chromium: a folder of finished runs written by the
CSV, JSONL and TensorBoard loggers and one live job, side by side; the view in the URL;
the CSV download; and the exported report, offline."""

from __future__ import annotations

import csv
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loopbus.plugins.loggers import read_csv, read_jsonl
from tests.dashboard.runs import write_runs
from tests.dashboard.test_browser import _chromium, pytestmark  # noqa: F401
from tests.helpers import ROOT

ARGS = ["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync"]
FINISHED = ["runs/csv/version_0", "runs/jsonl/version_0", "runs/tb/version_0"]


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, Path, Path]]:
    """The logged runs under ``tmp_path/runs`` and a dashboard over them and one job's
    address: ``(url, runs folder, job's socket)``."""
    runs = tmp_path / "runs"
    write_runs(runs)
    socket = tmp_path / "job.sock"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "loopbus",
            "dashboard",
            str(runs),
            f"unix://{socket}",
            "--label",
            "live",
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert line.startswith("loopbus dashboard: http://"), line
        yield line.split()[2], runs, socket
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        if proc.stderr is not None:
            proc.stderr.close()


def _series(page: Any, name: str) -> int:
    return int(page.get_attribute(f".chart[data-name='{name}']", "data-series") or 0)


def _logged(runs: Path) -> dict[str, list[tuple[int, float, float]]]:
    """train/loss of the CSV and JSONL runs, as logged: (step, wall time, value)."""
    jsonl = read_jsonl(runs / "jsonl" / "version_0" / "records.jsonl")
    rows = read_csv(runs / "csv" / "version_0" / "metrics.csv")
    return {
        "runs/jsonl/version_0": [
            (r.step, r.time, r.value) for r in jsonl if r.name == "train/loss"
        ],
        "runs/csv/version_0": [
            (int(r["step"]), float(r["time"]), float(r["train/loss"]))
            for r in rows
            if "train/loss" in r
        ],
    }


def test_finished_runs_and_a_live_job_side_by_side(
    served: tuple[str, Path, Path], tmp_path: Path
) -> None:
    from playwright import sync_api

    url, runs, socket = served
    errors: list[str] = []
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.dashboard.job",
            f"unix://{socket}",
            "--epochs",
            "3",
            "--delay",
            "0.02",
            "--wait",
            "--root",
            str(tmp_path / "live"),
        ],
        cwd=ROOT,
    )
    try:
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=_chromium(), args=ARGS)
            try:
                page = browser.new_page(
                    viewport={"width": 1280, "height": 1000}, accept_downloads=True
                )
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.goto(url)
                # Every run listed; a chart of a record name holds one series per run.
                page.wait_for_function(
                    "document.querySelectorAll('#runs tbody tr').length === 4", timeout=60_000
                )
                listed = page.eval_on_selector_all(
                    "#runs tbody tr", "rs => rs.map(r => r.dataset.run)"
                )
                assert sorted(listed) == sorted([*FINISHED, "live"])
                page.wait_for_function(
                    "document.querySelector('.chart[data-name=\"train/loss\"]')?.dataset.series === '4'",
                    timeout=90_000,
                )
                assert _series(page, "val/loss") in (3, 4)
                assert page.locator("#connection.live").count() == 1
                # The lr and seed differ between the runs: columns of the table.
                headers = page.eval_on_selector_all("#runs th", "hs => hs.map(h => h.textContent)")
                assert "model.init_args.lr" in headers
                assert "model.init_args.seed" in headers

                # A regular expression in the URL hides the other runs.
                page.goto(url + "#runs=jsonl%7Ccsv")
                page.wait_for_function(
                    "document.querySelector('.chart[data-name=\"train/loss\"]')?.dataset.series === '2'",
                    timeout=30_000,
                )
                assert page.input_value("#run-filter") == "jsonl|csv"
                assert page.locator("#runs tbody tr:not(.filtered)").count() == 2

                # The x axis switches to wall time (and the URL says so).
                page.select_option("#x-axis", "wall")
                page.wait_for_function(
                    "(() => { const c = loopbusDashboard.state.charts.get('train/loss');"
                    " return c.plot && c.plot.scales.x.time && c.answer.x[0] > 1e9; })()",
                    timeout=30_000,
                )
                assert "x=wall" in page.evaluate("location.hash")

                # The chart's CSV is the logged values, exactly.
                with page.expect_download() as download:
                    page.click(".chart[data-name='train/loss'] button.csv")
                with open(download.value.path(), newline="") as f:
                    rows = list(csv.reader(f))
                assert rows[0] == ["run", "name", "step", "wall_time", "value"]
                got: dict[str, list[tuple[int, float, float]]] = {}
                for run, name, step, t, value in rows[1:]:
                    assert name == "train/loss"
                    got.setdefault(run, []).append((int(step), float(t), float(value)))
                assert got == _logged(runs)
                page.screenshot(path=str(tmp_path / "runs.png"), full_page=True)
            finally:
                browser.close()
        assert job.wait(timeout=120) == 0
    finally:
        if job.poll() is None:
            job.kill()
    assert errors == []


def test_the_exported_report_opens_offline_and_draws(tmp_path: Path) -> None:
    from playwright import sync_api

    runs = tmp_path / "runs"
    write_runs(runs)
    report = tmp_path / "report.html"
    result = subprocess.run(
        [sys.executable, "-m", "loopbus", "dashboard", str(runs), "--export", str(report)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stderr
    errors: list[str] = []
    requests: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=_chromium(), args=ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("request", lambda r: requests.append(r.url))
            page.goto(report.as_uri() + "#names=loss")
            page.wait_for_function(
                "document.querySelector('.chart[data-name=\"train/loss\"]')?.dataset.series === '3'"
                " && document.querySelector('.chart[data-name=\"train/loss\"] canvas')",
                timeout=30_000,
            )
            assert page.locator(".chart:not(.hidden)").count() == 2  # train/loss, val/loss
            assert (
                sorted(
                    page.eval_on_selector_all("#runs tbody tr", "rs => rs.map(r => r.dataset.run)")
                )
                == FINISHED
            )
            points = int(page.get_attribute(".chart[data-name='train/loss']", "data-points") or 0)
            assert points == sum(len(v) for v in _logged(runs).values()) + 8  # + the TB run's
            # Smoothing: of every point of each run, offline too.
            page.eval_on_selector(
                "#smoothing", "e => { e.value = 0.6; e.dispatchEvent(new Event('input')); }"
            )
            page.wait_for_function(
                "(() => { const a = loopbusDashboard.state.charts.get('train/loss').answer;"
                " return a.smoothing === 0.6 && a.s.length === 3"
                " && a.s.every((s, i) => s.length === a.y[i].length); })()",
                timeout=30_000,
            )
            legend = page.locator(".chart[data-name='train/loss'] .u-legend").inner_text()
            assert "(raw)" in legend
        finally:
            browser.close()
    assert requests == [report.as_uri() + "#names=loss"] or all(
        r.startswith(report.as_uri()) for r in requests
    ), requests
    assert errors == []
