"""A report: one self-contained HTML file with the page, uPlot and every point of the runs
inlined, that opens offline (no request leaves it) and draws the same charts."""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgspec

from .._durable import replace_atomically
from ._app import page
from ._catalog import Catalog
from ._series import scalars

__all__ = ["export"]

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
    text = report(catalog, title=title).encode("utf-8")
    target = Path(path)
    replace_atomically(target, lambda f: f.write(text))
    target.chmod(0o644)  # a report is for sharing
    return target
