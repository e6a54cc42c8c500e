"""Preemption: SIGTERM and SIGUSR1 stop a stage at the next step boundary, where the run
is announced as preempted (``PreemptionRequested``: the ``Checkpoint`` plugin saves), and
the stage ends as a stopped one before :class:`~loopbus.Preempted` asks the process to
exit with a documented status.

The trainer owns one :class:`Preemption`. The stage's lifecycle enters
:meth:`Preemption.handling` around the stage (signal handlers installed, in the main thread
only, and the application's own restored afterwards) and calls :meth:`Preemption.check`
once the stage ended well; the loops call :meth:`Preemption.stopping` at the boundary
where a stop took effect (the ``StopNotice`` of their host, ``_loops.py``).

Why not ``anyio.open_signal_receiver``: on asyncio it goes through
``loop.add_signal_handler``, whose removal sets the signal back to its default action
rather than to the handler the application had, and it needs a task of its own to read
the signals; a plain ``signal.signal`` handler that only records the signal and asks for
a stop works the same under asyncio, trio, ``executor="thread"`` (the step's worker thread
never runs handlers; the event loop's thread does) and keeps the application's handler,
which it calls after its own.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any, Literal, Protocol

from loopbus.state._runstate import RunState

from .._exceptions import Preempted
from ..events import Event, PreemptionRequested
from ._options import TrainerOptions
from ._plugin import Plugin

__all__ = ["PREEMPTION_SIGNALS", "Preemption"]

_log = logging.getLogger("loopbus")

#: The signals handled: SIGTERM (what Kubernetes, spot reclaims, SLURM's time limit and
#: torchrun's shutdown send) and SIGUSR1 (SLURM's early warning with ``--signal``).
PREEMPTION_SIGNALS: tuple[signal.Signals, ...] = tuple(
    sig for sig in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None)) if sig
)

_Handler = Callable[[int, FrameType | None], Any] | int | None


class Ranks(Protocol):
    """What preemption needs of the strategy: this process's rank, and one exchange."""

    @property
    def global_rank(self) -> int: ...

    def all_gather_object(self, obj: Any) -> list[Any]: ...


