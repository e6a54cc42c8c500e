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
* stop requests are made collective: one all-reduce of one integer per training step
  (and one per epoch), so that a stop requested on any rank ends every rank at the same
  step boundary;
* checkpoints hold every rank's random generators (an ``all_gather_object`` per save),
  are written by rank 0 only, and are read by every rank.
"""

from __future__ import annotations

import datetime
import os
import warnings
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler

from .._exceptions import MisconfigurationError

if TYPE_CHECKING:
    from ._module import Module
    from ._runstate import RunState

__all__ = ["DDPStrategy", "SingleProcess", "Strategy", "TrainingStepAdapter", "launched_distributed"]

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
    makes DDP synchronise gradients) without touching the module's own ``forward``."""

    def __init__(self, module: Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any, ctx: Any) -> Any:
        return self.module.training_step(batch, ctx)


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

    def wrap(self, module: Module) -> Any:
        """What the training step's forward calls: ``module.training_step`` here."""
        return module.training_step

    def unwrap(self) -> None:
        """Forget the wrapper (the stage ended)."""

    def no_sync(self) -> Any:
        """A context in which backward does not synchronise gradients."""
        return nullcontext()

    def prepare_train_data(self, data: Any) -> Any:
        return data

    def sync_stop(self, state: RunState) -> None:
        """Make a pending stop request effective (collectively under DDP)."""

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

    def wrap(self, module: Module) -> Any:
        if self._wrapped is not module or self._wrapper is None:
            device = self._device
            ids = [device] if device is not None and device.type == "cuda" else None
            self._wrapper = torch.nn.parallel.DistributedDataParallel(
                TrainingStepAdapter(module), device_ids=ids, find_unused_parameters=False
            )
            self._wrapped = module
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
        return nullcontext() if wrapper is None else wrapper.no_sync()

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
        if data.batch_sampler is not None and type(data.batch_sampler) is not BatchSampler:
            raise MisconfigurationError(
                f"under DDP the training loader has a custom batch_sampler "
                f"({type(data.batch_sampler).__name__}) loopbus cannot shard; give it a "
                "DistributedSampler yourself."
            )
        sampler: DistributedSampler[Any] = DistributedSampler(
            data.dataset,
            num_replicas=self.world_size,
            rank=self.global_rank,
            shuffle=isinstance(data.sampler, RandomSampler),
            drop_last=data.drop_last,
        )
        return DataLoader(
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
        )

    def sync_stop(self, state: RunState) -> None:
        pending = state.pending_stop
        flag = torch.tensor([1 if pending is not None else 0], dtype=torch.int32)
        if self._device is not None and self._device.type == "cuda":
            flag = flag.to(self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag.item()):
            return
        # Rare: once per run. Every rank learns who asked and why.
        reasons = self.all_gather_object(pending)
        for rank, reason in enumerate(reasons):
            if reason is not None:
                text = reason if rank == self.global_rank else f"{reason} (on rank {rank})"
                state.confirm_stop(text)
                return

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


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value is not None and value.isdigit() else default


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
