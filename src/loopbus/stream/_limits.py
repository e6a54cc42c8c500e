"""What the stream server allows each client: queue and buffer sizes, frame sizes, how many
clients at once, how long it waits (to batch items, for a ``Hello``, for a closing bye),
and how much subscribing may cost it. The options are one frozen value, checked once when
the server is made; the fixed limits below are not options.

Subscribing is the one thing a client asks of the server that costs it work (decoding
the patterns, compiling them, matching record names against them again) and memory (a
``Subscribed`` answer queued for it), so it is bounded four ways: each connection's
Subscribe frames a second (the ``subscribe_rate`` option, after a burst of
:data:`SUBSCRIBE_BURST`) and characters of name patterns a second
(:data:`PATTERN_RATE`, after :data:`PATTERN_BURST`), the answers queued for a client
that does not read (:data:`UNREAD_ACKS`), all closing the connection when exceeded; and
the server's work on subscriptions over all its clients together (:data:`WORK_RATE`),
which makes a Subscribe beyond it wait its turn, so that no number of clients or
connections can take more of the process's time than that. A client closed for passing a
per-client bound is closed at once, without reading more of what it sent.

Connecting costs the server work too (accepting, the handshake, reading what the client
sends until it breaks a rule), so connections are accepted at most ``accept_rate`` a
second over all listeners (after a burst of :data:`ACCEPT_BURST`); beyond it they wait
in the operating system's listen queue, and the server reads nothing of them meanwhile;
and for :data:`ABORT_PAUSE` after a client was closed for passing a bound, each listener
accepts at most the one connection it was already waiting for.

A Subscribe's patterns count their characters, and a range of characters ``x-y`` a
quarter of its width more (:func:`~._connection.pattern_cost`): the ``re`` compiler
takes time in proportion to the width of a character class's ranges."""

from __future__ import annotations

from dataclasses import dataclass

from .._validate import check_int, check_number
from ._wire import MAX_CLIENT_FRAME

__all__ = [
    "ABORT_PAUSE",
    "ACCEPT_BURST",
    "BYE_TIMEOUT",
    "DISCARD_LIMIT",
    "PATTERN_BURST",
    "PATTERN_RATE",
    "READ_AHEAD",
    "RECEIVE_SIZE",
    "ROUTE_CACHE_LIMIT",
    "SUBSCRIBE_BURST",
    "SUBSCRIBE_WORK",
    "UNREAD_ACKS",
    "WORK_BURST",
    "WORK_RATE",
    "Allowance",
    "Limits",
]

#: Bytes read from a client at a time.
RECEIVE_SIZE = 65536
#: Record names whose clients are remembered at once (the cache starts over beyond it).
ROUTE_CACHE_LIMIT = 4096
#: Seconds to send a closing bye and see the client close its side.
BYE_TIMEOUT = 1.0
#: Bytes of a closing client's input read and thrown away, at most, before closing (after
#: a protocol error, so that the client can read its bye: a client that sent more than
#: this after its error may not; a client that passed a bound is not read at all).
DISCARD_LIMIT = 1 << 16
#: Bytes a client may send ahead of what the server handled (it holds them meanwhile):
#: some fifteen of the largest Subscribe (a client message has at most about 17 kB).
READ_AHEAD = 1 << 18
#: Subscribe frames a client may send at once; after them, ``subscribe_rate`` a second.
SUBSCRIBE_BURST = 20
#: Characters of name patterns a client's Subscribe frames may carry at once (four of the
#: largest Subscribe, 64 patterns of 256 characters), and a second after that.
PATTERN_BURST = 65536
PATTERN_RATE = 4096
#: ``Subscribed`` answers that may wait for a client that does not read (they wait only
#: once the socket's buffers are full); one more closes the connection.
UNREAD_ACKS = 16
#: The server's work on subscriptions, over all clients together, in units of a pattern
#: character (a Subscribe costs its patterns' characters plus :data:`SUBSCRIBE_WORK`,
#: for decoding it and matching record names again): this much at once, then this much
#: a second (the largest Subscribe, 16,384 characters, compiles in 15 to 50 ms: at most
#: about 1.2% of one core).
WORK_BURST = 65536
WORK_RATE = 4096
SUBSCRIBE_WORK = 256
#: Connections the server may accept at once, over all its listeners; after them,
#: ``accept_rate`` a second.
ACCEPT_BURST = 64
#: Seconds the server accepts no connection after it closed one for passing a bound (the
#: pauses of several such closes do not add up).
ABORT_PAUSE = 1.0

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
    subscribe_rate: float = 10.0
    accept_rate: float = 10.0

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
        subscribe_rate: float,
        accept_rate: float,
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
            subscribe_rate=check_number(
                "subscribe_rate",
                subscribe_rate,
                exclusive_minimum=0,
                owner=owner,
                what="a number of Subscribe frames a second",
            ),
            accept_rate=check_number(
                "accept_rate",
                accept_rate,
                exclusive_minimum=0,
                owner=owner,
                what="a number of connections a second",
            ),
        )

    @property
    def early_flush(self) -> int:
        """Items waiting that end the pause between two hand-overs early: half a client's
        queue."""
        return max(1, self.client_buffer // 2)


class Allowance:
    """A token bucket: at most ``burst`` units at once, refilled at ``rate`` units a
    second. Times are the caller's clock (seconds)."""

    __slots__ = ("_level", "_stamp", "burst", "rate")

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._level = float(burst)
        self._stamp: float | None = None

    def _refill(self, now: float) -> None:
        if self._stamp is not None:
            self._level = min(self.burst, self._level + (now - self._stamp) * self.rate)
        self._stamp = now

    def take(self, amount: float, now: float) -> bool:
        """Take ``amount`` units if they are there (True); otherwise take none (False)."""
        self._refill(now)
        if amount > self._level:
            return False
        self._level -= amount
        return True

    def reserve(self, amount: float, now: float) -> float:
        """Take ``amount`` units, going into debt for what is missing; return the seconds
        until the debt is paid (0.0 if there is none): how long the caller waits for its
        turn. Callers that reserve one after another wait in that order."""
        self._refill(now)
        self._level -= amount
        return max(0.0, -self._level / self.rate)

    def pause(self, seconds: float, now: float) -> None:
        """Take every unit there is and go into debt for ``seconds`` of refill (unless the
        debt is already deeper): callers of :meth:`reserve` wait that long for the next
        unit, however often this is called."""
        self._refill(now)
        self._level = min(self._level, -seconds * self.rate)
