"""A report: one self-contained HTML file with the page, uPlot and every point of the runs
inlined, that opens offline (no request leaves it) and draws the same charts. The runs
are those read from files and, with :func:`export_live`, the live jobs as they are at
the time of the export."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import anyio.to_thread
import msgspec

from .._durable import replace_atomically
from ._app import page
from ._catalog import Catalog
from ._hub import Hub, RunFeed
from ._series import scalars
from ._source import follow

__all__ = ["export", "export_live"]

#: States of a job's feed in which more of its records are on their way.
_STREAMING = ("waiting", "connected")

_STATIC = Path(__file__).resolve().parent / "static"


def _inline(text: str) -> str:
    """Text safe inside a ``<script>`` or ``<style>`` element (no closing tag in it)."""
    return text.replace("</", "<\\/")


def report(catalog: Catalog, *, title: str = "loopbus report") -> str:
    """The report's HTML for the runs of ``catalog`` (as they are now)."""
    runs = catalog.runs()
    data = {
        "time": time.time(),
        "runs": [{**run.info(), "markers": run.markers()} for run in runs],
        "scalars": {run.id: {name: scalars(s) for name, s in run.series.items()} for run in runs},
    }
    html = page(title)
    css = "\n".join(
        (_STATIC / name).read_text(encoding="utf-8")
        for name in ("vendor/uPlot.min.css", "dashboard.css")
    )
    scripts = [
        (_STATIC / name).read_text(encoding="utf-8")
        for name in ("vendor/uPlot.iife.min.js", "dashboard.js")
    ]
    payload = msgspec.json.encode(data).decode()
    replacements = {
        '<link rel="stylesheet" href="static/vendor/uPlot.min.css">\n': "",
        '<link rel="stylesheet" href="static/dashboard.css">': f"<style>\n{_inline(css)}\n</style>",
        "<!-- data -->": (
            f'<script id="loopbus-data" type="application/json">{_inline(payload)}</script>'
        ),
        '<script src="static/vendor/uPlot.iife.min.js"></script>': (
            f"<script>\n{_inline(scripts[0])}\n</script>"
        ),
        '<script src="static/dashboard.js"></script>': f"<script>\n{_inline(scripts[1])}\n</script>",
    }
    for old, new in replacements.items():
        if old not in html:
            raise RuntimeError(f"the page template has no {old.strip()!r} to inline into")
        html = html.replace(old, new)
    return html


def export(
    catalog: Catalog, path: str | os.PathLike[str], *, title: str = "loopbus report"
) -> Path:
    """Write the report of ``catalog``'s runs (read once, now) to ``path``; returns it."""
    catalog.load()
    return _write(catalog, path, title)


def _write(catalog: Catalog, path: str | os.PathLike[str], title: str) -> Path:
    text = report(catalog, title=title).encode("utf-8")
    target = Path(path)
    replace_atomically(target, lambda f: f.write(text))
    target.chmod(0o644)  # a report is for sharing
    return target


async def export_live(
    paths: Sequence[str | os.PathLike[str]],
    addresses: Sequence[str],
    path: str | os.PathLike[str],
    *,
    labels: Sequence[str] | None = None,
    token: str | None = None,
    wait_s: float = 10.0,
    settle_s: float = 0.5,
    title: str = "loopbus report",
) -> tuple[Path, list[str]]:
    """Write the report of the runs under ``paths`` and of the live jobs serving their
    stream at ``addresses`` (named ``labels``), as they are now; returns its path and the
    addresses of the jobs that did not answer within ``wait_s`` seconds (in the report
    without points). A job's points are those it streams from the connection on and, when
    its stream names its run folder, those the folder's log holds from before; the
    stream is read for ``settle_s`` seconds more (less when every job is between stages
    or ended), then the files once."""
    hub = Hub()
    names = labels if labels is not None else addresses
    feeds = [hub.add_run(str(n), a) for n, a in zip(names, addresses, strict=True)]
    catalog = Catalog(paths, hub=hub)
    async with anyio.create_task_group() as tg:
        for feed, address in zip(feeds, addresses, strict=True):
            tg.start_soon(_follow, feed, address, token)
        with anyio.move_on_after(wait_s):
            await _until(feeds, ("waiting",))
        with anyio.move_on_after(settle_s):
            await _until(feeds, _STREAMING)
        found = await anyio.to_thread.run_sync(catalog.refresh)
        catalog.apply(found)  # here, not in the thread: the feeds add points here too
        tg.cancel_scope.cancel()
    silent = [feed.address for feed in feeds if feed.state == "waiting"]
    return _write(catalog, path, title), silent


async def _follow(feed: RunFeed, address: str, token: str | None) -> None:
    await follow(feed, address, token=token)


async def _until(feeds: Sequence[RunFeed], states: Sequence[str]) -> None:
    """Return once no feed is in one of ``states``."""
    while any(feed.state in states for feed in feeds):  # noqa: ASYNC110
        await anyio.sleep(0.02)
