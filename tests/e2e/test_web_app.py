"""The example web app (examples/web_app.py), served by uvicorn in a subprocess on a free
loopback port: runs over HTTP, records over Server-Sent Events, cancellation, and the
live page (the loopbus dashboard's, with the app's form above it) in a real (headless)
Chromium."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

EXAMPLES = ROOT / "examples"
#: Batches per epoch of the digits example: 80 % of 1797 images in batches of 64.
BATCHES_PER_EPOCH = 23


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log_path = tmp_path_factory.mktemp("web_app") / "server.log"
    for _attempt in range(3):
        port = _free_port()
        base = f"http://127.0.0.1:{port}"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "uvicorn",
                    "web_app:app",
                    "--app-dir",
                    str(EXAMPLES),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--log-level",
                    "warning",
                ],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                httpx.get(f"{base}/runs", timeout=2).raise_for_status()
                break
            except httpx.TransportError:
                time.sleep(0.1)
        if proc.poll() is None:
            break
        # Exited: most likely the port was taken between probing and binding; retry.
    else:
        pytest.fail(f"the web app did not start:\n{log_path.read_text()}")
    if time.monotonic() >= deadline:
        proc.kill()
        pytest.fail(f"the web app did not answer within 90 s:\n{log_path.read_text()}")
    try:
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _start(base: str, **config: Any) -> dict[str, Any]:
    response = httpx.post(f"{base}/runs", json=config, timeout=10)
    assert response.status_code == 201, response.text
    run: dict[str, Any] = response.json()
    assert response.headers["location"] == f"/runs/{run['id']}"
    return run


def _state(base: str, run_id: str) -> dict[str, Any]:
    response = httpx.get(f"{base}/runs/{run_id}", timeout=10)
    response.raise_for_status()
    state: dict[str, Any] = response.json()
    return state


def _events(
    base: str, run_id: str, headers: dict[str, str] | None = None, timeout: float = 90
) -> tuple[list[tuple[int, dict[str, Any]]], dict[str, Any]]:
    """Read a run's event stream to its end: ([(id, record), ...], final state)."""
    records: list[tuple[int, dict[str, Any]]] = []
    url = f"{base}/runs/{run_id}/events"
    with httpx.stream("GET", url, headers=headers, timeout=timeout) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        fields: dict[str, str] = {}
        for line in response.iter_lines():
            if line.startswith(":"):
                continue
            if line:
                key, _, value = line.partition(": ")
                fields[key] = value
                continue
            if fields.get("event") == "end":
                return records, json.loads(fields["data"])
            records.append((int(fields["id"]), json.loads(fields["data"])))
            fields = {}
    raise AssertionError("the event stream closed without an end event")


def _wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def test_a_run_streams_its_records_until_it_ends(server: str) -> None:
    run = _start(server, epochs=3, seed=1)
    records, end = _events(server, run["id"])

    assert end["state"] == "completed"
    assert end["step"] == 3 * BATCHES_PER_EPOCH
    assert [i for i, _ in records] == list(range(len(records)))
    names = [r["name"] for _, r in records]
    assert names.count("train/loss") == 3 * BATCHES_PER_EPOCH
    assert names.count("val/acc") == 3
    assert all(r["type"] == "PutRecord" and r["source"] == "DigitsNet" for _, r in records)
    steps = [r["step"] for _, r in records]
    assert steps == sorted(steps)
    assert 0.5 < end["latest"]["val/acc"] <= 1.0
    assert _state(server, run["id"])["records"] == len(records)
    assert end["dropped"] == 0

    # A client that reconnects with Last-Event-ID gets the rest, not the start again.
    rest, end_again = _events(server, run["id"], headers={"Last-Event-ID": "9"})
    assert [i for i, _ in rest] == list(range(10, len(records)))
    assert end_again["state"] == "completed"


