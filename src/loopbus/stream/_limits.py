"""What the stream server allows each client: queue and buffer sizes, frame sizes, how many
clients at once, and how long it waits (to batch items, for a ``Hello``, for a closing
bye). The options are one frozen value, checked once when the server is made; the fixed
limits below are not options."""

from __future__ import annotations

from dataclasses import dataclass

from .._validate import check_int, check_number
from ._wire import MAX_CLIENT_FRAME

__all__ = ["BYE_TIMEOUT", "DISCARD_LIMIT", "RECEIVE_SIZE", "ROUTE_CACHE_LIMIT", "Limits"]

#: Bytes read from a client at a time.
RECEIVE_SIZE = 65536
#: Record names whose clients are remembered at once (the cache starts over beyond it).
ROUTE_CACHE_LIMIT = 4096
#: Seconds to send a closing bye and see the client close its side.
BYE_TIMEOUT = 1.0
#: Bytes of a closing client's input read and thrown away, at most, before closing.
DISCARD_LIMIT = 1 << 20

_SECONDS = "a number of seconds"


@dataclass(frozen=True, slots=True)
class Limits:
    """The server's limits (the constructor options of the same names; see
    :class:`~loopbus.stream.Server`). Make one with :meth:`checked`, which says which
    option is wrong and why."""

    client_buffer: int = 16384
    send_buffer: int | None = None
    max_clients: int = 64
    max_frame: int = MAX_CLIENT_FRAME
    flush_interval: float = 0.1
    linger: float = 2.0
    handshake_timeout: float = 10.0

    @classmethod
    def checked(
        cls,
        *,
        client_buffer: int,
        send_buffer: int | None,
        max_clients: int,
        max_frame: int,
        flush_interval: float,
        linger: float,
        handshake_timeout: float,
        owner: str,
    ) -> Limits:
        """The limits, each checked (raising :class:`~loopbus.MisconfigurationError` for
        the first wrong one, in this order); the times become floats."""
        return cls(
            client_buffer=check_int(
                "client_buffer", client_buffer, owner=owner, hint="it counts records"
            ),
            max_clients=check_int("max_clients", max_clients, owner=owner),
            max_frame=check_int(
                "max_frame", max_frame, minimum=64, owner=owner, hint="it counts bytes"
            ),
            send_buffer=check_int(
                "send_buffer",
                send_buffer,
                minimum=1024,
                allow_none=True,
                owner=owner,
                hint="it counts bytes, and None keeps the system's default",
            ),
            flush_interval=check_number(
                "flush_interval", flush_interval, minimum=0, owner=owner, what=_SECONDS
            ),
            linger=check_number("linger", linger, minimum=0, owner=owner, what=_SECONDS),
            handshake_timeout=check_number(
                "handshake_timeout", handshake_timeout, minimum=0, owner=owner, what=_SECONDS
            ),
        )

    @property
    def early_flush(self) -> int:
        """Items waiting that end the pause between two hand-overs early: half a client's
        queue."""
        return max(1, self.client_buffer // 2)
