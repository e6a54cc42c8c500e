"""How a trainer spreads a run over processes: one process, or DDP under ``torchrun``.

``Trainer(strategy="auto")`` picks :class:`DDPStrategy` when the launcher says the world
has more than one process (``WORLD_SIZE > 1`` with ``RANK``/``LOCAL_RANK`` set, as
``torchrun`` does), else :class:`SingleProcess`, which changes nothing. The trainer owns
its strategy (``trainer.strategy``); the strategy owns the DDP wrapper.

What DDP adds, and what it costs:

* the training step's forward goes through a ``DistributedDataParallel`` wrapper of a
  :class:`TrainingStepAdapter` (its ``forward`` is the module's ``training_step``), so
  gradients are averaged over ranks during ``backward``; the module's own ``forward``
  is untouched (validation and predict call it directly, without DDP);
* the training loader is rebuilt around a ``DistributedSampler``;
* gradient accumulation runs the non-final micro-batches under ``no_sync()``;
* stop requests are made collective without a collective of their own per step: the
  adapter has a one-element parameter, ``stop_flag``, whose gradient is "this rank
  asked to stop" (1.0 or 0.0); DDP averages it with the other gradients, and at the
  batch boundary every rank reads the same average and stops if it is not zero. A stop
  asked before the step's backward stops every rank after that step; one asked after it
  (a handler of the step's events) after the next. After a validation and at every
  epoch boundary a blocking all-reduce of one integer (over gloo on the host) covers the
  requests made since the last backward;
* manual optimization is refused (its backward would run inside DDP's forward);
* checkpoints hold every rank's random generators (an ``all_gather_object`` per save),
  are written by rank 0 only, and are read by every rank.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import os
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from .._exceptions import MisconfigurationError

if TYPE_CHECKING:
    from ._module import Module
    from ._runstate import RunState

__all__ = [
    "DDPStrategy",
    "SingleProcess",
    "Strategy",
    "TrainingStepAdapter",
    "launched_distributed",
]

StrategyName = Literal["auto", "ddp", "single"]


def launched_distributed() -> bool:
    """Whether a launcher such as torchrun started this process as one of several."""
    env = os.environ
    try:
        world = int(env.get("WORLD_SIZE", "1"))
    except ValueError:
        return False
    return world > 1 and ("RANK" in env or "LOCAL_RANK" in env)


class TrainingStepAdapter(torch.nn.Module):
    """A module whose ``forward(batch, ctx)`` is ``module.training_step(batch, ctx)``:
    wrapped in DDP, it routes the training step through DDP's forward (which is what
    makes DDP synchronise gradients) without touching the module's own ``forward``.

    With ``asked``, the one-element parameter :attr:`stop_flag` carries this rank's
    stop request in DDP's gradient all-reduce: the loss the step returns becomes
    ``loss + c * stop_flag``, with ``c`` 1 when this rank asked to stop and 0 when not,
    so the gradient of ``stop_flag`` is ``c``; ``stop_flag`` stays 0 (no optimizer
    holds it), so the loss keeps its value. It is one ``add`` with ``c`` as its scalar
    ``alpha``: one kernel and one backward node a step, and no host-to-device copy."""

    def __init__(self, module: Module, asked: Callable[[], bool] | None = None) -> None:
        super().__init__()
        self.module = module
        self._asked = asked
        # Only when it is used in every step (DDP requires every parameter to be).
        self.stop_flag: torch.nn.Parameter | None = (
            None
            if asked is None
            else torch.nn.Parameter(torch.zeros((), device=_device_of(module)))
        )

    def forward(self, batch: Any, ctx: Any) -> Any:
        output = self.module.training_step(batch, ctx)
        asked, flag = self._asked, self.stop_flag
        if asked is None or flag is None or output is None:
            return output
        c = 1.0 if asked() else 0.0
        if isinstance(output, torch.Tensor):
            return _carry(output, flag, c)
        if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
            return {**output, "loss": _carry(output["loss"], flag, c)}
        return output  # the loop reports what is wrong with it


def _carry(loss: torch.Tensor, flag: torch.Tensor, c: float) -> torch.Tensor:
    """``loss + c * flag`` in the loss's dtype (the flag is float32)."""
    if loss.dtype is not flag.dtype:
        flag = flag.to(loss.dtype)
    return loss.add(flag, alpha=c)


def _device_of(module: torch.nn.Module) -> torch.device:
    for tensor in module.parameters():
        return tensor.device
    return torch.device("cpu")


class Strategy:
    """One process (the default): no wrapper, no collectives."""

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

    def wrap(self, module: Module, state: RunState) -> Any:
        """What the training step's forward calls: ``module.training_step`` here."""
        return module.training_step

    def unwrap(self) -> None:
        """Forget the wrapper (the stage ended)."""

    def no_sync(self) -> Any:
        """A context in which backward does not synchronise gradients."""
        return nullcontext()

    def prepare_train_data(self, data: Any) -> Any:
        return data

    def exchange_stop(self, state: RunState) -> None:
        """At a batch boundary: make stop requests collective (under DDP, through the
        gradient all-reduce, without a collective of its own)."""

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