def test_cancelling_a_run_while_the_api_keeps_answering(server: str) -> None:
    run = _start(server, epochs=5000)
    _wait_for(lambda: _state(server, run["id"])["step"] > 0, 60, "the run to train")

    # While it trains, requests are answered and the run keeps going: the answers come from
    # several points of the run. (How quickly they come is benchmarks/lag.py's figure.)
    steps: set[int] = set()

    def answered_at_a_third_step() -> bool:
        state = _state(server, run["id"])
        assert state["state"] == "running"
        steps.add(state["step"])
        return len(steps) >= 3

    _wait_for(answered_at_a_third_step, 60, "answers from three points of the run")

    response = httpx.delete(f"{server}/runs/{run['id']}", timeout=10)
    assert response.status_code == 202
    assert response.json()["state"] in ("cancelling", "cancelled")
    _wait_for(lambda: _state(server, run["id"])["state"] == "cancelled", 15, "the cancellation")
    final = _state(server, run["id"])
    assert final["step"] < 5000 * BATCHES_PER_EPOCH
    assert final["ended"] is not None
    time.sleep(0.2)
    assert _state(server, run["id"])["step"] == final["step"]  # it really stopped
    records, end = _events(server, run["id"])
    assert end["state"] == "cancelled"
    assert len(records) == final["records"]
    # Cancelling a finished run changes nothing.
    again = httpx.delete(f"{server}/runs/{run['id']}", timeout=10)
    assert again.status_code == 200
    assert again.json()["state"] == "cancelled"


def test_a_graceful_stop_over_http(server: str) -> None:
    run = _start(server, epochs=5000, executor="inline")
    _wait_for(lambda: _state(server, run["id"])["step"] > 0, 60, "the run to train")
    response = httpx.delete(f"{server}/runs/{run['id']}", params={"graceful": "1"}, timeout=10)
    assert response.status_code == 202
    _wait_for(lambda: _state(server, run["id"])["state"] == "stopped", 15, "the stop")


def test_bad_requests_get_clear_errors(server: str) -> None:
    bad = httpx.post(f"{server}/runs", json={"epochs": 0}, timeout=10)
    assert bad.status_code == 422
    assert "epochs" in bad.json()["error"]
    unknown = httpx.post(f"{server}/runs", json={"epoch": 3}, timeout=10)
    assert unknown.status_code == 422
    assert "unknown field `epoch`" in unknown.json()["error"]
    garbled = httpx.post(f"{server}/runs", content=b"{epochs", timeout=10)
    assert garbled.status_code == 400
    missing = httpx.get(f"{server}/runs/nope", timeout=10)
    assert missing.status_code == 404
    assert "nope" in missing.json()["error"]


async def test_a_failing_run_is_reported_and_the_others_go_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """In process: a run that fails ends as "failed" with its error, next to a run that
    completes, and the app's task group (the service) is not disturbed."""
    import anyio

    monkeypatch.syspath_prepend(str(EXAMPLES))
    web_app = importlib.import_module("web_app")
    build = web_app.Run._build

    def broken_build(self: Any) -> Any:
        if self.config.seed == 13:
            raise RuntimeError("no data today")
        return build(self)

    monkeypatch.setattr(web_app.Run, "_build", broken_build)
    from loopbus.dashboard import Hub

    hub = Hub()
    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            runs = web_app.Runs(tg, hub)
            bad = runs.start(web_app.RunConfig(epochs=1, seed=13))
            good = runs.start(web_app.RunConfig(epochs=1, executor="inline"))
            for run in (bad, good):
                async for _ in run.follow(0):
                    pass
    assert bad.state == "failed"
    assert bad.error == "RuntimeError: no data today"
    assert good.state == "completed"
    assert good.info()["step"] == BATCHES_PER_EPOCH

    # Both are series of the app's dashboard, labelled with their ids, in their end state.
    assert [feed.label for feed in hub.runs] == [bad.id, good.id]
    assert (bad.feed.state, bad.feed.detail) == ("failed", "RuntimeError: no data today")
    assert (good.feed.state, good.feed.detail) == ("ended", "completed")
    assert good.feed.records == len(good.log)
    assert hub.flush() == len(good.log)
    _, messages = hub.read(0)
    (message,) = messages
    parts = {part["run"]: part for part in json.loads(message)["parts"]}
    assert [m["kind"] for m in parts[bad.feed.index]["markers"]] == ["stage"]
    part = parts[good.feed.index]
    steps, values = part["records"]["train/loss"]
    assert steps == list(range(1, BATCHES_PER_EPOCH + 1))
    assert values == [json.loads(r)["value"] for r in good.log if b"train/loss" in r]
    kinds = [(m["kind"], m["step"]) for m in part["markers"]]
    assert kinds == [("epoch", BATCHES_PER_EPOCH), ("stage", BATCHES_PER_EPOCH)]


