"""The dashboard's JSON API, which its page uses (``docs/dashboard.md`` documents it):

* ``GET /api/runs``: every run, with its record names, ``run.json`` and configuration;
* ``GET /api/scalars?run=ID&name=NAME``: every point of one series, exact;
* ``GET|POST /api/lines``: what a chart draws of several runs' series (min and max per
  pixel column of the visible range, with the markers);
* ``GET|POST /api/csv``: the exact points of runs and names, as CSV;
* ``GET /api/updates``: Server-Sent Events, one ``runs`` event whenever runs change.

Queries name runs by their id, never by a path: no query reaches a file.
"""

from __future__ import annotations

import csv
import io
import itertools
import math
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Hashable
from typing import Any

import anyio
import anyio.to_thread
import msgspec
from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from ._catalog import Catalog
from ._runs import Run
from ._series import X_MODES, lines, scalars, x_of

__all__ = ["api_routes"]

#: Seconds between looks for changed runs, per open page.
UPDATES = 0.1
#: Pixel columns a chart may ask for.
_WIDTHS = (16, 8192)
_encode = msgspec.json.Encoder().encode
#: Keys of a run's light description (what changes while it is written).
_LIGHT = (
    "id",
    "name",
    "state",
    "names",
    "pending",
    "points",
    "loaded",
    "version",
    "live",
    "reason",
)
#: Series whose pixel columns are kept for the next chart, at most (beyond those the
#: last chart used).
_CACHED = 2048
#: Whole answers of charts kept (the latest used), at most, and their bytes at most.
_ANSWERS = 64
_ANSWER_BYTES = 64 * 1024 * 1024
#: Seconds a request for every point waits for columns not read yet.
READING = 60.0


class _Query(msgspec.Struct, forbid_unknown_fields=True):
    """A request for lines or CSV (the body of a POST, or the query of a GET)."""

    runs: list[str] = []
    names: list[str] = []
    x: str = "step"
    lo: float | None = None
    hi: float | None = None
    width: int = 800
    smoothing: float = 0.0


class BadRequest(Exception):
    """Raised when a request names what is not there or is malformed (400 or 404)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def _json(data: Any) -> Response:
    return Response(_encode(data), media_type="application/json")


def _one(request: Request, key: str) -> str:
    values = request.query_params.getlist(key)
    if len(values) != 1 or not values[0]:
        raise BadRequest(f"the query needs one {key}=..., got {len(values)}.")
    return values[0]


def _number(text: str | None, key: str) -> float | None:
    if text is None or text == "":
        return None
    try:
        value = float(text[:40])
    except ValueError:
        raise BadRequest(f"{key} must be a number, got {text[:40]!r}.") from None
    if not math.isfinite(value):
        raise BadRequest(f"{key} must be a finite number, got {text[:40]!r}.")
    return value


async def _query(request: Request) -> _Query:
    if request.method == "POST":
        body = await request.body()
        try:
            query = msgspec.json.decode(body, type=_Query)
        except msgspec.DecodeError as exc:
            raise BadRequest(
                f"the body must be a JSON object of runs, names, x, ...: {exc}"
            ) from None
    else:
        params = request.query_params
        query = _Query(
            runs=params.getlist("run"),
            names=params.getlist("name"),
            x=params.get("x", "step"),
            lo=_number(params.get("lo"), "lo"),
            hi=_number(params.get("hi"), "hi"),
            width=int(_number(params.get("width"), "width") or 800),
            smoothing=_number(params.get("smoothing"), "smoothing") or 0.0,
        )
    if query.x not in X_MODES:
        raise BadRequest(f"x must be one of {', '.join(X_MODES)}, got {query.x[:40]!r}.")
    query.width = min(max(query.width, _WIDTHS[0]), _WIDTHS[1])
    if not 0 <= query.smoothing < 1:
        raise BadRequest(f"smoothing must be at least 0 and below 1, got {query.smoothing!r}.")
    return query


def _run(catalog: Catalog, run_id: str) -> Run:
    run = catalog.get(run_id)
    if run is None:
        raise BadRequest(f"there is no run {run_id[:200]!r}: GET /api/runs lists them.", 404)
    return run


def _runs(catalog: Catalog, ids: list[str]) -> list[Run]:
    """The runs of ``ids`` (404 when one is not there), looked up at once."""
    shown = {run.id: run for run in catalog.runs()}
    for run_id in ids:
        if run_id not in shown:
            _run(catalog, run_id)
    return [shown[run_id] for run_id in ids]


def light(run: Run) -> dict[str, Any]:
    """What changes while a run is written, for the page's updates."""
    info = run.info()
    return {key: info[key] for key in _LIGHT}


