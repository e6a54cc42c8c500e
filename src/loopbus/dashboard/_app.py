"""The dashboard's web side: the page, its static files, the JSON API over the runs and
the Server-Sent Events stream of the hub's messages, as Starlette routes (``routes``) or a
whole app (``Dashboard``)."""

from __future__ import annotations

import hmac
import html
import secrets
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .._exceptions import MisconfigurationError
from .._validate import check_number
from ..stream import parse_address
from ._api import api_routes
from ._catalog import Catalog
from ._hub import Hub, RunFeed
from ._source import follow

__all__ = ["STATIC", "Dashboard", "page", "routes"]

#: The page's files: ``index.html``, ``dashboard.js``, ``dashboard.css`` and ``vendor/``
#: (uPlot).
STATIC = Path(__file__).resolve().parent / "static"
#: Seconds between keep-alive comments on an idle event stream.
PING = 15.0
_OWNER = "Dashboard"
_COOKIE = "loopbus_dashboard"


def page(title: str = "loopbus dashboard", controls: str = "") -> str:
    """The dashboard page; ``controls`` is HTML placed above the charts (an application
    that starts runs puts its form there)."""
    text = (STATIC / "index.html").read_text(encoding="utf-8")
    text = text.replace("{{title}}", html.escape(title))
    return text.replace("<!-- controls -->", controls)


def _stream(hub: Hub, start: int) -> AsyncIterator[bytes]:
    """The event stream of a page that wants the messages from id ``start`` on: its
    history and then the live messages, a chunk at a time (see
    :class:`~loopbus.dashboard.Page`)."""

    async def events() -> AsyncIterator[bytes]:
        page = hub.open_page(start)
        try:
            while True:
                chunk = page.next_chunk()
                if chunk is None:
                    await hub.wait()
                    continue
                # Resumed only once the connection took the chunk (uvicorn's send waits
                # while the connection's buffer is full): the page's pace.
                yield chunk
                del chunk
                page.written()
        finally:  # the page went (or the dashboard stops): nothing of it is kept
            hub.close_page(page)

    return events()


def _resume_at(last: str | None) -> int | None:
    """The first message a reconnecting browser wants: one past its ``Last-Event-ID``
    (or ``?after=``), 0 without one; None if that is not a message id (untrusted input:
    at most 20 characters, so that ``int`` never reads a long string)."""
    if last is None:
        return 0
    if len(last) > 20:
        return None
    try:
        return max(int(last) + 1, 0)
    except ValueError:
        return None


def routes(
    hub: Hub,
    *,
    title: str = "loopbus dashboard",
    controls: str = "",
    catalog: Catalog | None = None,
) -> list[BaseRoute]:
    """The dashboard's routes for ``hub``, for an application of one's own: ``/`` (the
    page), ``/api/...`` (the JSON API over ``catalog``'s runs, by default those of
    ``hub``), ``/events`` (the hub's messages, Server-Sent Events), ``/status`` (the
    hub's runs, JSON) and ``/static/...``. Mount them anywhere
    (``Mount("/dashboard", routes=...)``): the page uses relative URLs."""
    body = page(title, controls)
    catalog = catalog if catalog is not None else Catalog(hub=hub)

    async def index(request: Request) -> Response:
        return HTMLResponse(body, headers={"Cache-Control": "no-cache"})

    async def events(request: Request) -> Response:
        last = request.headers.get("last-event-id") or request.query_params.get("after")
        start = _resume_at(last)
        if start is None:
            shown = (last or "")[:40]
            return PlainTextResponse(f"Last-Event-ID must be a message id, got {shown!r}.", 400)
        return EventSourceResponse(_stream(hub, start), ping=PING, sep="\n")

    async def status(request: Request) -> Response:
        return Response(hub.status(), media_type="application/json")

    return [
        Route("/", index),
        *api_routes(catalog),
        Route("/events", events),
        Route("/status", status),
        Mount("/static", StaticFiles(directory=STATIC), name="static"),
    ]


