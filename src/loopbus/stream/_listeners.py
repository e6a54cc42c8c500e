"""Where the stream server listens: checking the endpoint options (a TCP host and port, a
Unix socket path, the token that other machines need), opening the listening sockets,
accepting connections (each when the server gives it its turn), and closing the sockets
again (removing the Unix socket file)."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import SocketAttribute

from .._exceptions import MisconfigurationError, StreamError
from .._validate import check_int
from ._address import Address, is_loopback

if TYPE_CHECKING:
    from anyio.abc import Listener, SocketStream, TaskGroup

__all__ = ["Listeners", "check_endpoint", "close_now"]

logger = logging.getLogger("loopbus.stream")

_FREE_PORT = "0 picks a free port"


def check_endpoint(
    owner: str, host: str | None, port: int, path: object, token: str | None
) -> None:
    """Raise :class:`~loopbus.MisconfigurationError` unless the server has somewhere to
    listen, and a token wherever machines other than this one could connect."""
    if host is None and path is None:
        raise MisconfigurationError(
            f"{owner} needs somewhere to listen: a TCP host (host='127.0.0.1') "
            "and/or a Unix socket path (path='/tmp/run.sock')."
        )
    if host is not None and (not isinstance(host, str) or not host.strip()):
        raise MisconfigurationError(
            f"{owner}(host=...) must be a host name or IP address such as "
            f"'127.0.0.1', got {host!r}; use host=None to serve only a Unix socket."
        )
    check_int("port", port, minimum=0, maximum=65535, owner=owner, hint=_FREE_PORT)
    if token is not None and (not isinstance(token, str) or not token):
        raise MisconfigurationError(
            f"{owner}(token=...) must be a non-empty str or None, got {token!r}."
        )
    if host is not None and not is_loopback(host) and token is None:
        raise MisconfigurationError(
            f"{owner}(host={host!r}) would accept connections from other machines, "
            "which requires a token: pass token='<a long random secret>' (clients give "
            "it to loopbus.connect(..., token=...) or `loopbus watch --token`), or bind "
            "to a loopback address such as host='127.0.0.1'."
        )


async def close_now(resource: Any) -> None:
    """Close ``resource`` now, even in a cancelled scope (shielded, then forcefully)."""
    with anyio.CancelScope(shield=True):
        await anyio.aclose_forcefully(resource)


def _format_address(kind: str, sockname: Any) -> str:
    if kind == "unix":
        return str(Address("unix", path=str(sockname)))
    host, port = sockname[0], sockname[1]
    return str(Address("tcp", host=host, port=port))


class Listeners:
    """The sockets one server listens on (TCP, a Unix socket, or both) and the addresses
    they serve, first TCP then Unix."""

    def __init__(
        self, listeners: list[Listener[Any]], addresses: tuple[str, ...], path: str | None
    ) -> None:
        self.listeners = listeners
        self.addresses = addresses
        self.path = path

    @classmethod
    async def open(cls, host: str | None, port: int, path: str | None, owner: str) -> Listeners:
        """Listen on ``host:port`` (if ``host``) and on ``path`` (if given), or raise
        :class:`~loopbus.StreamError` saying why not (closing what was opened)."""
        opened: list[tuple[str, Listener[Any]]] = []
        try:
            if host is not None:
                try:
                    multi = await anyio.create_tcp_listener(local_host=host, local_port=port)
                except OSError as exc:
                    where = Address("tcp", host=host, port=port)
                    raise StreamError(
                        f"{owner} could not listen on {where}: {exc.strerror or exc}. "
                        "Choose another port (port=0 picks a free one)."
                    ) from exc
                opened += [("tcp", listener) for listener in multi.listeners]
            if path is not None:
                _check_unix_path(path, owner)
                try:
                    unix = await anyio.create_unix_listener(path, mode=0o600)
                except OSError as exc:
                    raise StreamError(
                        f"{owner} could not listen on unix://{path}: {exc.strerror or exc}."
                    ) from exc
                opened.append(("unix", unix))
        except BaseException:
            for _, listener in opened:
                await close_now(listener)
            raise
        addresses: list[str] = []
        for kind, listener in opened:
            address = _format_address(kind, listener.extra(SocketAttribute.local_address))
            if address not in addresses:
                addresses.append(address)
        return cls([listener for _, listener in opened], tuple(addresses), path)

    async def accept(
        self,
        handle: Callable[[SocketStream], Coroutine[Any, Any, None]],
        task_group: TaskGroup,
        scope: anyio.CancelScope,
        turn: Callable[[], Awaitable[None]],
    ) -> None:
        """Serve each connection with ``handle`` in ``task_group`` until ``scope`` is
        cancelled; then stop listening. Each listener awaits ``turn()`` before it accepts
        a connection (until then, connections wait in the listen queue)."""
        try:
            with scope:
                async with anyio.create_task_group() as tg:
                    for listener in self.listeners:
                        tg.start_soon(_accept_loop, listener, handle, task_group, turn)
        finally:
            await self.close()

    async def close(self) -> None:
        """Stop listening, and remove the Unix socket file (it may be called again)."""
        for listener in self.listeners:
            await close_now(listener)
        if self.path is not None:
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(os.stat(self.path).st_mode):
                    os.unlink(self.path)


async def _accept_loop(
    listener: Listener[Any],
    handle: Callable[[SocketStream], Coroutine[Any, Any, None]],
    task_group: TaskGroup,
    turn: Callable[[], Awaitable[None]],
) -> None:
    while True:
        # The turn is taken before the connection is accepted: one accepted and not
        # read would still be read ahead by some event loops.
        await turn()
        try:
            stream = await listener.accept()  # type: ignore[attr-defined]
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            return
        except OSError as exc:  # out of file descriptors, aborted connection, ...
            logger.warning("stream server: accept failed: %s", exc)
            await anyio.sleep(0.1)
            continue
        task_group.start_soon(handle, stream, name="loopbus stream client")


def _check_unix_path(path: str, owner: str) -> None:
    """Raise unless ``path`` is free to listen on: absent, or a stale socket file."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise StreamError(
            f"{owner} cannot listen on unix://{path}: the path exists and is not a "
            "socket. Choose another path."
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(path)
    except OSError:
        return  # a stale socket file: create_unix_listener replaces it
    finally:
        probe.close()
    raise StreamError(
        f"{owner} cannot listen on unix://{path}: another server is listening "
        "there. Choose another path."
    )
