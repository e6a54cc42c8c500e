"""The dashboard page in a real (headless) Chromium, watching a job that trains in
another process: points appear while it trains, every record name gets a chart in its
group, the page survives the change from fit to test and the end of the job."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ROOT


def _chromium() -> str | None:
    configured = os.environ.get("LOOPBUS_CHROMIUM")
    if configured:
        return configured
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


pytestmark = [
    pytest.mark.external,
    pytest.mark.skipif(
        _chromium() is None, reason="Chromium is not installed (Debian: apt-get install chromium)"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("playwright") is None,
        reason="Playwright is not installed (pip install playwright; it drives the installed "
        "Chromium, no browser download needed)",
    ),
    pytest.mark.slow,
]

#: What tests/dashboard/job.py puts, by group.
NAMES = {
    "train": ["train/acc", "train/loss"],
    "val": ["val/acc", "val/loss"],
    "test": ["test/loss"],
    "other": ["lr"],
}


@pytest.fixture
def dashboard(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    address = tmp_path / "job.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "loopbus", "dashboard", f"unix://{address}", "--label", "job"],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()
        assert line.startswith("loopbus dashboard: http://"), line
        yield line.split()[2], address
    finally:
        proc.terminate()
        proc.wait(timeout=15)
        if proc.stderr is not None:
            proc.stderr.close()


def test_the_page_charts_a_job_live_through_fit_and_test(
    dashboard: tuple[str, Path], tmp_path: Path
) -> None:
    from playwright import sync_api

    url, address = dashboard
    executable = _chromium()
    assert executable is not None
    errors: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=executable,
            args=["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync"],
        )
        job = None
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.goto(url)
            page.wait_for_selector("#runs tr[data-state=waiting]", timeout=30_000)
            job = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.dashboard.job",
                    f"unix://{address}",
                    "--epochs",
                    "4",
                    "--delay",
                    "0.05",
                    "--wait",
                ],
                cwd=ROOT,
            )
            # Points appear while the job trains.
            page.wait_for_function(
                "Number(document.querySelector('.chart[data-name=\"train/loss\"]')"
                "?.dataset.points) > 5",
                timeout=60_000,
            )
            assert job.poll() is None, "the job ended before the page showed its points"
            assert page.locator(".chart[data-name='train/loss'] canvas").count() == 1
            assert page.get_attribute("#runs tr[data-run='job']", "data-state") == "connected"

            # The job goes through fit and test, then ends; the page follows.
            assert job.wait(timeout=120) == 0
            page.wait_for_function(
                "document.querySelector('#runs tr[data-run=\"job\"] td:nth-child(3)')"
                ".textContent.includes('test completed')",
                timeout=30_000,
            )
            page.wait_for_timeout(600)  # a redraw
            for group, names in NAMES.items():
                section = page.locator(f"section.group[data-group='{group}']")
                assert section.count() == 1, group
                shown = section.locator(".chart").evaluate_all("cs => cs.map(c => c.dataset.name)")
                assert shown == names
            # 4 epochs of 16 steps, 4 validation batches per epoch, 4 test batches.
            expected = {
                "train/acc": 64,
                "train/loss": 64,
                "lr": 64,
                "val/acc": 16,
                "val/loss": 16,
                "test/loss": 4,
            }
            for name, count in expected.items():  # a chart loads once on screen
                chart = f".chart[data-name='{name}']"
                page.locator(chart).scroll_into_view_if_needed()
                page.wait_for_function(
                    f"document.querySelector(\"{chart}\").dataset.points === '{count}'",
                    timeout=30_000,
                )
            epochs = page.evaluate(
                "loopbusDashboard.state.charts.get('train/loss').markers"
                ".filter((m) => m.kind === 'epoch').length"
            )
            assert epochs == 4
            assert page.locator("canvas").count() == 6
            # The options redraw every chart.
            page.eval_on_selector(
                "#smoothing", "e => { e.value = 0.8; e.dispatchEvent(new Event('input')); }"
            )
            page.check("#log-scale")
            page.fill("#filter", "loss")
            page.wait_for_timeout(400)
            assert page.locator(".chart:not(.hidden)").count() == 3
            legend = page.locator(".chart[data-name='train/loss'] .u-legend").inner_text()
            assert "job (raw)" in legend
            page.screenshot(path=str(tmp_path / "dashboard.png"), full_page=True)
            assert page.text_content("#connection") == "live"
        finally:
            if job is not None and job.poll() is None:
                job.kill()
            browser.close()
    assert errors == []