class _Answers:
    """The latest charts' answers (encoded), by what they were computed from: a chart
    asked again while nothing it shows changed (a page refreshes its charts while other
    runs are read) is answered without computing it again. At most :data:`_ANSWERS`
    of them and :data:`_ANSWER_BYTES` bytes, the least recently used forgotten first."""

    def __init__(self) -> None:
        self._kept: OrderedDict[Hashable, bytes] = OrderedDict()
        self._bytes = 0

    def get(self, key: Hashable) -> bytes | None:
        body = self._kept.get(key)
        if body is not None:
            self._kept.move_to_end(key)
        return body

    def put(self, key: Hashable, body: bytes) -> None:
        if key in self._kept or len(body) > _ANSWER_BYTES:
            return
        self._kept[key] = body
        self._bytes += len(body)
        while len(self._kept) > _ANSWERS or self._bytes > _ANSWER_BYTES:
            self._bytes -= len(self._kept.popitem(last=False)[1])


class _Markers:
    """Each run's markers in an x mode, computed again only when the run changed, with
    a stamp that changes only when they do (a chart's answer is kept by the stamps of
    its runs' markers, not by the runs' versions, which other names' points change)."""

    def __init__(self) -> None:
        self._kept: dict[int, tuple[Run, int, str, float | None, list[Any], int]] = {}
        self._stamps = itertools.count()

    def of(self, run: Run, mode: str, origin: float | None) -> tuple[list[Any], int]:
        """The markers of ``run`` in x ``mode``, and their stamp."""
        kept = self._kept.get(id(run))
        if kept is not None and kept[0] is run and kept[1:4] == (run.version, mode, origin):
            return kept[4], kept[5]
        made = _markers(run, mode, origin)
        same = kept is not None and kept[0] is run and kept[2:5] == (mode, origin, made)
        stamp = kept[5] if same and kept is not None else next(self._stamps)
        self._kept[id(run)] = (run, run.version, mode, origin, made, stamp)
        return made, stamp


def _lines(
    catalog: Catalog,
    query: _Query,
    cache: dict[Any, Any] | None = None,
    markers_of: _Markers | None = None,
) -> tuple[Hashable, Callable[[], dict[str, Any]]]:
    """What a chart asks for: the runs' arrays are gathered now (in the event loop's
    thread, where the runs change); the function returned computes the answer from them
    alone (in a worker thread, the event loop free meanwhile, one at a time), keeping in
    ``cache`` each series' part of the range for the next chart (under the series and
    its stamp). Returned with it: a key of the answer, the same as long as the answer is
    (the series' stamps, the runs read or not yet, their markers, the query)."""
    if len(query.names) != 1:
        raise BadRequest("lines are asked for one record name at a time (one name).")
    name = query.names[0]
    runs = _runs(catalog, query.runs)
    catalog.want(name)
    markers_of = markers_of if markers_of is not None else _Markers()
    shown, data, pending, smoothed, keys, marked, stamps = [], [], [], [], [], [], []
    for run in runs:
        series = run.series.get(name)
        if not run.loaded or name in run.pending:
            pending.append(run.id)
            continue
        if series is None:
            continue
        origin = run.origin() if query.x == "relative" else None  # only relative uses it
        shown.append(run.id)
        data.append(x_of(series, query.x, origin))
        keys.append((series, series.stamp, query.x, origin))
        if query.smoothing > 0:
            smoothed.append(series.smoother(query.smoothing))
        made, stamp = markers_of.of(run, query.x, origin)
        marked.append(made)
        stamps.append(stamp)
    answer = (
        query.x,
        query.lo,
        query.hi,
        query.width,
        query.smoothing,
        tuple(key[1:] for key in keys),  # the stamps say what the series hold
        tuple(shown),
        tuple(pending),
        tuple(stamps),
    )

    def compute() -> dict[str, Any]:
        lines_of = [f() for f in smoothed] if query.smoothing else None
        result = lines(data, query.lo, query.hi, query.width, lines_of, keys, cache, _raw)
        if cache is not None:
            _prune(cache, keys, query.lo, query.hi)
        result["smoothing"] = query.smoothing
        result["runs"] = shown
        result["pending"] = pending
        result["total"] = sum(len(x) for x, _ in data)
        result["markers"] = [m for made in marked for m in made]
        return result

    return answer, compute


