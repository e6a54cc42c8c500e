"""How a trainer spreads a run over processes: the :class:`Strategy` interface, one
process (:class:`SingleProcess`), and how stop requests become collective
(:class:`StopExchange`). The distributed strategies live in modules of their own behind
the same interface: DDP in ``_ddp.py``, FSDP2 (``fully_shard``) in ``_fsdp.py``.

``Trainer(strategy="auto")`` picks DDP when the launcher says the world has more than one
process (``WORLD_SIZE > 1`` with ``RANK``/``LOCAL_RANK`` set, as ``torchrun`` does), else
:class:`SingleProcess`, which changes nothing. ``strategy="fsdp"`` (or an
``FSDPStrategy(...)`` with options) shards the module. The trainer owns its strategy
(``trainer.strategy``); the strategy owns what it wraps or shards.

What the rest of the engine asks of a strategy, and nothing more (loops and plugins never
ask which one runs):

* ``prepare_module`` (a stage starts: put the module where it runs; FSDP shards it),
  ``prepare_optimizers`` (after ``configure_optimizers``), ``prepare_train_data``;
* ``wrap`` (what the training step's forward calls), ``no_sync`` (the context of an
  accumulation window's non-final micro-batches), ``clip_gradients``;
* the collective stop (``exchange_stop``, ``settle_stop``) and the small collectives a
  checkpoint needs (``all_gather_object``, ``broadcast_object``, ``barrier``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from time import perf_counter
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from loopbus.state._runstate import RunState
    from loopbus.step._module import Module
    from loopbus.step._precision import Precision

__all__ = [
    "SingleProcess",
    "StopExchange",
    "Strategy",
    "StrategyName",
    "launched_distributed",
]

StrategyName = Literal["auto", "ddp", "fsdp", "single"]


def launched_distributed() -> bool:
    """Whether a launcher such as torchrun started this process as one of several."""
    env = os.environ
    try:
        world = int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    return world > 1 and ("RANK" in env or "LOCAL_RANK" in env)


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


class Strategy:
    """One process (the default): no wrapper, no collectives."""

    sharded_state: bool = False
    #: Whether a checkpoint holds the gradients of an unfinished accumulation window, so
    #: that a run stopped inside one resumes exactly: in one process it does; under DDP
    #: and FSDP each rank accumulates its own (FSDP keeps them unsharded, to itself) and a
    #: checkpoint holds one rank's or none, so there a stop waits for the window's end.
    saves_window_gradients: bool = True

    name = "single"
    world_size = 1
    global_rank = 0
    local_rank = 0

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def distributed(self) -> bool:
        return False

    def setup_environment(self, device: torch.device) -> None:
        """Called when the trainer is built."""

    def prepare_module(self, module: Module, device: torch.device, precision: Precision) -> None:
        """A stage starts (before ``configure_optimizers``): put the module where it runs.
        Here and under DDP it is moved to ``device``; FSDP shards it (and materialises a
        module built on the ``meta`` device)."""
        module.to(device)

    def prepare_optimizers(
        self, optimizers: list[torch.optim.Optimizer], module: Module
    ) -> list[torch.optim.Optimizer]:
        """The optimizers ``configure_optimizers`` returned, checked or adapted for this
        strategy (as they are, here)."""
        return optimizers

    def wrap(self, module: Module, state: RunState) -> Any:
        """What the training step's forward calls (``fit`` starts): ``module.training_step``
        here; a distributed strategy's wrapper of it, which also makes ``state``'s stop
        requests collective."""
        return module.training_step

    def unwrap(self) -> None:
        """Forget the wrapper (the stage ended)."""

    def no_sync(self) -> AbstractContextManager[Any]:
        """A context in which backward does not synchronise gradients (the non-final
        micro-batches of an accumulation window)."""
        return nullcontext()

    def clip_gradients(
        self, parameters: list[torch.Tensor], value: float, algorithm: Literal["norm", "value"]
    ) -> None:
        """Clip the gradients of ``parameters`` to ``value``: their norm over every rank's
        gradients (``"norm"``) or each element (``"value"``). torch's clipping handles
        DTensor gradients (FSDP): the norm of sharded gradients is the global one."""
        if algorithm == "norm":
            torch.nn.utils.clip_grad_norm_(parameters, value)
        else:
            torch.nn.utils.clip_grad_value_(parameters, value)

    def prepare_train_data(self, data: Any) -> Any:
        return data

    def exchange_stop(self, state: RunState) -> None:
        """At a batch boundary: make stop requests collective (nothing to do in one
        process; under DDP a periodic asynchronous exchange, see :class:`StopExchange`)."""

    def settle_stop(self, state: RunState) -> None:
        """At a rare boundary (after validation, between epochs): agree on every stop
        requested so far, at once."""

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return obj

    def barrier(self) -> None:
        """Wait for every rank."""


class SingleProcess(Strategy):
    """``strategy="single"``: the run stays in this process."""
