"""DDP: every rank holds the whole module; ``DistributedDataParallel`` averages the
gradients during ``backward``. :class:`DataParallel` is what DDP and FSDP share.

What DDP adds, and what it costs:

* the training step's forward goes through a ``DistributedDataParallel`` wrapper of a
  :class:`TrainingStepAdapter` (its ``forward`` is the module's ``training_step``), so
  gradients are averaged over ranks during ``backward``; the module's own ``forward``
  is untouched (validation and predict call it directly, without DDP);
* the training loader is rebuilt around an ``ElasticDistributedSampler`` (DistributedSampler's
  order, its position kept as samples consumed);
* gradient accumulation runs the non-final micro-batches under ``no_sync()``;
* stop requests are made collective without a collective per step: every
  ``stop_check_interval_s`` seconds (about; the ranks agree on the number of steps) the
  ranks start an asynchronous all-reduce of two integers on the host (gloo) carrying
  "a rank asked to stop", and read it at the next such check, so every rank stops at
  the same batch boundary, within about two intervals of the request, and no step
  waits for it. After a validation and at every epoch boundary a blocking all-reduce
  covers the requests made since the last check (the run's stop control, see
  ``_stopping.py``, does this over the transport :meth:`DataParallel.stop_transport` gives);
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
from collections.abc import Sequence
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from loopbus.data._sampler import ElasticDistributedSampler
from loopbus.step._params import own_class

from .._exceptions import MisconfigurationError
from .._renamed import renamed_keywords
from ._stopping import StopTransport
from ._strategy import Strategy

if TYPE_CHECKING:
    from loopbus.state._runstate import RunState
    from loopbus.step._module import Module

__all__ = ["DDPStrategy", "DataParallel", "TrainingStepAdapter", "shuffles"]

#: The defaults of ``process_group_timeout_s`` and ``stop_check_interval_s`` (the very
#: objects: an option left out is its default, which tells it from one passed).
DEFAULT_TIMEOUT_S = 1800.0
DEFAULT_STOP_CHECK_S = 0.05


def _renamed_timings(
    owner: str, renamed: dict[str, Any], timeout_s: float, interval_s: float
) -> tuple[float, float]:
    """The two options with the values passed under their deprecated old names
    (``process_group_timeout``, ``stop_check_interval``): each warns once; one passed
    with its new name raises."""
    given = [
        name
        for name, value, default in (
            ("process_group_timeout_s", timeout_s, DEFAULT_TIMEOUT_S),
            ("stop_check_interval_s", interval_s, DEFAULT_STOP_CHECK_S),
        )
        if value is not default
    ]
    takes = ("process_group_timeout_s", "stop_check_interval_s")
    values = renamed_keywords(owner, renamed, takes=takes, given=given)
    return (
        values.get("process_group_timeout_s", timeout_s),
        values.get("stop_check_interval_s", interval_s),
    )


class TrainingStepAdapter(torch.nn.Module):
    """A module whose ``forward(batch, ctx)`` is ``module.training_step(batch, ctx)``:
    wrapped in DDP, it routes the training step through DDP's forward (which is what
    makes DDP synchronise gradients) without touching the module's own ``forward``.
    It adds no parameter of its own: DDP averages exactly the module's gradients."""

    _target: Module

    def __init__(self, module: Module) -> None:
        super().__init__()
        self.module = module  # registered: its parameters are the adapter's
        # The same module as a plain attribute, read without nn.Module's __getattr__.
        self.__dict__["_target"] = module

    def forward(self, batch: Any, ctx: Any) -> Any:
        return self._target.training_step(batch, ctx)


