"""Where a stage stops: one :class:`StopControl` per trainer, the only code that turns
stop requests into a stop.

It takes every request (``trainer.request_stop`` from a user or a plugin, a preemption
signal's, from any task or thread), agrees them across ranks on its own schedule when
``fit`` runs under a distributed strategy (:class:`StopExchange`, over the collectives
the strategy's :class:`StopTransport` gives), and answers the loops at a boundary: the
loops read ``state.stop_requested`` (a plain attribute read) and never start or wait for
a collective themselves. The controller gives them, once per run, what to run between
two batches (:attr:`StopControl.boundary`, None in one process: nothing to exchange)
and what to run at the rare boundaries (:meth:`StopControl.settle`: after a validation,
between epochs), and tells whoever listens where training stopped
(:meth:`StopControl.stopping`: the preemption handling announces a preemption there).

The run state records the outcome (``stop_requested``, ``stop_reason``, a request still
waiting for the ranks to agree: ``pending_stop``); only this controller writes it.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Protocol

import torch

from loopbus.state._runstate import RunState

__all__ = ["StopControl", "StopExchange", "StopNotice", "StopTransport"]


@dataclass(frozen=True, slots=True)
class StopTransport:
    """The collectives the ranks exchange stop requests with (a distributed strategy's
    :meth:`~loopbus.Strategy.stop_transport`; DDP and FSDP use gloo on the host, so no
    step waits for a device):

    * ``interval``: about how many seconds apart the periodic exchange runs (the
      trainer's ``stop_check_interval_s``; 0: at every batch boundary);
    * ``rank``: this process's global rank (to name where a request came from);
    * ``start_max(tensor)``: start an all-reduce (MAX) in place and return what waits
      for it (``.wait()``);
    * ``max_now(tensor)``: the same all-reduce, blocking;
    * ``gather(reason)``: every rank's pending reason (or None), in rank order.
    """

    interval: float
    rank: int
    start_max: Callable[[torch.Tensor], Any]
    max_now: Callable[[torch.Tensor], None]
    gather: Callable[[str | None], list[str | None]]


class StopNotice(Protocol):
    """Who hears, at the boundary where training stops on a stop request, that it stops
    there (the run's preemption handling: it announces a preemption while the position is
    still the one a checkpoint resumes from exactly)."""

    async def stopping(self) -> None: ...


class StopExchange:
    """Makes stop requests collective at a cost that does not grow with the number of
    steps: one small asynchronous all-reduce every ``interval`` seconds, none per step.

    At a check (a batch boundary every rank reaches after the same number of steps) a
    rank waits for the all-reduce it started at the previous check (long done by then),
    reads it, and starts the next one with ``[asked, -steps]``: whether this rank asked
    to stop, and how many steps make ``interval`` seconds at its own recent pace. The
    reduction is MAX, so every rank reads the same "somebody asked" and the same number
    of steps to the next check (the smallest proposed): the schedule stays identical on
    every rank even when their clocks disagree. A request is therefore seen by every
    rank at the same boundary, one to two intervals after it was made. ``interval=0``
    checks at every boundary: a request made before boundary ``k`` stops every rank at
    boundary ``k + 1`` whatever the timing (deterministic, one all-reduce a step).

    ``reduce(tensor)`` starts the all-reduce (MAX) and returns something with
    ``wait()``; ``agree(state)`` is called, on every rank at the same boundary, when a
    rank asked; ``clock`` gives seconds. The strategy owns one per trainer."""

    __slots__ = (
        "_agree",
        "_buf",
        "_clock",
        "_countdown",
        "_last",
        "_reduce",
        "_steps",
        "_work",
        "interval",
    )

    #: The most steps between two checks, however fast the steps.
    MAX_STEPS = 100_000

    def __init__(
        self,
        interval: float,
        reduce: Callable[[torch.Tensor], Any],
        agree: Callable[[RunState], None],
        clock: Callable[[], float] = perf_counter,
    ) -> None:
        self.interval = float(interval)
        self._reduce = reduce
        self._agree = agree
        self._clock = clock
        self._buf = torch.zeros(2, dtype=torch.int64)
        self._work: Any = None
        self._countdown = 1
        self._steps = 1
        self._last: float | None = None

    def reset(self) -> None:
        """A stage starts: check at its first boundary, nothing in flight (what an
        interrupted stage left is dropped)."""
        self._work = None
        self._countdown = 1
        self._steps = 1
        self._last = None

    @property
    def in_flight(self) -> bool:
        """Whether an exchange was started and not read yet."""
        return self._work is not None

    @property
    def steps_to_next_check(self) -> int:
        return self._countdown

    def boundary(self, state: RunState) -> None:
        """A batch boundary (the hot path: a decrement, and a check when it is due)."""
        self._countdown -= 1
        if self._countdown <= 0:
            self._check(state)

    def _check(self, state: RunState) -> None:
        now = self._clock()
        steps = 1 if self._work is None else self._read(state)
        if state.stop_requested:
            return
        # This rank's proposal for the interval after the next check, from its pace
        # since the last one (a validation in between only shortens it, once); the
        # stage's first check knows no pace yet, and proposes the next boundary.
        last = self._last
        per_step = 0.0 if last is None else (now - last) / self._steps
        wanted = int(self.interval / per_step) if per_step > 0 else 1
        buf = self._buf
        buf[0] = 0 if state.pending_stop is None else 1
        buf[1] = -min(max(wanted, 1), self.MAX_STEPS)
        self._work = self._reduce(buf)
        self._countdown = self._steps = steps
        self._last = now

    def _read(self, state: RunState) -> int:
        """Wait for the exchange in flight and act on it: agree on a stop if a rank asked;
        the number of steps to the next check."""
        self._work.wait()
        self._work = None
        asked, negative_steps = self._buf.tolist()
        if asked > 0 and not state.stop_requested:
            self._agree(state)
        return int(-negative_steps)

    def settle(self, state: RunState) -> None:
        """At a rare boundary: read the exchange in flight, if any (agreeing on a stop it
        carries); the next boundary starts a new one."""
        if self._work is not None:
            self._read(state)
        # Check at the next boundary, timing the pace over the boundaries actually
        # passed since the last check.
        self._steps = max(self._steps - self._countdown, 0) + 1
        self._countdown = 1


class StopControl:
    """The one place that decides where a stage stops (see the module's docstring).

    The trainer owns one; its stage calls :meth:`begin` when it starts (with the
    strategy's transport during ``fit``, else None, and who hears where training
    stopped) and :meth:`end` when it ends.
    """

    __slots__ = ("_exchange", "_flag", "_notice", "_state", "_transport", "boundary")

    def __init__(self, state: RunState) -> None:
        self._state = state
        self._notice: StopNotice | None = None
        self._transport: StopTransport | None = None
        self._exchange: StopExchange | None = None
        # The blocking exchange of the rare boundaries: one flag.
        self._flag = torch.zeros(1, dtype=torch.int32)
        #: What the training loop runs at every batch boundary, before it reads whether to
        #: stop: the periodic exchange (under a distributed strategy during ``fit``), or
        #: None (nothing to do: a request takes effect at the next boundary).
        self.boundary: Callable[[], None] | None = None

    # ------------------------------------------------------------ requests
    def request(self, reason: str | None = None) -> None:
        """Ask the running stage to stop at the next step boundary (every rank at the
        same one when the stage is collective). Safe from any task or thread, and from a
        signal handler (it allocates nothing of its own)."""
        self._state.request_stop(reason)

    # ------------------------------------------------------------ the stage
    def begin(self, transport: StopTransport | None, notice: StopNotice | None = None) -> None:
        """A stage starts (after ``RunState.begin_stage``). With a transport, requests
        wait for the ranks to agree: the periodic exchange runs at batch boundaries and a
        blocking one at the rare boundaries. ``notice`` hears where training stopped."""
        self._notice = notice
        self._transport = transport
        if transport is None:
            self._exchange = None
            self.boundary = None
            return
        state = self._state
        state.make_stop_collective()
        exchange = StopExchange(transport.interval, transport.start_max, self._agree)
        self._exchange = exchange
        self.boundary = functools.partial(exchange.boundary, state)

    def end(self) -> None:
        """The stage ended: nothing is exchanged until the next one begins."""
        self._notice = None
        self._transport = None
        self._exchange = None
        self.boundary = None

    # ------------------------------------------------------------ the loops
    def settle(self) -> None:
        """At a rare boundary (after a validation, between epochs): every rank agrees,
        now, on every request made so far (one blocking exchange of a flag; nothing in
        one process)."""
        transport = self._transport
        if transport is None:
            return
        state = self._state
        exchange = self._exchange
        assert exchange is not None
        exchange.settle(state)
        if state.stop_requested:
            return
        flag = self._flag
        flag[0] = 0 if state.pending_stop is None else 1
        transport.max_now(flag)
        if int(flag[0]):
            self._agree(state)

    def stopping(self) -> Awaitable[None]:
        """Training stops at this boundary because it was asked to: tell the listener."""
        notice = self._notice
        return _nothing() if notice is None else notice.stopping()

    def _agree(self, state: RunState) -> None:
        """A rank asked to stop: every rank learns who and why, and stops."""
        transport = self._transport
        assert transport is not None
        for rank, reason in enumerate(transport.gather(state.pending_stop)):
            if reason is not None:
                text = reason if rank == transport.rank else f"{reason} (on rank {rank})"
                state.confirm_stop(text)
                return
        # Asked, then withdrawn by a new stage: nobody has a reason left.
        state.confirm_stop("stop requested (on another rank)")


async def _nothing() -> None:
    return None
