"""Serving a :class:`Dashboard` with uvicorn, or writing a report:
``loopbus dashboard [PATH|GLOB|ADDRESS]... [--export report.html]``."""

from __future__ import annotations

import glob
import os
import socket
import sys
import webbrowser
from collections.abc import Sequence
from functools import partial
from typing import IO, Any

import anyio

from .._exceptions import MisconfigurationError
from .._validate import check_int
from ..stream import is_loopback, parse_address
from ._app import Dashboard, new_token
from ._catalog import Catalog
from ._export import export, export_live

__all__ = ["bind", "serve", "split_sources"]


def split_sources(sources: Sequence[str]) -> tuple[list[str], list[str]]:
    """``(paths, addresses)``: an existing path or a glob is a path (run folders and log
    files), anything else must be a stream address."""
    paths: list[str] = []
    addresses: list[str] = []
    for source in sources:
        expanded = os.path.expanduser(source)
        if os.path.exists(expanded) or glob.has_magic(expanded):
            paths.append(source)
            continue
        try:
            addresses.append(str(parse_address(source)))
        except ValueError as exc:
            raise MisconfigurationError(
                f"{source!r} is neither an existing path (a run folder, a folder of runs, a "
                "log file or a glob) nor a stream address (tcp://HOST:PORT, HOST:PORT, PORT "
                f"or unix:///path): {exc}"
            ) from None
    return paths, addresses


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` (``0``: a free port)."""
    check_int("port", port, minimum=0, maximum=65535, hint="0 picks a free port")
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket, host: str, token: str | None) -> str:
    """The page's address for a socket from :func:`bind`."""
    port = sock.getsockname()[1]
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
    if ":" in shown and not shown.startswith("["):
        shown = f"[{shown}]"
    return f"http://{shown}:{port}/" + (f"?token={token}" if token else "")


def _export(
    paths: list[str],
    addresses: list[str],
    export_to: str | os.PathLike[str],
    out: IO[str],
    **jobs: Any,
) -> None:
    """Write the report of the runs of ``paths`` and, as they are now, of the live jobs
    at ``addresses`` (``jobs``: their ``labels`` and stream ``token``)."""
    if not paths and not addresses:
        raise MisconfigurationError(
            "--export writes the runs read from files and live jobs: name a run folder, a "
            "folder of runs, a log file or a job's address (loopbus dashboard runs --export "
            "report.html)."
        )
    if not addresses:
        written = export(Catalog(paths), export_to)
    else:
        written, silent = anyio.run(partial(export_live, paths, addresses, export_to, **jobs))
        for address in silent:
            print(
                f"loopbus dashboard: the job at {address} did not answer; it is in the "
                "report without points.",
                file=out,
            )
    print(f"loopbus dashboard: wrote {written} ({written.stat().st_size:,} bytes)", file=out)


def _warn_beyond_loopback(host: str, out: IO[str]) -> None:
    if not is_loopback(host):
        print(
            f"loopbus dashboard: WARNING: serving on {host!r}, beyond this machine; the page "
            "is plain HTTP (the token travels unencrypted).",
            file=out,
        )


def serve(
    sources: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    web_token: str | None = None,
    open_browser: bool = False,
    labels: Sequence[str] | None = None,
    interval: float = 0.1,
    out: IO[str] | None = None,
    export_to: str | os.PathLike[str] | None = None,
) -> None:
    """Serve a dashboard of the runs of ``sources`` (run folders, folders of runs, log
    files, globs; live jobs' stream addresses) until interrupted (Ctrl-C). The page is on
    loopback by default; on any other ``host`` it needs a ``web_token`` (``"auto"`` makes
    one up). With ``export_to`` it writes a report of the runs there instead, and returns.
    """
    import uvicorn

    out = out if out is not None else sys.stderr
    paths, addresses = split_sources(sources)
    if export_to is not None:
        _export(paths, addresses, export_to, out, labels=labels, token=token)
        return
    if not isinstance(host, str) or not host:
        raise MisconfigurationError(f"the dashboard's host must be a host name, got {host!r}.")
    if web_token == "auto":
        web_token = new_token()
    if not is_loopback(host) and web_token is None:
        raise MisconfigurationError(
            f"the dashboard would serve the runs' records to anyone who can reach {host!r}: "
            "pass a token for the page (--web-token SECRET, or --web-token auto), or keep "
            "--host on 127.0.0.1 and forward the port (ssh -L 8080:127.0.0.1:8080 host)."
        )
    options: dict[str, Any] = {"labels": labels, "token": token, "web_token": web_token}
    options["interval"] = interval
    dashboard = Dashboard(addresses, paths=paths, **options)
    sock = bind(host, port)
    url = url_of(sock, host, web_token)
    _warn_beyond_loopback(host, out)
    print(
        f"loopbus dashboard: {url} (watching {', '.join([*paths, *dashboard.addresses])}; "
        "Ctrl-C stops)",
        file=out,
        flush=True,
    )
    if open_browser:
        webbrowser.open(url)  # the socket listens already: the browser's request waits
    config = uvicorn.Config(
        dashboard.app, log_level="warning", lifespan="on", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