class DataParallel(Strategy):
    """What every data-parallel strategy shares (DDP, FSDP): one process per device in a
    ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA), the training loader
    sharded by a ``DistributedSampler``, the collective stop and the small collectives of
    a checkpoint. A subclass says what it does with the module."""

    name = "data-parallel"
    saves_window_gradients = False

    def __init__(
        self,
        process_group_timeout_s: float = DEFAULT_TIMEOUT_S,
        stop_check_interval_s: float = DEFAULT_STOP_CHECK_S,
        **renamed: Any,
    ) -> None:
        if renamed:  # the deprecated old names of the two options
            process_group_timeout_s, stop_check_interval_s = _renamed_timings(
                type(self).__name__, renamed, process_group_timeout_s, stop_check_interval_s
            )
        self.process_group_timeout = float(process_group_timeout_s)
        self._device: torch.device | None = None
        # Stop requests travel on the host (gloo): the default group when it is gloo,
        # else a gloo group of the same ranks, made at the first exchange.
        self._stop_group: Any = None
        self._stop_interval = float(stop_check_interval_s)

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
                f"strategy={self.name!r} needs torch.distributed, which this build of torch lacks."
            )
        if dist.is_initialized():
            return
        if "MASTER_ADDR" not in os.environ and "TORCHELASTIC_RUN_ID" not in os.environ:
            raise MisconfigurationError(
                f"strategy={self.name!r} needs the environment torchrun sets (MASTER_ADDR, "
                "MASTER_PORT, RANK, WORLD_SIZE): launch with `torchrun --nproc_per_node=N "
                "script.py`, or call torch.distributed.init_process_group yourself first."
            )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=self.process_group_timeout)
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=timeout,
            **_attempt_store(timeout),
        )
        # Created here, so left here: a group still alive when the interpreter tears
        # down its modules can abort the process on exit (gloo).
        atexit.register(_leave_process_group)

    def prepare_train_data(self, data: Any) -> Any:
        if not isinstance(data, DataLoader):
            warnings.warn(
                f"under DDP the training data ({type(data).__name__}) is not a DataLoader, "
                "so loopbus cannot give it a DistributedSampler: every rank trains on "
                "whatever it yields. Shard it per data-parallel replica yourself "
                "(trainer.strategy.data_parallel_rank of data_parallel_size), or pass a "
                "torch DataLoader.",
                UserWarning,
                stacklevel=4,
            )
            return data
        own = _distributed_sampler(data)
        if own is not None:  # the user shards already
            self._check_own_sampler(own)
            return data
        if data.batch_size is None:
            # Built with batch_sampler=...: how it batches is the user's, not ours to redo.
            raise MisconfigurationError(
                f"under DDP the training loader has its own batch_sampler "
                f"({type(data.batch_sampler).__name__}), which loopbus cannot shard: build "
                "it over a DistributedSampler yourself (loopbus then calls its set_epoch), "
                "or give the loader batch_size and sampler/shuffle instead."
            )
        # DistributedSampler's order, resumable at another world size (see _sampler.py).
        sampler = ElasticDistributedSampler(
            data.dataset,
            num_replicas=self.data_parallel_size,
            rank=self.data_parallel_rank,
            shuffle=shuffles(data.sampler),
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

    def _check_own_sampler(self, sampler: DistributedSampler[Any]) -> None:
        """Refuse a user's ``DistributedSampler`` that splits the data otherwise than the
        data-parallel replicas do: its ranks would read samples their replica does not
        (under tensor parallelism, peers that must read one batch would read two)."""
        size, rank = self.data_parallel_size, self.data_parallel_rank
        if (sampler.num_replicas, sampler.rank) != (size, rank):
            raise MisconfigurationError(
                f"the training loader's DistributedSampler splits the data over "
                f"num_replicas={sampler.num_replicas} with rank={sampler.rank}, but under "
                f"strategy={self.name!r} this rank reads data-parallel replica {rank} of "
                f"{size}. Build it with num_replicas=trainer.strategy.data_parallel_size "
                "and rank=trainer.strategy.data_parallel_rank, or give the loader no "
                "sampler and let loopbus shard it."
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

    def stop_transport(self) -> StopTransport:
        """The ranks' stop exchange travels on the host (gloo): an asynchronous and a
        blocking all-reduce (MAX) of small integer tensors, and a gather of the reasons."""
        return StopTransport(
            interval=self._stop_interval,
            rank=self.global_rank,
            start_max=self._start_stop_max,
            max_now=self._stop_max,
            gather=self._gather_stop_reasons,
        )

    def _start_stop_max(self, flag: torch.Tensor) -> Any:
        return dist.all_reduce(
            flag, op=dist.ReduceOp.MAX, group=self._stop_process_group(), async_op=True
        )

    def _stop_max(self, flag: torch.Tensor) -> None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._stop_process_group())

    def _gather_stop_reasons(self, reason: str | None) -> list[str | None]:
        reasons: list[str | None] = [None] * self.world_size
        dist.all_gather_object(reasons, reason, group=self._stop_process_group())
        return reasons

    def wrap(self, module: Module, state: RunState) -> Any:
        """What DDP and FSDP share at the start of ``fit``: manual optimization is
        refused (its backward would run inside the wrapper's forward, before the
        gradients can be reduced); then the strategy's own :meth:`_wrap`."""
        if not module.automatic_optimization:
            raise MisconfigurationError(
                f"{own_class(module).__name__} uses manual optimization, which "
                f"strategy={self.name!r} does not support yet: {self._manual_why}"
            )
        return self._wrap(module)

    #: Why manual optimization cannot run under this strategy, and what to do (its error).
    _manual_why = ""

    def _wrap(self, module: Module) -> Any:
        raise NotImplementedError

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

    def all_reduce_host(
        self, values: Sequence[float], op: Literal["sum", "max", "min"] = "sum"
    ) -> list[float]:
        """``values`` reduced over the ranks on the gloo group the stop exchange uses
        (host to host: no device sync, no NCCL stream); blocking."""
        super().all_reduce_host(values, op)
        flat = torch.tensor([float(v) for v in values], dtype=torch.float64)
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
        dist.all_reduce(flat, op=reduce_op[op], group=self._stop_process_group())
        return [float(v) for v in flat.tolist()]


class DDPStrategy(DataParallel):
    """``strategy="ddp"``: one process per device, gradients averaged by DDP over a
    ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA).

    ``process_group_timeout_s`` and ``stop_check_interval_s`` are as the trainer's
    options of the same names (a strategy object carries its own); their old names
    (``process_group_timeout``, ``stop_check_interval``) are deprecated aliases."""

    name = "ddp"

    def __init__(
        self,
        process_group_timeout_s: float = DEFAULT_TIMEOUT_S,
        stop_check_interval_s: float = DEFAULT_STOP_CHECK_S,
        **renamed: Any,
    ) -> None:
        super().__init__(process_group_timeout_s, stop_check_interval_s, **renamed)
        self._wrapper: torch.nn.parallel.DistributedDataParallel | None = None
        self._wrapped: Module | None = None

    _manual_why = (
        "its backward would run inside DDP's forward, before DDP is ready to average "
        "the gradients. Use automatic optimization (return the loss from training_step), "
        "or run it in one process."
    )

    def _wrap(self, module: Module) -> Any:
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
        if wrapper is None:
            return nullcontext()
        return wrapper.no_sync()


def _leave_process_group() -> None:
    """At exit, while the interpreter is whole: free the process group, so that its
    gloo worker threads are joined now. A gloo thread still alive when the interpreter
    finalizes can abort the process (exit -6, "terminate called without an active
    exception"): when it lets go of a finished collective whose tensors Python also
    saw, it needs the GIL, which a finalizing Python no longer hands out. (FSDP's
    meshes also hold the group: see ``_fsdp._free_device_meshes_at_exit``.)"""
    if dist.is_available() and dist.is_initialized():
        gc.collect()  # drop DDP reducers that still refer to the group
        dist.destroy_process_group()


def _attempt_store(timeout: datetime.timedelta) -> dict[str, Any]:
    """The store this attempt's process group meets in, when torchrun's agent serves it:
    torchrun restarts its workers with the same agent store, which still holds the keys
    the lost attempt wrote (its ranks' addresses), so a rank that starts first would
    connect to a dead peer. Each attempt (``$TORCHELASTIC_RESTART_COUNT``) gets keys of
    its own. Empty (the launcher's ``env://`` store as it is) otherwise."""
    env = os.environ
    attempt = env.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or env.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return {}
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    store = dist.TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), world, is_master=False, timeout=timeout
    )
    return {
        "store": dist.PrefixStore(f"loopbus/attempt_{attempt}", store),
        "rank": rank,
        "world_size": world,
    }


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value is not None and value.isdigit() else default


def _is_torchdata_loader(data: DataLoader[Any]) -> bool:
    return type(data).__module__.startswith("torchdata.")


def shuffles(sampler: Any) -> bool:
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
