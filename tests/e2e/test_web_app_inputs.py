"""The example web app (examples/web_app.py) reads untrusted HTTP input: bodies are
bounded in size and decoded only into the typed ``RunConfig`` (which nests nothing), and
``Last-Event-ID`` is bounded before it is read as a number. The app is called in process
(as an ASGI server would call it); these requests are refused before any run starts."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from tests.helpers import ROOT

pytest.importorskip("starlette")
pytest.importorskip("sklearn")

EXAMPLES = ROOT / "examples"


@pytest.fixture
def web_app() -> Iterator[ModuleType]:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import web_app

        yield web_app
    finally:
        sys.path.remove(str(EXAMPLES))


class Answer:
    def __init__(self) -> None:
        self.status = 0
        self.body = bytearray()
        self.chunks_read = 0

    def json(self) -> Any:
        return json.loads(self.body)


async def _post_runs(app: Any, body: bytes, chunk: int = 4096) -> Answer:
    """``POST /runs`` with ``body`` sent in chunks of ``chunk`` bytes, as a server would
    hand them to the app (counting the chunks the app read)."""
    answer = Answer()
    chunks = [body[i : i + chunk] for i in range(0, len(body), chunk)] or [b""]

    async def receive() -> dict[str, Any]:
        if answer.chunks_read == len(chunks):
            return {"type": "http.disconnect"}
        answer.chunks_read += 1
        more = answer.chunks_read < len(chunks)
        return {"type": "http.request", "body": chunks[answer.chunks_read - 1], "more_body": more}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answer.status = message["status"]
        elif message["type"] == "http.response.body":
            answer.body += message.get("body", b"")

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/runs",
        "raw_path": b"/runs",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"web-app"), (b"content-type", b"application/json")],
        "server": ("web-app", 80),
        "client": ("127.0.0.1", 50000),
    }
    await app(scope, receive, send)
    return answer


async def test_a_body_above_the_limit_is_refused_unread(web_app: ModuleType) -> None:
    answer = await _post_runs(web_app.app, b" " * (100 * web_app.MAX_BODY))
    assert answer.status == 413
    assert answer.json() == {"error": "the body is larger than 16384 bytes"}
    assert answer.chunks_read == web_app.MAX_BODY // 4096 + 1


async def test_deeply_nested_bodies_are_refused_whatever_the_recursion_limit(
    web_app: ModuleType,
) -> None:
    depth = (web_app.MAX_BODY - 16) // 2
    deep = b"[" * depth + b"]" * depth
    cases = {
        b'{"epochs": ' + deep + b"}": "Expected `int`, got `array` - at `$.epochs`",
        b'{"x": ' + deep + b"}": "Object contains unknown field `x`",
        deep: "Expected `object`, got `array`",
    }
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200_000)
    try:
        for body, error in cases.items():
            assert len(body) <= web_app.MAX_BODY
            answer = await _post_runs(web_app.app, body)
            assert answer.status == 422
            assert answer.json() == {"error": f"invalid run configuration: {error}"}
    finally:
        sys.setrecursionlimit(limit)


@pytest.mark.parametrize(
    ("last", "start"),
    [(None, 0), ("0", 1), ("41", 42), ("-5", 0), ("x", None), ("9" * 21, None), ("9" * 5000, None)],
)
def test_last_event_id_is_a_bounded_record_number(
    web_app: ModuleType, last: str | None, start: int | None
) -> None:
    assert web_app._resume_at(last) == start