def _prune(cache: dict[Any, Any], keys: list[Any], lo: float | None, hi: float | None) -> None:
    """Forget the parts of series that changed since (a part may hold the arrays a
    series had), those of the series of a chart just computed but those it used (other
    ranges), and, beyond :data:`_CACHED` parts, every part this chart did not use."""
    used = {(key, lo, hi) for key in keys}
    charted = {key[0] for key in keys}
    over = len(cache) > _CACHED
    for key in [
        k
        for k in cache
        if k not in used and (over or k[0][0] in charted or k[0][0].stamp != k[0][1])
    ]:
        del cache[key]


def _raw(values: list[Any]) -> msgspec.Raw:
    """A series' values of a chart, encoded once (kept with its part of the chart)."""
    return msgspec.Raw(_encode(values))


def _markers(run: Run, mode: str, origin: float | None) -> list[dict[str, Any]]:
    out = []
    for m in run.markers():
        if mode == "step":
            x = m["step"]
        elif m["time"] is None:
            continue
        else:
            x = m["time"] - (origin or 0.0) if mode == "relative" else m["time"]
        out.append({"run": run.id, "kind": m["kind"], "x": x, "label": m["label"]})
    return out


async def _read(catalog: Catalog, runs: list[Run], names: list[str] | None) -> None:
    """Wait until the columns of ``names`` (all: None) of ``runs`` are read (they are
    read first); 503 when they are not within :data:`READING` seconds."""
    with anyio.move_on_after(READING):
        await catalog.read_first(runs, names)
        return
    raise BadRequest(
        f"the runs' files are still being read after {READING:.0f} s: ask again later.", 503
    )


def _csv(runs: list[Run], query: _Query) -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["run", "name", "step", "wall_time", "value"])
    for run in runs:
        names = query.names or sorted(run.series)
        for name in names:
            series = run.series.get(name)
            if series is None:
                continue
            points = scalars(series)
            for step, time, value in zip(
                points["step"], points["wall_time"], points["value"], strict=True
            ):
                writer.writerow([run.id, name, step, repr(time), _cell(value)])
    return out.getvalue()


def _cell(value: Any) -> str:
    return repr(value) if type(value) is float else str(value)


async def _changes(catalog: Catalog) -> AsyncIterator[dict[str, Any]]:
    """A ``runs`` event whenever runs change: the changed runs' light descriptions and
    how many runs there are."""
    sent: dict[str, int] = {}
    while True:
        runs = catalog.runs()
        changed = [light(r) for r in runs if sent.get(r.id) != r.version]
        if changed or len(sent) != len(runs):
            sent = {r.id: r.version for r in runs}
            yield {"event": "runs", "data": _encode({"runs": changed, "count": len(runs)}).decode()}
        await anyio.sleep(UPDATES)


def api_routes(catalog: Catalog) -> list[BaseRoute]:
    """The JSON API's routes over ``catalog`` (see the module's docstring)."""

    def answering(handler: Any) -> Any:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except BadRequest as exc:
                return PlainTextResponse(str(exc), exc.status)

        return endpoint

    async def runs(request: Request) -> Response:
        return _json([run.info() for run in catalog.runs()])

    async def series(request: Request) -> Response:
        run = _run(catalog, _one(request, "run"))
        name = _one(request, "name")
        await _read(catalog, [run], [name])
        found = run.series.get(name)
        if found is None:
            raise BadRequest(f"run {run.id!r} has no record {name[:200]!r}.", 404)
        return _json(scalars(found))

    drawing: list[anyio.CapacityLimiter] = []  # made in the event loop, on first use
    parts: dict[Any, Any] = {}  # the series' parts of the last charts
    answers = _Answers()
    markers = _Markers()

    async def chart(request: Request) -> Response:
        key, compute = _lines(catalog, await _query(request), parts, markers)
        body = answers.get(key)
        if body is None:
            if not drawing:  # one chart computed at a time: reading the runs keeps a core
                drawing.append(anyio.CapacityLimiter(1))
            body = await anyio.to_thread.run_sync(lambda: _encode(compute()), limiter=drawing[0])
            answers.put(key, body)
        return Response(body, media_type="application/json")

    async def table(request: Request) -> Response:
        query = await _query(request)
        runs = _runs(catalog, query.runs) or catalog.runs()
        await _read(catalog, runs, query.names or None)
        text = _csv(runs, query)
        return Response(
            text,
            media_type="text/csv",
            headers={"Content-Disposition": 'attachment; filename="records.csv"'},
        )

    async def updates(request: Request) -> Response:
        return EventSourceResponse(_changes(catalog), ping=15, sep="\n")

    return [
        Route("/api/runs", answering(runs)),
        Route("/api/scalars", answering(series)),
        Route("/api/lines", answering(chart), methods=["GET", "POST"]),
        Route("/api/csv", answering(table), methods=["GET", "POST"]),
        Route("/api/updates", updates),
    ]