class _TokenGate:
    """Lets a request through with the right token: ``?token=...`` once (which sets a
    cookie), then the cookie."""

    def __init__(self, app: ASGIApp, token: str) -> None:
        self.app = app
        self.token = token.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        offered = request.query_params.get("token")
        if offered is not None and hmac.compare_digest(offered.encode(), self.token):

            async def with_cookie(message: Message) -> None:
                if message["type"] == "http.response.start":
                    headers = list(message.get("headers", []))
                    headers.append(
                        (
                            b"set-cookie",
                            b"%s=%s; HttpOnly; SameSite=Strict; Path=/"
                            % (_COOKIE.encode(), self.token),
                        )
                    )
                    message = {**message, "headers": headers}
                await send(message)

            await self.app(scope, receive, with_cookie)
            return
        cookie = request.cookies.get(_COOKIE, "")
        if hmac.compare_digest(cookie.encode(), self.token):
            await self.app(scope, receive, send)
            return
        response = PlainTextResponse(
            "This dashboard needs its token: open the address it printed (…/?token=...).", 403
        )
        await response(scope, receive, send)


class Dashboard:
    """Charts runs: those logged under ``paths`` (finished, or still being written) and
    the live jobs serving their stream at ``addresses`` (see ``loopbus dashboard``).

    * ``addresses``: one per job, ``tcp://HOST:PORT`` or ``unix:///path``; each is a run
      of its own. ``labels``: their names on the page (default the addresses).
    * ``paths``: run folders, folders searched for runs, log files, or globs of these
      (:class:`Catalog`); nothing outside them is read, but for the run folder a job's
      stream names (its history).
    * ``token``: the jobs' stream token, if they have one.
    * ``web_token``: a token the page asks for (``?token=...``, then a cookie); ``None``:
      anyone who can reach the page sees it.
    * ``interval``: seconds between messages to the browsers; ``history``: records kept
      for browsers that open the page later; ``retry``: seconds between connection
      attempts while a job is not serving; ``poll``: seconds between looks at the runs'
      files.

    ``app`` is the Starlette application; run it with any ASGI server, or use
    :func:`loopbus.dashboard.serve`. ``catalog`` holds the runs.
    """

    def __init__(
        self,
        addresses: Sequence[str] = (),
        *,
        paths: Sequence[str] = (),
        labels: Sequence[str] | None = None,
        token: str | None = None,
        web_token: str | None = None,
        interval: float = 0.1,
        history: int = 2_000_000,
        retry: float = 0.2,
        poll: float = 0.2,
        title: str = "loopbus dashboard",
    ) -> None:
        if isinstance(addresses, str) or isinstance(paths, str) or not (addresses or paths):
            raise MisconfigurationError(
                "Dashboard(addresses=..., paths=...) needs a list of stream addresses "
                "(['tcp://127.0.0.1:8765']) or of run folders, log files or globs "
                f"(['runs']), got addresses={addresses!r}, paths={paths!r}."
            )
        self.addresses = [str(parse_address(a)) for a in addresses]
        if labels is None:
            labels = self.addresses
        if isinstance(labels, str) or len(labels) != len(self.addresses):
            raise MisconfigurationError(
                f"Dashboard(labels=...) must name each of the {len(self.addresses)} "
                f"address(es) once, got {labels!r}."
            )
        for name, value in (("token", token), ("web_token", web_token)):
            if value is not None and (not isinstance(value, str) or not value):
                raise MisconfigurationError(
                    f"Dashboard({name}=...) must be a non-empty str or None, got {value!r}."
                )
        self.token = token
        self.web_token = web_token
        self.retry = check_number(
            "retry", retry, exclusive_minimum=0, owner=_OWNER, what="a number of seconds"
        )
        self.hub = Hub(interval=interval, history=history)
        self.feeds = [
            self.hub.add_run(str(label), address)
            for label, address in zip(labels, self.addresses, strict=True)
        ]
        self.catalog = Catalog(paths, hub=self.hub, poll=poll)
        self.app = Starlette(
            routes=routes(self.hub, title=title, catalog=self.catalog),
            lifespan=self._lifespan,
            middleware=[Middleware(_TokenGate, token=web_token)] if web_token else [],
        )

    async def run(self) -> None:
        """Follow every run and feed the browsers, until cancelled."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.hub.run, name="dashboard flush")
            tg.start_soon(self.catalog.run, name="dashboard files")
            for feed, address in zip(self.feeds, self.addresses, strict=True):
                tg.start_soon(self._follow, feed, address, name=f"dashboard: {address}")

    async def _follow(self, feed: RunFeed, address: str) -> None:
        await follow(feed, address, token=self.token, retry=self.retry)

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self.run)
            yield
            tg.cancel_scope.cancel()


def new_token() -> str:
    """A random token for the page."""
    return secrets.token_urlsafe(18)
