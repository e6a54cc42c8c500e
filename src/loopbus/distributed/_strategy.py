"""How a trainer spreads a run over processes: the :class:`Strategy` interface and one
process (:class:`SingleProcess`). The distributed strategies live in modules of their
own behind the same interface: DDP in ``_ddp.py``, FSDP2 (``fully_shard``) in
``_fsdp.py``; how stop requests become every rank's is the stop control's business
(``_stopping.py``), over the transport a strategy gives.

``Trainer(strategy="auto")`` picks DDP when the launcher says the world has more than one
process (``WORLD_SIZE > 1`` with ``RANK``/``LOCAL_RANK`` set, as ``torchrun`` does), else
:class:`SingleProcess`, which changes nothing. ``strategy="fsdp"`` (or an
``FSDPStrategy(...)`` with options) shards the module; ``strategy="ft"`` (or a
``FaultTolerantStrategy(...)``, ``_ft.py``) trains replica groups that survive the loss
of one (torchft). The trainer owns its strategy
(``trainer.strategy``); the strategy owns what it wraps or shards.

What the rest of the engine asks of a strategy, and nothing more (loops and plugins never
ask which one runs):

* ``prepare_module`` (a stage starts: put the module where it runs; FSDP shards it),
  ``prepare_optimizers`` (after ``configure_optimizers``), ``prepare_train_data`` (over
  ``data_parallel_size`` replicas, this rank reading replica ``data_parallel_rank``);
* ``step_gate`` (None, or what decides whether a step commits: fault tolerance),
  ``wrap`` (what the training step's forward calls), ``no_sync`` (the context of an
  accumulation window's non-final micro-batches), ``clip_gradients``;
* ``stop_transport`` (the collectives the stop control exchanges requests with; None in
  one process) and the small collectives a checkpoint needs (``all_gather_object``,
  ``broadcast_object``, ``barrier``), and ``all_reduce_host`` (a few host numbers
  reduced over the ranks, for plugins that report world totals).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, Literal

import torch

from .._validate import check_choice

if TYPE_CHECKING:
    from loopbus.distributed._stopping import StopTransport
    from loopbus.state._runstate import RunState
    from loopbus.step._module import Module
    from loopbus.step._precision import Precision
    from loopbus.step._step import StepGate

__all__ = [
    "SingleProcess",
    "Strategy",
    "StrategyName",
    "launched_distributed",
]

StrategyName = Literal["auto", "ddp", "fsdp", "ft", "single"]


def launched_distributed() -> bool:
    """Whether a launcher such as torchrun started this process as one of several."""
    env = os.environ
    try:
        world = int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    return world > 1 and ("RANK" in env or "LOCAL_RANK" in env)


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

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for old in ("exchange_stop", "settle_stop"):
            if old in cls.__dict__:
                raise TypeError(
                    f"{cls.__name__}.{old}: a strategy no longer exchanges stop requests "
                    "itself; give the run's stop control the collectives to do it with "
                    "by returning a loopbus.distributed.StopTransport from "
                    "stop_transport() (see DataParallel.stop_transport)."
                )

    @property
    def is_global_zero(self) -> bool:
        return self.global_rank == 0

    @property
    def distributed(self) -> bool:
        return False

    @property
    def data_parallel_size(self) -> int:
        """How many data-parallel replicas the ranks form: the groups of ranks that read
        different samples. The training loader is sharded over them, and a count of
        samples summed over the ranks is summed over them. ``world_size`` here, under
        DDP and under FSDP; fewer under :class:`~loopbus.ModelParallelStrategy`, whose
        tensor-parallel peers read the same batch."""
        return self.world_size

    @property
    def data_parallel_rank(self) -> int:
        """This rank's data-parallel replica, ``0 <= data_parallel_rank <
        data_parallel_size``: which shard of the training data it reads."""
        return self.global_rank

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

    def writes_checkpoints(self) -> bool:
        """Whether this process's job writes the checkpoint due now (its rank 0 writes,
        the others take part in a sharded save): True here; of fault-tolerant replica
        groups, only the one with replica rank 0 in the step's quorum does."""
        return True

    def resume_path(self) -> str | None:
        """The checkpoint ``fit`` resumes from when it is given no ``ckpt_path``: None
        (start afresh) here; ``"last"`` for a fault-tolerant replica group that rejoins
        a run, which must not start from step 0."""
        return None

    def step_gate(
        self,
        module: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        schedulers: Any,
        state: RunState,
    ) -> StepGate | None:
        """What decides whether a training step commits, asked once when the training
        step is built (see :class:`~loopbus.step._step.StepGate`): None here and under
        DDP, FSDP and model parallelism, where every step commits and the step pays
        nothing for the question; the fault-tolerant strategy's gate, which also heals
        ``module``, ``optimizers``, ``schedulers`` and ``state`` from a live peer."""
        return None

    def stop_transport(self) -> StopTransport | None:
        """How the ranks exchange stop requests during ``fit`` (see
        :class:`~loopbus.distributed._stopping.StopControl`): None in one process, where
        a request takes effect at the next boundary with no exchange."""
        return None

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return obj

    def barrier(self) -> None:
        """Wait for every rank."""

    def all_reduce_host(
        self, values: Sequence[float], op: Literal["sum", "max", "min"] = "sum"
    ) -> list[float]:
        """``values`` (host numbers) reduced element by element over the ranks with
        ``op``, on the host, so no device is synchronised: every rank calls it at the same
        point and gets the same list. In one process, the numbers themselves."""
        check_choice("op", op, _HOST_OPS, owner=f"{type(self).__name__}.all_reduce_host")
        return [float(v) for v in values]


#: The reductions of :meth:`Strategy.all_reduce_host`.
_HOST_OPS = ("sum", "max", "min")


class SingleProcess(Strategy):
    """``strategy="single"``: the run stays in this process."""