class DDPStrategy(Strategy):
    """``strategy="ddp"``: one process per device, gradients averaged by DDP over a
    ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA)."""

    name = "ddp"

    def __init__(self, process_group_timeout: float = 1800.0) -> None:
        self.process_group_timeout = float(process_group_timeout)
        self._wrapper: torch.nn.parallel.DistributedDataParallel | None = None
        self._wrapped: Module | None = None
        self._device: torch.device | None = None
        self._adapter: TrainingStepAdapter | None = None
        self._grads_local = False  # the last step ran under no_sync
        # On CUDA, the averaged flag copied to the host, read one boundary later.
        self._flag_read: tuple[torch.Tensor, Any] | None = None
        # The blocking stop exchange of the rare boundaries: a host group (gloo), one
        # flag.
        self._stop_group: Any = None
        self._stop_flag = torch.zeros(1, dtype=torch.int32)

    @property
    def distributed(self) -> bool:
        return True

    @property
    def world_size(self) -> int:  # type: ignore[override]
        return dist.get_world_size() if dist.is_initialized() else _env_int("WORLD_SIZE", 1)

    @property
    def global_rank(self) -> int:  # type: ignore[override]
        return dist.get_rank() if dist.is_initialized() else _env_int("RANK", 0)

    @property
    def local_rank(self) -> int:  # type: ignore[override]
        return _env_int("LOCAL_RANK", 0)

    def setup_environment(self, device: torch.device) -> None:
        """Join the process group (unless the user already did) and pin the device."""
        self._device = device
        if not dist.is_available():
            raise MisconfigurationError(
                "strategy='ddp' needs torch.distributed, which this build of torch lacks."
            )
        if dist.is_initialized():
            return
        if "MASTER_ADDR" not in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ:
            raise MisconfigurationError(
                "strategy='ddp' needs the environment torchrun sets (MASTER_ADDR, "
                "MASTER_PORT, RANK, WORLD_SIZE): launch with `torchrun --nproc_per_node=N "
                "script.py`, or call torch.distributed.init_process_group yourself first."
            )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=datetime.timedelta(seconds=self.process_group_timeout),
        )
        # Created here, so left here: a group still alive when the interpreter tears
        # down its modules can abort the process on exit (gloo).
        atexit.register(_leave_process_group)

    def wrap(self, module: Module, state: RunState) -> Any:
        if not module.automatic_optimization:
            raise MisconfigurationError(
                f"{type(module).__name__} uses manual optimization, which strategy='ddp' "
                "does not support yet: its backward would run inside DDP's forward, "
                "before DDP is ready to average the gradients. Use automatic "
                "optimization (return the loss from training_step), or run it in one "
                "process."
            )
        if self._wrapped is not module or self._wrapper is None:
            device = self._device
            ids = [device] if device is not None and device.type == "cuda" else None
            self._adapter = TrainingStepAdapter(module, lambda: state.pending_stop is not None)
            self._wrapper = torch.nn.parallel.DistributedDataParallel(
                self._adapter, device_ids=ids, find_unused_parameters=False
            )
            self._wrapped = module
        self._grads_local = False
        self._flag_read = None
        return self._wrapper

    @property
    def wrapper(self) -> torch.nn.parallel.DistributedDataParallel | None:
        """The DDP wrapper of the current module's training step, once built."""
        return self._wrapper

    def unwrap(self) -> None:
        # Kept for the next fit of the same module (building it broadcasts the weights).
        pass

    def no_sync(self) -> Any:
        wrapper = self._wrapper
        if wrapper is None:
            return nullcontext()
        # This step's gradients (the stop flag's too) stay local: nothing to read.
        self._grads_local = True
        return wrapper.no_sync()

    def prepare_train_data(self, data: Any) -> Any:
        if not isinstance(data, DataLoader):
            warnings.warn(
                f"under DDP the training data ({type(data).__name__}) is not a DataLoader, "
                "so loopbus cannot give it a DistributedSampler: every rank trains on "
                "whatever it yields. Shard it per rank yourself (trainer.global_rank, "
                "trainer.world_size), or pass a torch DataLoader.",
                UserWarning,
                stacklevel=4,
            )
            return data
        if _distributed_sampler(data) is not None:
            return data  # the user shards already
        if data.batch_size is None:
            # Built with batch_sampler=...: how it batches is the user's, not ours to redo.
            raise MisconfigurationError(
                f"under DDP the training loader has its own batch_sampler "
                f"({type(data.batch_sampler).__name__}), which loopbus cannot shard: build "
                "it over a DistributedSampler yourself (loopbus then calls its set_epoch), "
                "or give the loader batch_size and sampler/shuffle instead."
            )
        sampler: DistributedSampler[Any] = DistributedSampler(
            data.dataset,
            num_replicas=self.world_size,
            rank=self.global_rank,
            shuffle=_shuffles(data.sampler),
            drop_last=data.drop_last,
        )
        # The same kind of loader: torchdata's StatefulDataLoader stays stateful (its
        # position is then checkpointed and restored in O(1)); any other subclass
        # becomes a plain DataLoader with the same options.
        cls = type(data) if _is_torchdata_loader(data) else DataLoader
        extra = {
            name: getattr(data, name)
            for name in ("in_order", "snapshot_every_n_steps")
            if cls is not DataLoader and hasattr(data, name)
        }
        return cls(
            data.dataset,
            batch_size=data.batch_size,
            sampler=sampler,
            num_workers=data.num_workers,
            collate_fn=data.collate_fn,
            pin_memory=data.pin_memory,
            drop_last=data.drop_last,
            timeout=data.timeout,
            worker_init_fn=data.worker_init_fn,
            multiprocessing_context=data.multiprocessing_context,
            generator=data.generator,
            prefetch_factor=data.prefetch_factor,
            persistent_workers=data.persistent_workers,
            pin_memory_device=data.pin_memory_device,
            **extra,
        )

    def _stop_process_group(self) -> Any:
        """The group the stop flag travels on: the default one when it is gloo, else a
        gloo group of the same ranks (host to host: no device sync, no NCCL stream)."""
        group = self._stop_group
        if group is None:
            if dist.get_backend() == "gloo":
                group = dist.group.WORLD
            else:
                group = dist.new_group(backend="gloo")
            self._stop_group = group
        return group

    def _read_carried_flag(self) -> bool | None:
        """Whether the stop flag carried by the last gradient all-reduce says a rank
        asked (None: no all-reduce has carried it since the last read). On CUDA the
        value is copied to the host without waiting and read at the next boundary."""
        adapter = self._adapter
        flag = None if adapter is None else adapter.stop_flag
        if flag is None:
            return None
        grad = flag.grad
        if grad is not None:
            flag.grad = None  # the strategy's own adapter: read once
        if grad is not None and grad.device.type == "cuda":
            host = torch.empty((), dtype=grad.dtype, pin_memory=True)
            host.copy_(grad, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            earlier, self._flag_read = self._flag_read, (host, event)
            if earlier is None:
                return None
            earlier[1].synchronize()  # the step before this one: done by now
            return bool(earlier[0].item() > 0)
        if grad is None:
            return None
        return bool(grad.item() > 0)

    def _agree_on_stop(self, state: RunState) -> None:
        """A rank asked to stop: every rank learns who and why, and stops."""
        reasons: list[Any] = [None] * self.world_size
        dist.all_gather_object(reasons, state.pending_stop, group=self._stop_process_group())
        for rank, reason in enumerate(reasons):
            if reason is not None:
                text = reason if rank == self.global_rank else f"{reason} (on rank {rank})"
                state.confirm_stop(text)
                return
        # Asked, then withdrawn by a new stage: nobody has a reason left.
        state.confirm_stop("stop requested (on another rank)")

    def exchange_stop(self, state: RunState) -> None:
        # Every rank reads the same averaged flag at the same boundary, so every rank
        # reaches the same decision (and makes the same collectives after it).
        if self._grads_local:
            self._grads_local = False
            return
        if not state.stop_requested and self._read_carried_flag():
            self._agree_on_stop(state)

    def settle_stop(self, state: RunState) -> None:
        if state.stop_requested:
            return
        if self._read_carried_flag():
            self._agree_on_stop(state)
            return
        # Rare boundaries (after a validation, between epochs): a blocking all-reduce
        # of the flag, for the requests made since the last gradient all-reduce.
        flag = self._stop_flag
        flag[0] = 0 if state.pending_stop is None else 1
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._stop_process_group())
        if int(flag[0]):
            self._agree_on_stop(state)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()


def _leave_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        gc.collect()  # drop DDP reducers that still refer to the group
        dist.destroy_process_group()


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value is not None and value.isdigit() else default


def _is_torchdata_loader(data: DataLoader[Any]) -> bool:
    return type(data).__module__.startswith("torchdata.")


def _shuffles(sampler: Any) -> bool:
    """Whether a loader's sampler shuffles: torch's RandomSampler, or torchdata's (a
    class of its own, not a subclass)."""
    cls = type(sampler)
    return isinstance(sampler, RandomSampler) or (
        cls.__name__ == "RandomSampler" and cls.__module__.startswith("torchdata.")
    )


def _distributed_sampler(data: DataLoader[Any]) -> DistributedSampler[Any] | None:
    for sampler in (data.sampler, getattr(data.batch_sampler, "sampler", None)):
        if isinstance(sampler, DistributedSampler):
            return sampler
    return None


def resolve_strategy(name: str, process_group_timeout: float) -> Strategy:
    if name == "auto":
        name = "ddp" if launched_distributed() else "single"
    if name == "ddp":
        return DDPStrategy(process_group_timeout)
    return SingleProcess()
