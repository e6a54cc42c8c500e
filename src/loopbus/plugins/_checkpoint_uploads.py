"""The ``Checkpoint`` plugin's uploads to an object store while the store is down:
whether a save that falls due while the previous upload is in flight waits for it or is
skipped, and what the run is told: once when saves start failing (the cause, and how
long the store has failed), once when they succeed again. The store's health
(:class:`~loopbus.storage.StoreHealth`, which every call to it reports into) is read
without a call to the store. While the store fails, a due save is skipped before
anything is written, and one cheap call asks the store in the background whether it is
back: the first save due after it answers is written.

Written against the public API only, like a user's plugin.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from typing import TYPE_CHECKING

import anyio

from loopbus import RemotePath
from loopbus.storage import Store

if TYPE_CHECKING:
    from loopbus import TrainerView

__all__ = ["Uploads"]


class Uploads:
    """The uploads of one ``Checkpoint`` plugin to the store of ``where`` in one fit, and
    the outage they meet: since when saves fail, how many were skipped or failed, and
    whether that was said. Rank 0's (it alone uploads); :meth:`ready` is called on every
    rank."""

    def __init__(self, where: RemotePath, retries: int) -> None:
        self.where = where
        self.retries = retries
        self._started: float | None = None  # the upload in flight began
        self._down_since: float | None = None  # saves fail since (None: they do not)
        self._skipped = 0
        self._failed = 0
        self._asking: threading.Thread | None = None  # the call asking whether it is back

    @property
    def down(self) -> bool:
        """Whether saves to the store are failing now (as this plugin has found)."""
        return self._down_since is not None

    def began(self) -> None:
        """An upload starts in the background."""
        self._started = time.monotonic()

    async def ready(
        self, trainer: TrainerView, idle: anyio.Event | None, *, final: bool = False
    ) -> bool:
        """Whether the save now due may start: the upload in flight (``idle`` not set)
        is waited for at most ``save_wait_s``, and not at all while the store fails (it
        failed a try and has answered none since); still in flight, the due save is
        skipped: False. The ``final`` save (``fit`` ends: it waits for that upload
        anyway) waits for it whole, and is skipped only if the store still fails. Rank
        0 decides, every rank takes its answer."""
        why: str | None = None
        if trainer.is_global_zero and idle is not None and not idle.is_set():
            why = await self._wait(idle, final)
        elif trainer.is_global_zero and self.down and self.where.health is not None:
            why = self._ask() if self._failing() else None
        if trainer.world_size > 1:
            why = trainer.strategy.broadcast_object(why)
        if why is None:
            return True
        if trainer.is_global_zero:
            self._skipped += 1
            self._fail(f"the save due at step {trainer.global_step} was skipped: {why}")
        return False

    def _failing(self) -> bool:
        """Whether the store fails now: a try failed and none was answered since (or,
        without its health, saves failed and none succeeded since)."""
        health, since = self.where.health, self._down_since
        if health is None:
            return since is not None
        return health.outage is not None or (since is not None and not health.answered_since(since))

    def _ask(self) -> str:
        """The store fails and no upload is in flight: the due save is skipped, nothing
        written, and one call (a look-up of ``last.json``, not retried, held to the
        store's deadlines) asks the store in a thread of its own whether it answers again
        (unless such a call is in flight); its answer ends the outage in the store's
        health, and the next due save is written."""
        if self._asking is None or not self._asking.is_alive():
            store = Store(self.where, retries=0)

            def ask() -> None:
                with contextlib.suppress(Exception):  # its outcome goes to the health
                    store.size("last.json")

            self._asking = threading.Thread(target=ask, name="loopbus-store-ask", daemon=True)
            self._asking.start()
        return (
            "the store fails: nothing written; it is asked in the background whether it "
            "answers again"
        )

    async def _wait(self, idle: anyio.Event, final: bool) -> str | None:
        """Wait for the upload in flight: None once it is over, else why not (the store
        failing: no wait at all)."""
        if final:
            await idle.wait()
            return "the store still fails as fit ends" if self._failing() else None
        if self._failing():
            return "the previous upload is still in flight, retrying a store that fails"
        wait_s = self.where.deadlines.save_wait_s
        started = time.monotonic() if self._started is None else self._started
        with anyio.move_on_after(wait_s):
            await idle.wait()
        if idle.is_set():
            return None
        return (
            f"the previous upload is still in flight after {time.monotonic() - started:.1f} s "
            f"(store_deadlines save_wait_s={wait_s:g}): the store may be stalled"
        )

    def failed(self, error: BaseException) -> None:
        """The upload in flight failed (``upload_errors="warn"``): said if it is the
        outage's first failure."""
        self._failed += 1
        cause = " ".join(str(error).split())
        self._fail(f"an upload failed after {self.retries + 1} tries", cause)

    def succeeded(self) -> None:
        """The upload in flight succeeded: saves resume (said once, after an outage)."""
        since, self._down_since = self._down_since, None
        if since is None:
            return
        skipped, failed, self._skipped, self._failed = self._skipped, self._failed, 0, 0
        warnings.warn(
            f"Checkpoint saves to {self.where.public_url} resumed: the store answers again "
            f"after {time.monotonic() - since:.1f} s of failures ({skipped} due save(s) "
            f"skipped, {failed} upload(s) failed meanwhile); last.json names the newest "
            "checkpoint again.",
            UserWarning,
            stacklevel=4,
        )

    def _fail(self, what: str, cause: str | None = None) -> None:
        """A save failed or was skipped: the outage starts (said once, with ``cause``,
        else the store's last error) or goes on."""
        if self._down_since is not None:
            return
        health = self.where.health
        outage = None if health is None else health.outage
        began = [self._started, None if outage is None else outage.since]
        self._down_since = min((t for t in began if t is not None), default=time.monotonic())
        cause = cause or (None if outage is None else outage.cause)
        said = f": {cause}" if cause else ""
        deadlines = self.where.deadlines
        warnings.warn(
            f"Checkpoint cannot save to {self.where.public_url} now: {what}{said} (failing "
            f"for {time.monotonic() - self._down_since:.1f} s). Training goes on: while the "
            "store fails, due saves are skipped at once, nothing written, and one call at a "
            "time asks the store whether it answers again; the first save due after it "
            f"does is written (calls abandoned after call_s={deadlines.call_s:g} s, uploads "
            f"tried {self.retries + 1} times); a warning says when saves resume, and "
            "last.json names the last complete checkpoint meanwhile "
            "(Checkpoint(upload_errors='raise') stops the run instead).",
            UserWarning,
            stacklevel=4,
        )
