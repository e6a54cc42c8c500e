"""``loopbus dashboard``: a web page charting runs, finished or live: those logged in run
folders (JSONL, CSV, TensorBoard), followed while their files grow, and running jobs that
serve their stream.

Imports the stream client, the web libraries and numpy (the ``web`` extra), never torch
or the engine: the dashboard is a separate process that starts fast. ``docs/dashboard.md``
describes the command, the page and its JSON API.
"""

from __future__ import annotations

try:
    import numpy as _numpy  # noqa: F401
    import sse_starlette as _sse_starlette  # noqa: F401
    import starlette as _starlette  # noqa: F401
except ImportError as _exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"the loopbus dashboard needs Starlette, uvicorn, sse-starlette and numpy ({_exc.name} is "
        "missing). Install them with: pip install 'loopbus[web]'"
    ) from _exc

from .._exceptions import fixup_module_metadata as _fixup_module_metadata
from ._app import STATIC as STATIC
from ._app import Dashboard as Dashboard
from ._app import page as page
from ._app import routes as routes
from ._catalog import Catalog as Catalog
from ._export import export as export
from ._export import export_live as export_live
from ._hub import CHUNK_BYTES as CHUNK_BYTES
from ._hub import MESSAGE_POINTS as MESSAGE_POINTS
from ._hub import Hub as Hub
from ._hub import Page as Page
from ._hub import RunFeed as RunFeed
from ._runs import Run as Run
from ._series import Series as Series
from ._serve import serve as serve
from ._source import follow as follow

__all__ = [
    "CHUNK_BYTES",
    "MESSAGE_POINTS",
    "STATIC",
    "Catalog",
    "Dashboard",
    "Hub",
    "Page",
    "Run",
    "RunFeed",
    "Series",
    "export",
    "export_live",
    "follow",
    "page",
    "routes",
    "serve",
]

_fixup_module_metadata(__name__, globals())