# ---------------------------------------------------------------- a real browser
def _chromium() -> str | None:
    configured = os.environ.get("LOOPBUS_CHROMIUM")
    if configured:
        return configured
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.mark.external
@pytest.mark.skipif(
    _chromium() is None, reason="Chromium is not installed (Debian: apt-get install chromium)"
)
@pytest.mark.skipif(
    importlib.util.find_spec("playwright") is None,
    reason="Playwright is not installed (pip install playwright; it drives the installed "
    "Chromium, no browser download needed)",
)
def test_the_page_starts_a_run_and_charts_it_live_in_a_browser(server: str, tmp_path: Path) -> None:
    """The page is the dashboard's: its form starts a run, every record name of the run
    gets a chart whose points grow while it trains, and the cancel button stops it."""
    from playwright import sync_api

    executable = _chromium()
    assert executable is not None

    errors: list[str] = []
    run_id = ""
    try:
        with sync_api.sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=executable,
                args=[
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    "--no-first-run",
                ],
            )
            try:
                page = browser.new_page(viewport={"width": 1280, "height": 900})
                page.on("pageerror", lambda exc: errors.append(str(exc)))
                page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
                page.goto(f"{server}/")
                page.wait_for_selector("#connection.live", timeout=30_000)
                # The form sits above the charts, and starts a run.
                assert page.locator("#start + script ~ #runs").count() == 1
                page.fill("#start input[name=epochs]", "2000")
                page.click("#start button[type=submit]")
                page.wait_for_function(
                    "document.querySelector('#start-result').dataset.run", timeout=10_000
                )
                run_id = page.get_attribute("#start-result", "data-run") or ""
                assert _state(server, run_id)["config"]["epochs"] == 2000
                # The server is shared with the tests above: the run is one row of several.
                row = f"#runs tr:has(td:text-is('{run_id}'))"
                page.wait_for_selector(row, timeout=10_000)

                # Points appear while the run trains, on a chart per record name.
                page.wait_for_function(
                    "Number(document.querySelector('.chart[data-name=\"train/loss\"]')"
                    "?.dataset.points) > 10 && Number(document.querySelector("
                    "'.chart[data-name=\"val/acc\"]')?.dataset.points) > 0",
                    timeout=60_000,
                )
                chart = ".chart[data-name='train/loss']"
                before = int(page.get_attribute(chart, "data-points") or 0)
                page.wait_for_function(
                    f'Number(document.querySelector("{chart}").dataset.points) > {before}',
                    timeout=30_000,
                )
                names = page.eval_on_selector_all(
                    ".chart[data-name]", "nodes => nodes.map((n) => n.dataset.name)"
                )
                # The charts so far may be the earlier runs' (the server is shared): on a
                # busy machine this run may not have validated yet. Once it has put every
                # name, each has its chart and there is no other.
                _wait_for(
                    lambda: set(_state(server, run_id)["latest"]) >= set(names), 60, "validation"
                )
                state = _state(server, run_id)
                assert state["state"] == "running"
                assert sorted(names) == sorted(state["latest"])
                assert page.locator(f"{chart} canvas").count() == 1
                assert page.get_attribute(row, "data-state") == "connected"

                # The run's cancel button cancels it; the table follows.
                page.click(f"#cancel button:text-is('cancel {run_id}')")
                _wait_for(
                    lambda: _state(server, run_id)["state"] == "cancelled", 15, "the cancellation"
                )
                page.wait_for_selector(f"{row}[data-state=ended]", timeout=10_000)
                assert page.locator("#cancel button").count() == 0
                screenshot = tmp_path / "web_app.png"
                page.screenshot(path=str(screenshot), full_page=True)
                assert screenshot.stat().st_size > 1000
            finally:
                browser.close()
    finally:
        if run_id:
            httpx.delete(f"{server}/runs/{run_id}", timeout=10)
    assert errors == []
