"""Reading a Server-Sent Events response of an ASGI app in process, as it streams (the
test clients of httpx and Starlette return a response only once it ended)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio
from starlette.types import ASGIApp, Message, Scope


class Event:
    def __init__(self, fields: dict[str, str]) -> None:
        self.event = fields.get("event", "message")
        self.id = fields.get("id")
        self.data = fields.get("data", "")

    def __repr__(self) -> str:
        return f"Event({self.event!r}, id={self.id!r}, {self.data[:60]!r})"


def parse(text: str) -> list[Event]:
    """The complete events in ``text`` (comments skipped)."""
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n")[:-1]:
        fields: dict[str, str] = {}
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            key, _, value = line.partition(": ")
            fields[key] = fields[key] + "\n" + value if key == "data" and key in fields else value
        if fields:
            events.append(Event(fields))
    return events


def request(path: str, headers: Sequence[tuple[str, str]] = (), query: str = "") -> Scope:
    """The ASGI scope of ``GET path?query`` with ``headers``."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": query.encode(),
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }


async def read_events(
    app: ASGIApp,
    path: str,
    until: Callable[[list[Event]], bool],
    *,
    headers: Sequence[tuple[str, str]] = (),
    query: str = "",
    within: float = 10.0,
) -> tuple[int, dict[str, str], list[Event]]:
    """GET ``path`` and read events until ``until(events)``, then disconnect:
    ``(status, headers, events)``."""
    body = bytearray()
    start: dict[str, Any] = {}
    done = anyio.Event()

    async def receive() -> Message:
        await done.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            start.update(message)
        elif message["type"] == "http.response.body":
            body.extend(message.get("body", b""))
            if until(parse(body.decode())) or not message.get("more_body", False):
                done.set()

    scope = request(path, headers, query)
    with anyio.fail_after(within):
        await app(scope, receive, send)
    response_headers = {k.decode(): v.decode() for k, v in start.get("headers", [])}
    return start["status"], response_headers, parse(body.decode())