class Preemption:
    """A trainer's handling of the preemption signals (see ``Trainer(preemption=...)``).

    The signal handler records the signal (its number and time) and asks the run's stop
    control to stop (``request_stop``, collective under DDP): nothing else, so it is safe
    whatever the main thread was doing. A second signal (or ``grace`` seconds after the
    first, from a watchdog thread) ends the process at once with the exit status; the
    atomic checkpoint writer leaves no half-written file behind.
    """

    def __init__(
        self,
        state: RunState,
        request_stop: Callable[[str | None], None],
        ranks: Ranks,
        publish: Callable[[Event], Awaitable[Any]],
        options: TrainerOptions,
    ) -> None:
        self._state = state
        self._request_stop = request_stop
        self._ranks = ranks
        self._publish = publish
        self._mode: bool | Literal["auto"] = options.preemption
        self._exit_code = options.preemption_exit_code
        self._grace = options.preemption_grace_s
        # Written by the signal handler only: (signal number, time.time()).
        self._received: tuple[int, float] | None = None
        # What the ranks agreed on at the stop: (signal number, rank, deadline).
        self._agreed: tuple[int, int, float | None] | None = None
        self._consulted = False
        self._active = False
        self._previous: dict[int, _Handler] = {}
        # One bound method, so that restoring can tell whether ours is still installed.
        self._handler = self._handle
        self._watchdog: threading.Thread | None = None
        self._closed = threading.Event()
        self._reasons = {int(sig): f"preempted ({sig.name})" for sig in PREEMPTION_SIGNALS}

    def exit_code(self, signum: int) -> int:
        """The exit status for ``signum``: the option's, else 128 + the number."""
        return self._exit_code if self._exit_code is not None else 128 + signum

    def wanted(self, plugins: Iterable[Plugin]) -> bool:
        """Whether a stage with these (active) plugins handles the signals."""
        if self._mode == "auto":
            return any(p.handles_preemption for p in plugins)
        return bool(self._mode)

    # ------------------------------------------------------------ the stage
    @contextmanager
    def handling(self, plugins: Iterable[Plugin]) -> Iterator[None]:
        """Handle the signals while the stage runs (when :meth:`wanted`, and only in the
        main thread, where Python runs signal handlers); restore the previous handlers
        when it ends, however it ends."""
        self._received = None
        self._agreed = None
        self._consulted = False
        self._active = False
        if not self.wanted(plugins):
            yield
            return
        if threading.current_thread() is not threading.main_thread():
            _log.warning(
                "Trainer(preemption=...): the stage runs outside the main thread, where "
                "Python cannot install signal handlers; SIGTERM and SIGUSR1 keep the "
                "behaviour they have. Run the event loop in the main thread to handle them."
            )
            yield
            return
        self._install()
        try:
            yield
        finally:
            self._restore()

    def _install(self) -> None:
        self._active = True
        self._previous = {}
        for sig in PREEMPTION_SIGNALS:
            self._previous[int(sig)] = signal.signal(sig, self._handler)
        if self._grace is not None:
            self._closed.clear()
            self._watchdog = threading.Thread(
                target=self._watch, name="loopbus-preemption-grace", daemon=True
            )
            self._watchdog.start()

    def _restore(self) -> None:
        self._active = False
        for signum, previous in self._previous.items():
            if signal.getsignal(signum) == self._handler:
                signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            self._closed.set()
            watchdog.join()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler: record, ask for a stop, call the previous handler. Runs in
        the main thread between two bytecodes: it allocates nothing and does no I/O of
        its own (a second signal ends the process)."""
        if not self._active:
            self._chain(signum, frame)  # left installed by a stage that ended
            return
        if self._received is not None:
            try:
                self._chain(signum, frame)
            finally:
                self._end_now(signum, b"loopbus: a second preemption signal; exiting now\n")
        self._received = (signum, time.time())
        self._request_stop(self._reasons.get(signum))
        self._chain(signum, frame)

    def _chain(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous.get(signum)
        if callable(previous):
            previous(signum, frame)
        elif not self._active and previous in (signal.SIG_DFL, None):
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)

    def _end_now(self, signum: int, why: bytes) -> None:
        os.write(2, why)
        os._exit(self.exit_code(signum))

    def _watch(self) -> None:
        """The grace watchdog: ends the process ``grace`` seconds after the first signal."""
        grace = self._grace
        assert grace is not None
        while not self._closed.wait(0.05):
            received = self._received
            if received is not None and time.time() >= received[1] + grace:
                self._end_now(received[0], b"loopbus: preemption grace period over; exiting now\n")

    # ------------------------------------------------------------ the loops
    async def stopping(self) -> None:
        """Training stops at this boundary (every rank's the same): the first time in a
        stage, the ranks agree on whether a preemption signal caused it (one exchange),
        and if one did, :class:`PreemptionRequested` is published here, while the
        position is still the one a checkpoint resumes from exactly."""
        if not self._active or self._consulted:
            return
        self._consulted = True
        received = self._received
        mine = None
        if received is not None:
            deadline = None if self._grace is None else received[1] + self._grace
            mine = (received[0], self._ranks.global_rank, deadline)
        agreed = next((r for r in self._ranks.all_gather_object(mine) if r is not None), None)
        if agreed is None:
            return
        self._agreed = signum, rank, deadline = agreed
        state = self._state
        await self._publish(
            PreemptionRequested(
                stage=state.stage or "",
                signal=signal.Signals(signum).name,
                signum=signum,
                rank=rank,
                deadline=deadline,
                step=state.step,
                epoch=state.epoch,
            )
        )

    def check(self) -> None:
        """After a stage that ended well: raise :class:`Preempted` if a preemption
        signal stopped it (or arrived while it ran)."""
        signum = self._signum()
        if signum is None:
            return
        code = self.exit_code(signum)
        name = signal.Signals(signum).name
        step = self._state.step
        if self._ranks.global_rank == 0:
            _log.warning("stopped at step %d on %s; exiting with status %d", step, name, code)
        raise Preempted(code, signal=name, step=step)

    def _signum(self) -> int | None:
        if self._agreed is not None:
            return self._agreed[0]
        received = self._received
        return None if received is None else received[0]
