"""The dashboard's web side in process: the event stream (status, data with ids, resuming
with Last-Event-ID, forgotten history), the page and its static files, the page token."""

from __future__ import annotations

import httpx
import msgspec
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount

from loopbus import MisconfigurationError
from loopbus.dashboard import STATIC, Dashboard, Hub, page, routes, serve
from tests.dashboard.sse import Event, read_events


def _hub_with_data(messages: int = 3, history: int = 1_000_000) -> Hub:
    hub = Hub(history=history)
    run = hub.add_run("job", "tcp://127.0.0.1:1")
    run.started("fit", 0, 0)
    for i in range(messages):
        run.record("train/loss", 1.0 / (i + 1), i, 0)
        run.record("val/acc", 0.5, i, 0)
        hub.flush()
    return hub


def _data(events: list[Event]) -> list[Event]:
    return [e for e in events if e.event == "data"]


async def test_the_event_stream_sends_the_status_then_every_message_with_its_id() -> None:
    hub = _hub_with_data(3)
    app = Starlette(routes=routes(hub))
    status, headers, events = await read_events(app, "/events", lambda ev: len(_data(ev)) >= 3)
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    assert events[0].event == "status"
    runs = msgspec.json.decode(events[0].data)["runs"]
    assert [(r["label"], r["state"], r["records"]) for r in runs] == [("job", "connected", 6)]
    data = _data(events)
    assert [e.id for e in data] == ["0", "1", "2"]
    decoded = [msgspec.json.decode(e.data) for e in data]
    assert [d["id"] for d in decoded] == [0, 1, 2]
    assert decoded[2]["parts"][0]["records"] == {
        "train/loss": [[2], [1 / 3]],
        "val/acc": [[2], [0.5]],
    }


async def test_a_browser_that_reconnects_gets_the_rest_and_new_messages_follow() -> None:
    hub = _hub_with_data(4)
    app = Starlette(routes=routes(hub))
    _, _, events = await read_events(
        app, "/events", lambda ev: len(_data(ev)) >= 2, headers=[("Last-Event-ID", "1")]
    )
    assert [e.id for e in _data(events)] == ["2", "3"]
    _, _, events = await read_events(
        app, "/events", lambda ev: len(_data(ev)) >= 1, query="after=2"
    )
    assert [e.id for e in _data(events)] == ["3"]

    # A message flushed while the browser waits arrives at once.
    feed = hub.runs[0]

    def flushed_one_more(events: list[Event]) -> bool:
        if any(e.event == "status" for e in events) and hub.next_id == 4:
            feed.record("train/loss", 0.01, 99, 1)
            hub.flush()
        return len(_data(events)) >= 1

    _, _, events = await read_events(app, "/events", flushed_one_more, query="after=3")
    [new] = _data(events)
    assert new.id == "4"
    assert msgspec.json.decode(new.data)["parts"][0]["records"] == {"train/loss": [[99], [0.01]]}

    status, _, _ = await read_events(app, "/events", lambda ev: True, query="after=x")
    assert status == 400
    # Untrusted input: a number is never read from a long string (at most 20 characters).
    status, _, _ = await read_events(app, "/events", lambda ev: True, query="after=" + "9" * 5000)
    assert status == 400
    _, _, events = await read_events(
        app, "/events", lambda ev: len(_data(ev)) >= 1, headers=[("Last-Event-ID", "-7")]
    )
    assert _data(events)[0].id == "0"


async def test_a_browser_behind_the_history_is_told_what_was_forgotten() -> None:
    hub = _hub_with_data(5, history=4)  # 2 records per message: the last 2 messages kept
    app = Starlette(routes=routes(hub))
    _, _, events = await read_events(app, "/events", lambda ev: len(_data(ev)) >= 2)
    forgotten = [e for e in events if e.event == "forgotten"]
    assert [e.data for e in forgotten] == ["3"]
    assert [e.id for e in _data(events)] == ["3", "4"]


async def test_the_page_and_its_static_files() -> None:
    hub = _hub_with_data(1)
    app = Starlette(routes=[Mount("/dash", routes=routes(hub, title="My <runs>"))])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as client:
        index = await client.get("/dash/")
        assert index.status_code == 200
        assert "<title>My &lt;runs&gt;</title>" in index.text
        # Relative URLs only: the page works wherever it is mounted.
        for url in (
            "static/vendor/uPlot.iife.min.js",
            "static/dashboard.js",
            "static/dashboard.css",
        ):
            assert f'"{url}"' in index.text
            response = await client.get(f"/dash/{url}")
            assert response.status_code == 200
            assert response.content == (STATIC / url.removeprefix("static/")).read_bytes()
        css = await client.get("/dash/static/vendor/uPlot.min.css")
        assert css.headers["content-type"].startswith("text/css")
        assert (await client.get("/dash/static/vendor/uPlot.LICENSE")).text.startswith("The MIT")
        status = (await client.get("/dash/status")).json()
        assert status["runs"][0]["records"] == 2
        assert (await client.get("/dash/static/../_app.py")).status_code == 404
    assert "<form" in page(controls="<form id=start></form>")


def test_the_vendored_uplot_is_the_one_the_readme_names() -> None:
    vendor = STATIC / "vendor"
    readme = (vendor / "README.md").read_text()
    script = (vendor / "uPlot.iife.min.js").read_text()
    assert "uplot@1.6.32" in readme
    assert script.startswith("/*! https://github.com/leeoniya/uPlot (v1.6.32) */")


async def test_a_page_token_guards_everything() -> None:
    dashboard = Dashboard(["tcp://127.0.0.1:1"], web_token="s3cret")
    transport = httpx.ASGITransport(dashboard.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        for url in ("/", "/status", "/static/dashboard.js", "/events"):
            refused = await client.get(url)
            assert refused.status_code == 403, url
            assert "token" in refused.text
        assert (await client.get("/?token=wrong")).status_code == 403
        allowed = await client.get("/?token=s3cret")
        assert allowed.status_code == 200
        assert "HttpOnly" in allowed.headers["set-cookie"]
        # The cookie it set opens the rest.
        assert (await client.get("/status")).status_code == 200
        assert (await client.get("/static/dashboard.js")).status_code == 200


def test_bad_options_are_refused_with_a_way_out() -> None:
    with pytest.raises(MisconfigurationError, match="needs a list of stream addresses"):
        Dashboard([])
    with pytest.raises(MisconfigurationError, match="needs a list of stream addresses"):
        Dashboard("tcp://127.0.0.1:1")
    with pytest.raises(MisconfigurationError, match="scheme 'http' is not served"):
        Dashboard(["http://127.0.0.1:1"])
    with pytest.raises(MisconfigurationError, match=r"labels=\.\.\.\) must name each of the 2"):
        Dashboard(["1", "2"], labels=["a"])
    with pytest.raises(MisconfigurationError, match=r"retry=\.\.\.\) must be"):
        Dashboard(["1"], retry=0)
    with pytest.raises(MisconfigurationError, match=r"web_token=\.\.\.\) must be a non-empty str"):
        Dashboard(["1"], web_token="")
    with pytest.raises(
        MisconfigurationError, match=r"anyone who can reach '0\.0\.0\.0'.*--web-token"
    ):
        serve(["1"], host="0.0.0.0")
    with pytest.raises(MisconfigurationError, match=r"port must be an int from 0 to 65535"):
        serve(["1"], port=70000)
