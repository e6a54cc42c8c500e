"""Stream addresses: ``tcp://HOST:PORT`` and ``unix:///path/to/socket``."""

from __future__ import annotations

import ipaddress
from typing import Literal

import anyio
from anyio.abc import SocketStream

from .._exceptions import MisconfigurationError

__all__ = ["Address", "is_loopback", "parse_address"]

_HELP = (
    "use tcp://HOST:PORT (for example tcp://127.0.0.1:8765), HOST:PORT, a bare PORT "
    "(on 127.0.0.1), or unix:///path/to/socket"
)


class Address:
    """Where a stream server listens: ``kind`` is ``"tcp"`` (with ``host`` and ``port``)
    or ``"unix"`` (with ``path``). ``str(address)`` gives the URL form back."""

    __slots__ = ("host", "kind", "path", "port")

    def __init__(
        self,
        kind: Literal["tcp", "unix"],
        *,
        host: str = "",
        port: int = 0,
        path: str = "",
    ) -> None:
        self.kind = kind
        self.host = host
        self.port = port
        self.path = path

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix://{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    def __repr__(self) -> str:
        return f"Address({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Address) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    async def connect(self) -> SocketStream:
        """Open a connection to this address."""
        if self.kind == "unix":
            return await anyio.connect_unix(self.path)
        return await anyio.connect_tcp(self.host, self.port)


def _port(text: str, original: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise MisconfigurationError(
            f"stream address {original!r} has port {text!r}; a port is a number from 0 to "
            f"65535 ({_HELP})."
        )
    return int(text)


def parse_address(address: str | Address) -> Address:
    """Read a stream address. ``tcp://HOST:PORT``, ``HOST:PORT`` and ``PORT`` are TCP
    (IPv6 hosts in brackets: ``tcp://[::1]:8765``); ``unix:///abs/path``,
    ``unix:relative/path`` and anything starting with ``/`` or ``./`` are Unix sockets."""
    if isinstance(address, Address):
        return address
    if not isinstance(address, str) or not address.strip():
        raise MisconfigurationError(
            f"a stream address must be a non-empty str ({_HELP}), got {address!r}."
        )
    text = address.strip()
    if text.startswith("unix:"):
        path = text[len("unix:") :]
        if path.startswith("//"):
            path = path[2:]
        if not path:
            raise MisconfigurationError(
                f"stream address {address!r} names no socket path; {_HELP}."
            )
        return Address("unix", path=path)
    if text.startswith(("/", "./", "../")):
        return Address("unix", path=text)
    if "://" in text:
        scheme, _, rest = text.partition("://")
        if scheme != "tcp":
            raise MisconfigurationError(
                f"{address!r} is not a stream address: scheme {scheme!r} is not served; {_HELP}."
            )
        text = rest.rstrip("/")
    if text.isdigit():
        return Address("tcp", host="127.0.0.1", port=_port(text, address))
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise MisconfigurationError(f"cannot read {address!r} as a stream address; {_HELP}.")
    else:
        host, sep, port = text.rpartition(":")
        if not sep or ":" in host:
            raise MisconfigurationError(f"cannot read {address!r} as a stream address; {_HELP}.")
    return Address("tcp", host=host or "127.0.0.1", port=_port(port, address))


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only (``localhost``, ``127.x.y.z``, ``::1``)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
