"""What the calls to one object store have met lately: whether they fail now (an outage:
since when, and the last failure's cause) and when a call was last answered. A
:class:`~loopbus.RemotePath` made with a :class:`StoreHealth` hands it to every path
derived from it, and every :class:`~loopbus.storage.Store` over those paths reports each
try of each call to it; whoever watches the store (the ``Checkpoint`` plugin) reads it,
without a call to the store.

Imports the standard library only.
"""

from __future__ import annotations

import dataclasses
import threading
import time

__all__ = ["Outage", "StoreHealth"]


@dataclasses.dataclass(frozen=True)
class Outage:
    """Calls to a store failing: since ``since`` (``time.monotonic()``), the last
    failure's ``cause`` (one line), and how many tries have failed since."""

    since: float
    cause: str
    failures: int

    @property
    def lasted_s(self) -> float:
        """How long the outage has lasted, in seconds."""
        return time.monotonic() - self.since


class StoreHealth:
    """The health of one store as its calls find it; thread-safe (the calls run in
    worker threads). One owner writes it: the :class:`~loopbus.storage.Store` making the
    calls (:meth:`failed` after a try that failed, :meth:`answered` after one the store
    answered, a missing object included)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outage: Outage | None = None
        self._answered_at: float | None = None
        self._given_up = threading.Event()

    def __reduce__(self) -> tuple[type[StoreHealth], tuple[()]]:
        """Sent to another process (a path broadcast to the ranks), a health starts
        afresh: what the calls met here is this process's."""
        return (StoreHealth, ())

    def failed(self, cause: str) -> None:
        """A try of a call failed with ``cause``."""
        now = time.monotonic()
        with self._lock:
            outage = self._outage
            since = now if outage is None else outage.since
            count = 1 if outage is None else outage.failures + 1
            self._outage = Outage(since=since, cause=cause, failures=count)

    def answered(self) -> None:
        """A try of a call was answered: the outage, if any, is over."""
        now = time.monotonic()
        with self._lock:
            self._outage = None
            self._answered_at = now
            self._given_up.clear()

    def give_up(self) -> None:
        """While the outage lasts (if there is one now), calls stop retrying: a try that
        fails is the last, a wait between tries and a call in flight end at once. For a
        run that is ending: it does not wait through the tries of a store that is down.
        The store answering again ends it."""
        with self._lock:
            if self._outage is not None:
                self._given_up.set()

    @property
    def given_up(self) -> bool:
        """Whether calls stop retrying now (see :meth:`give_up`)."""
        return self._given_up.is_set()

    def pause(self, seconds: float) -> bool:
        """Wait ``seconds`` between two tries, or less if calls give up meanwhile;
        whether they did."""
        return self._given_up.wait(seconds)

    @property
    def outage(self) -> Outage | None:
        """The outage now, or None while the store answers."""
        with self._lock:
            return self._outage

    def answered_since(self, moment: float) -> bool:
        """Whether a try was answered at or after ``moment`` (``time.monotonic()``)."""
        with self._lock:
            return self._answered_at is not None and self._answered_at >= moment
