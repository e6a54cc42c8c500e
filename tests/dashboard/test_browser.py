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
            assert page.get_attribute("#runs tr[data-run='0']", "data-state") == "connected"

            # The job goes through fit and test, then ends; the page follows.
            assert job.wait(timeout=120) == 0
            page.wait_for_function("document.body.dataset.stages === '2'", timeout=30_000)
            page.wait_for_function(
                "document.querySelector('#runs tr[data-run=\"0\"] td:nth-child(4)')"
                ".textContent.startsWith('test completed')",
                timeout=30_000,
            )
            page.wait_for_timeout(600)  # a redraw
            for group, names in NAMES.items():
                section = page.locator(f"section.group[data-group='{group}']")
                assert section.count() == 1, group
                shown = section.locator(".chart").evaluate_all("cs => cs.map(c => c.dataset.name)")
                assert shown == names
            points = {
                name: int(page.get_attribute(f".chart[data-name='{name}']", "data-points") or 0)
                for names in NAMES.values()
                for name in names
            }
            # 4 epochs of 16 steps, 4 validation batches per epoch, 4 test batches.
            assert points == {
                "train/acc": 64,
                "train/loss": 64,
                "lr": 64,
                "val/acc": 16,
                "val/loss": 16,
                "test/loss": 4,
            }
            assert page.evaluate("document.body.dataset.epochs") == "4"
            assert page.evaluate("document.body.dataset.gaps") == "0"
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


#: Epochs of the dense-marker case: a run of many short epochs (2 steps each).
DENSE_EPOCHS = 3000


def _dense_events() -> str:
    """The dashboard's event stream for one ended run of ``DENSE_EPOCHS`` two-step epochs:
    a status, then one data message with a loss per step and an epoch-end marker per
    epoch (the format of ``loopbus/dashboard/_hub.py``)."""
    import json

    steps = list(range(1, 2 * DENSE_EPOCHS + 1))
    status = {
        "runs": [
            {
                "run": 0,
                "label": "job",
                "address": "unix:///job.sock",
                "state": "ended",
                "detail": "fit completed",
                "stage": "fit",
                "step": steps[-1],
                "epoch": DENSE_EPOCHS - 1,
                "records": len(steps),
                "gaps": 0,
            }
        ],
        "time": 0.0,
        "started": 1.0,
    }
    data = {
        "id": 1,
        "parts": [
            {
                "run": 0,
                "records": {"train/loss": [steps, [1.0 / s**0.5 for s in steps]]},
                "markers": [
                    {"kind": "epoch", "step": 2 * (e + 1), "label": f"epoch {e}"}
                    for e in range(DENSE_EPOCHS)
                ],
            }
        ],
    }
    return f"event: status\ndata: {json.dumps(status)}\n\nevent: data\ndata: {json.dumps(data)}\n\n"


#: The share of a chart's plot area that epoch markers (#8c959f) cover.
_MARKER_COVERAGE = """(chart) => {
  const canvas = chart.querySelector("canvas");
  const u = window.loopbusDashboard.state.charts.get(chart.dataset.name).plot;
  const { left, top, width, height } = u.bbox;
  const pixels = canvas.getContext("2d").getImageData(left, top, width, height).data;
  let grey = 0;
  for (let i = 0; i < pixels.length; i += 4) {
    const [r, g, b, a] = [pixels[i], pixels[i + 1], pixels[i + 2], pixels[i + 3]];
    if (a > 0 && Math.abs(r - 140) < 24 && Math.abs(g - 149) < 24 && Math.abs(b - 159) < 24) grey++;
  }
  return grey / (width * height);
}"""


def test_dense_epoch_markers_thin_out_and_charts_use_the_page_width(
    dashboard: tuple[str, Path], tmp_path: Path
) -> None:
    """3,000 short epochs on a 1,400 px wide page: the epoch-end markers must not cover
    the chart (they thin out when closer than a few pixels), and a group's only chart
    spans the page's width rather than a third of it."""
    from playwright import sync_api

    url, _ = dashboard
    served: list[str] = []

    def events(route: sync_api.Route) -> None:
        if served:  # the stream once; then 204, which stops the page reconnecting
            route.fulfill(status=204)
            return
        served.append(route.request.url)
        route.fulfill(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
            body=_dense_events(),
        )

    errors: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=_chromium(),
            args=["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync"],
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.route("**/events", events)
            page.goto(url)
            page.wait_for_function(
                "Number(document.querySelector('.chart[data-name=\"train/loss\"]')"
                "?.dataset.points) === 6000",
                timeout=30_000,
            )
            page.wait_for_timeout(600)  # a redraw
            assert page.evaluate("document.body.dataset.epochs") == str(DENSE_EPOCHS)
            chart = page.locator(".chart[data-name='train/loss']")
            coverage = chart.evaluate(_MARKER_COVERAGE)
            page.screenshot(path=str(tmp_path / "dense.png"), full_page=True)
            # Drawn for every epoch, the dashed markers fill half the plot area (a grey
            # band); thinned to a few pixels apart, a small share.
            assert coverage < 0.15, f"epoch markers cover {coverage:.0%} of the chart"
            drawn = int(chart.get_attribute("data-epoch-markers") or -1)
            assert 0 < drawn < DENSE_EPOCHS
            main = page.locator("#groups").bounding_box()
            box = chart.locator("canvas").bounding_box()
            assert main is not None
            assert box is not None
            assert box["width"] > 0.9 * main["width"], (box, main)
        finally:
            browser.close()
    assert errors == []


def _chunked_history() -> tuple[list[bytes], int]:
    """The event stream a page gets from a hub with a long history, as the chunks the
    hub hands its connection, and the records per name in it."""
    from loopbus.dashboard import Hub

    hub = Hub(chunk_bytes=4096)
    run = hub.add_run("job", "unix:///job.sock")
    run.started("fit", 0, 0)
    for flush in range(200):
        for i in range(25):
            step = flush * 25 + i
            run.record("train/loss", 1.0 / (step + 1), step, 0)
            run.record("val/loss", 2.0 / (step + 1), step, 0)
        run.epoch_ended(flush, flush * 25 + 24)
        hub.flush()
    page = hub.open_page(0)
    chunks = []
    while (chunk := page.next_chunk()) is not None:
        chunks.append(chunk)
        page.written()
    hub.close_page(page)
    return chunks, 200 * 25


def test_a_long_history_in_many_chunks_fills_the_charts(dashboard: tuple[str, Path]) -> None:
    """The history arrives in bounded chunks, each with whole messages: the page charts
    every record and marker of it."""
    from playwright import sync_api

    url, _ = dashboard
    chunks, per_name = _chunked_history()
    assert len(chunks) > 20
    served: list[str] = []

    def events(route: sync_api.Route) -> None:
        if served:  # the stream once; then 204, which stops the page reconnecting
            route.fulfill(status=204)
            return
        served.append(route.request.url)
        route.fulfill(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
            body=b"".join(chunks),
        )

    errors: list[str] = []
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=_chromium(),
            args=["--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync"],
        )
        try:
            page = browser.new_page()
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.route("**/events", events)
            page.goto(url)
            page.wait_for_function(
                f"document.body.dataset.records === '{2 * per_name}'", timeout=30_000
            )
            for name in ("train/loss", "val/loss"):
                chart = page.locator(f".chart[data-name='{name}']")
                assert chart.get_attribute("data-points") == str(per_name)
            assert page.evaluate("document.body.dataset.epochs") == "200"
        finally:
            browser.close()
    assert errors == []
