"""Throughput monitor: samples, batches and items per second, the FLOPs of a training
step, the FLOP/s achieved and the model FLOPs utilisation (MFU), and on CUDA the host
and device time of a step; put as records every few steps, summed over the ranks."""

from __future__ import annotations

import math
import re
import threading
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from loopbus import CustomEvent, MisconfigurationError, Plugin, check_int, check_number, on
from loopbus.events import (
    AfterBackward,
    TrainBatchCompleted,
    TrainBatchStarted,
    ValidationCompleted,
    ValidationStarted,
)

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from loopbus import Subscription, TrainerView

__all__ = ["PEAK_FLOPS", "ThroughputMeasured", "ThroughputMonitor", "peak_flops"]

#: Peak dense FLOP/s (no structured sparsity) per GPU and compute dtype, from the
#: vendors' datasheets: ``"fp32"`` (CUDA cores), ``"tf32"``, ``"bf16"`` and ``"fp16"``
#: (tensor cores, FP32 accumulate). Datasheets quote tensor figures "with sparsity":
#: those are halved here. No ``"bf16"``/``"tf32"`` on GPUs without them (V100, T4).
PEAK_FLOPS: Mapping[str, Mapping[str, float]] = {
    "H200 SXM": {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12},
    "H200 NVL": {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12},
    "H100 SXM": {"fp32": 67e12, "tf32": 494.5e12, "bf16": 989.5e12, "fp16": 989.5e12},
    "H100 NVL": {"fp32": 60e12, "tf32": 417.5e12, "bf16": 835.5e12, "fp16": 835.5e12},
    "H100 PCIe": {"fp32": 51e12, "tf32": 378e12, "bf16": 756.5e12, "fp16": 756.5e12},
    "A100": {"fp32": 19.5e12, "tf32": 156e12, "bf16": 312e12, "fp16": 312e12},
    "A10G": {"fp32": 31.2e12, "tf32": 62.5e12, "bf16": 125e12, "fp16": 125e12},
    "L40S": {"fp32": 91.6e12, "tf32": 183e12, "bf16": 362.05e12, "fp16": 362.05e12},
    "L4": {"fp32": 30.3e12, "tf32": 60e12, "bf16": 121e12, "fp16": 121e12},
    "RTX 4090": {"fp32": 82.6e12, "tf32": 82.6e12, "bf16": 165.2e12, "fp16": 165.2e12},
    "V100 SXM": {"fp32": 15.7e12, "fp16": 125e12},
    "V100 PCIe": {"fp32": 14e12, "fp16": 112e12},
    "T4": {"fp32": 8.1e12, "fp16": 65e12},
}

#: ``torch.cuda.get_device_name()`` (lower-cased) -> a row of PEAK_FLOPS; first match wins.
_CHIPS: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(pattern), chip)
    for pattern, chip in (
        (r"\bh200\b.*\bnvl\b", "H200 NVL"),
        (r"\bh200\b", "H200 SXM"),
        (r"\bh100\b.*\bnvl\b", "H100 NVL"),
        (r"\bh100\b.*\b(pcie|hbm2e)\b", "H100 PCIe"),
        (r"\bh100\b", "H100 SXM"),  # "NVIDIA H100 80GB HBM3"
        (r"\ba100\b", "A100"),
        (r"\ba10g\b", "A10G"),
        (r"\bl40s\b", "L40S"),
        (r"\bl4\b", "L4"),
        (r"\brtx 4090\b(?! d\b)", "RTX 4090"),
        (r"\bv100\b.*\bpcie\b", "V100 PCIe"),
        (r"\bv100\b", "V100 SXM"),
        (r"\bt4\b", "T4"),
    )
)

_DTYPES: Mapping[Any, str] = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    "fp32": "fp32",
    "tf32": "tf32",
    "bf16": "bf16",
    "fp16": "fp16",
}


def peak_flops(device_name: str, dtype: torch.dtype | str) -> float | None:
    """The peak dense FLOP/s of the GPU called ``device_name`` (as
    ``torch.cuda.get_device_name()`` says) computing in ``dtype`` (``torch.float32``,
    ``"tf32"``, ``torch.bfloat16``, ``torch.float16``), from :data:`PEAK_FLOPS`; None
    when the table has no such GPU or dtype. TF32 on a GPU without it is FP32."""
    key = _DTYPES.get(dtype)
    name = device_name.lower()
    chip = next((chip for pattern, chip in _CHIPS if pattern.search(name)), None)
    if key is None or chip is None:
        return None
    row = PEAK_FLOPS[chip]
    if key == "tf32" and key not in row:
        key = "fp32"
    return row.get(key)


def first_dim(batch: Any) -> int:
    """The default ``samples(batch)``: the first dimension of the first tensor found in
    the batch (depth first through tuples, lists and dict values)."""
    tensor = _first_tensor(batch, 0)
    if tensor is None:
        raise MisconfigurationError(
            f"ThroughputMonitor found no tensor in the batch ({type(batch).__name__}) to "
            "count its samples: pass samples=, a function of the batch that returns its "
            "number of samples, e.g. ThroughputMonitor(samples=lambda batch: len(batch['ids']))."
        )
    return int(tensor.shape[0]) if tensor.dim() else 1


def _first_tensor(obj: Any, depth: int) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    if depth > 8:
        return None
    if isinstance(obj, Mapping):
        values: Iterable[Any] = obj.values()
    elif isinstance(obj, (list, tuple)):
        values = obj
    else:
        return None
    for value in values:
        found = _first_tensor(value, depth + 1)
        if found is not None:
            return found
    return None


def _as_count(value: Any, option: str) -> int:
    """``value`` (what the ``samples`` or ``items`` function returned) as an int >= 0."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = int(value.item())  # a device tensor costs a sync here: return an int
    elif hasattr(value, "__index__") and not isinstance(value, bool):
        value = int(value)
    if type(value) is int and value >= 0:
        return value
    raise MisconfigurationError(
        f"ThroughputMonitor({option}=...) must return a count (an int >= 0) for a batch, "
        f"got {value!r}; e.g. {option}=lambda batch: batch[0].shape[0]."
    )


def _compute_dtype(trainer: TrainerView) -> str | None:
    """The dtype the step's matrix products run in: the precision's (``"bf16-mixed"``,
    ``"16-mixed"``), else the parameters' (a module in bfloat16), float32 counted as TF32
    where torch allows TF32 matmuls (``torch.set_float32_matmul_precision``)."""
    precision = trainer.precision
    name = str(getattr(precision, "name", ""))
    if name.startswith("bf16"):
        return "bf16"
    if name.startswith("16"):
        return "fp16"
    dtype = getattr(precision, "param_dtype", None)
    if dtype is None and trainer.module is not None:
        dtype = next(
            (p.dtype for p in trainer.module.parameters() if p.is_floating_point()), None
        )
    if dtype is torch.float32:
        matmul = getattr(torch.backends.cuda.matmul, "fp32_precision", None)
        if torch.get_float32_matmul_precision() != "highest" or matmul == "tf32":
            return "tf32"
    return _DTYPES.get(dtype)


def _module_device(module: Any) -> torch.device:
    device = getattr(module, "device", None)
    if isinstance(device, torch.device):
        return device
    param = next(iter(module.parameters()), None)
    return param.device if param is not None else torch.device("cpu")


class ThroughputMeasured(CustomEvent, frozen=True, kw_only=True):
    """Published by :class:`ThroughputMonitor` after it put a window's records, at the
    step they carry: ``values`` the world figures put (names without ``throughput/``),
    ``device`` this rank's own for the same window."""

    values: dict[str, float]
    device: dict[str, float]


#: The CUDA event pairs that may wait for the device before new steps go unmeasured.
_MAX_PENDING = 64


class ThroughputMonitor(Plugin):
    """Measures how fast ``fit`` trains and puts it every ``every_n_steps`` optimizer
    steps under ``throughput/...``: ``samples_per_sec``, ``batches_per_sec``,
    ``items_per_sec`` (with ``items``), ``flops_per_step``, ``flops_per_sec``, ``mfu``
    (with a known peak) and, on CUDA, ``host_ms_per_step`` and ``device_ms_per_step``::

        ThroughputMonitor(items=lambda batch: batch["input_ids"].numel())   # tokens/s

    Rates are counted over a window of steps between two puts with
    ``time.perf_counter`` (validation excluded; no device sync) and summed over the ranks
    (world totals; samples, batches and items over the data-parallel replicas, since the
    tensor-parallel peers of a replica read the same batch); MFU is the mean of the
    ranks'. The FLOPs of a step are counted once
    per ``fit``, with ``torch.utils.flop_counter.FlopCounterMode`` around the forward
    and backward of the first training batch as the step runs it (no extra pass), unless
    ``flops_per_step`` is given. The peak comes from :data:`PEAK_FLOPS` for the GPU and
    the precision in use, or from ``peak_flops``; without one (on CPU) there is no MFU.
    """

    def __init__(
        self,
        *,
        samples: Callable[[Any], int] | None = None,
        items: Callable[[Any], int] | None = None,
        every_n_steps: int = 10,
        peak_flops: float | None = None,
        flops_per_step: float | None = None,
        destinations: str | Iterable[str] = ("loggers", "external"),
    ) -> None:
        owner = "ThroughputMonitor"
        for option, fn in (("samples", samples), ("items", items)):
            if fn is not None and not callable(fn):
                raise MisconfigurationError(
                    f"ThroughputMonitor({option}={fn!r}) must be a function of a batch that "
                    f"returns a count, e.g. {option}=lambda batch: batch[0].shape[0]."
                )
        self.every_n_steps = check_int("every_n_steps", every_n_steps, minimum=1, owner=owner)
        self.peak_flops = check_number(
            "peak_flops", peak_flops, exclusive_minimum=0, allow_none=True, owner=owner,
            what="a number of FLOP/s", hint="e.g. peak_flops=312e12 for an A100 in bf16",
        )
        if self.peak_flops is not None and math.isinf(self.peak_flops):
            raise MisconfigurationError("ThroughputMonitor(peak_flops=inf) must be finite.")
        given = check_number(
            "flops_per_step", flops_per_step, minimum=0, allow_none=True, owner=owner,
            what="a number of FLOPs", hint="or leave it out to measure the first batch",
        )
        self.destinations = _destinations(destinations)
        self.samples: Callable[[Any], int] = samples or first_dim
        self.items = items
        self._given_flops = given
        #: The FLOPs of one training batch's forward and backward (measured or given).
        self.flops_per_step: float | None = given
        #: The peak FLOP/s MFU is computed against (``peak_flops``, or from the table).
        self.peak: float | None = self.peak_flops
        #: The values last put (world totals), by name without the ``throughput/`` prefix.
        self.latest: dict[str, float] = {}
        #: This rank's own values for the same window.
        self.device: dict[str, float] = {}
        self._trainer: TrainerView | None = None
        self._subs: list[Subscription] = []
        self._counter: FlopCounterMode | None = None
        self._hook: Any = None
        self._threads: set[int] = set()
        self._count_thread = 0
        self._cuda: torch.device | None = None
        self._reset()

    def __repr__(self) -> str:
        return f"ThroughputMonitor(every_n_steps={self.every_n_steps}, peak_flops={self.peak!r})"

    def _reset(self) -> None:
        self._t0: float | None = None
        self._paused = 0.0
        self._val_started: float | None = None
        self._validations = 0
        self._batches = self._samples = self._items = 0
        self._last_step = 0
        self._started_sub: Subscription | None = None
        # CUDA: per-step host time, device time from event pairs read back later.
        self._free: list[tuple[Any, Any]] = []
        self._pending: deque[tuple[Any, Any]] = deque()
        self._current: tuple[Any, Any] | None = None
        self._step_started = 0.0
        self._step_validations = 0
        self._host_ms = self._device_ms = 0.0
        self._host_n = self._device_n = 0

    # ------------------------------------------------------------ stage
    async def start(self, trainer: TrainerView, stage: str, task_group: TaskGroup) -> None:
        if stage != "fit":
            return
        self._reset()
        self._trainer = trainer
        self.flops_per_step = self._given_flops
        self.peak = self.peak_flops
        self._started_sub = trainer.subscribe(
            TrainBatchStarted, self._batch_started, owner="ThroughputMonitor._batch_started"
        )
        self._subs.append(self._started_sub)

    async def stop(self, trainer: TrainerView, stage: str) -> None:
        self._close()

    def teardown(self, trainer: TrainerView, stage: str) -> None:
        self._close()
        if stage == "fit":
            self._trainer = None
            self._t0 = None

    def _close(self) -> None:
        self._end_count()
        for sub in self._subs:
            sub.unsubscribe()
        self._subs = []
        self._pending.clear()
        self._free = []
        self._current = None

    # ------------------------------------------------------------ events
    def _batch_started(self, event: TrainBatchStarted) -> None:
        trainer = self._trainer
        if trainer is None:
            return
        if self._t0 is None:  # the first batch of this fit (resumed: after the load)
            self._t0 = perf_counter()
            self._last_step = trainer.global_step
            device = _module_device(trainer.module)
            self._cuda = device if device.type == "cuda" and torch.cuda.is_available() else None
            if self.peak_flops is None and self._cuda is not None:
                dtype = _compute_dtype(trainer)
                name = torch.cuda.get_device_name(self._cuda)
                self.peak = peak_flops(name, dtype) if dtype is not None else None
            if self.flops_per_step is None:
                self._begin_count(trainer)
        if self._cuda is not None:
            self._cuda_step_started()
        elif self._started_sub is not None:  # on CPU only the first batch needs this
            self._started_sub.unsubscribe()
            self._started_sub = None

    @on(TrainBatchCompleted)
    async def _batch_completed(self, event: TrainBatchCompleted) -> None:
        if self._t0 is None or self._trainer is None:
            return
        if self._counter is not None:  # no AfterBackward (no loss, manual optimization)
            self._end_count()
        batch = event.ctx.batch if event.ctx is not None else None
        n = self.samples(batch)
        self._samples += n if type(n) is int and n >= 0 else _as_count(n, "samples")
        if self.items is not None:
            n = self.items(batch)
            self._items += n if type(n) is int and n >= 0 else _as_count(n, "items")
        self._batches += 1
        if self._cuda is not None:
            self._cuda_step_completed()
        step = event.step
        if step != self._last_step and step % self.every_n_steps == 0:
            self._last_step = step
            await self._publish(self._trainer)

    @on(ValidationStarted)
    def _validation_started(self, event: ValidationStarted) -> None:
        if self._t0 is not None:
            self._val_started = perf_counter()

    @on(ValidationCompleted)
    def _validation_completed(self, event: ValidationCompleted) -> None:
        if self._val_started is not None:
            self._paused += perf_counter() - self._val_started
            self._val_started = None
            self._validations += 1

    # ------------------------------------------------------------ FLOPs
    def _begin_count(self, trainer: TrainerView) -> None:
        """Count the FLOPs of this batch's forward and backward, as the step runs them:
        ``FlopCounterMode`` from here (the batch starts) to ``AfterBackward``. The mode
        is thread-local: a forward that runs in another thread (``executor="thread"``)
        is seen by a module hook, and the count is then dropped, not under-reported."""
        self._threads = set()
        threads = self._threads

        def seen(module: torch.nn.Module, args: Any) -> None:
            threads.add(threading.get_ident())

        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(seen)
        counter = FlopCounterMode(display=False)
        counter.__enter__()  # type: ignore[no-untyped-call]
        self._counter = counter
        self._count_thread = threading.get_ident()
        self._subs.append(
            trainer.subscribe(
                AfterBackward, self._after_backward, owner="ThroughputMonitor._after_backward"
            )
        )

    def _after_backward(self, event: AfterBackward) -> None:
        self._end_count()

    def _end_count(self) -> None:
        counter, self._counter = self._counter, None
        if counter is None:
            return
        counter.__exit__(None, None, None)  # type: ignore[no-untyped-call]
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for sub in [s for s in self._subs if s.event_type is AfterBackward]:
            sub.unsubscribe()
            self._subs.remove(sub)
        if self._threads - {self._count_thread}:
            self.flops_per_step = None  # the step ran elsewhere: give flops_per_step=
            warnings.warn(
                "ThroughputMonitor: the training step ran in another thread "
                "(executor='thread'), where torch's FlopCounterMode (thread-local) cannot "
                "count it, so no throughput/flops_per_sec or throughput/mfu is put; pass "
                "ThroughputMonitor(flops_per_step=...) to have them, or run the step inline.",
                UserWarning,
                stacklevel=2,
            )
        else:
            self.flops_per_step = float(counter.get_total_flops())

    # ------------------------------------------------------------ CUDA timing
    def _cuda_step_started(self) -> None:
        self._step_started = perf_counter()
        self._step_validations = self._validations
        if len(self._pending) >= _MAX_PENDING:
            self._current = None
            return
        if self._free:
            pair = self._free.pop()
        else:
            new = torch.cuda.Event
            pair = (new(enable_timing=True), new(enable_timing=True))  # type: ignore[no-untyped-call]
        pair[0].record(torch.cuda.current_stream(self._cuda))
        self._current = pair

    def _cuda_step_completed(self) -> None:
        """The step's host time now; its device time (start to end event) once the end
        event has completed, read without waiting (``query()``), a few steps later."""
        pair, self._current = self._current, None
        if self._validations == self._step_validations:  # no validation inside the step
            self._host_ms += (perf_counter() - self._step_started) * 1000.0
            self._host_n += 1
            if pair is not None:
                pair[1].record(torch.cuda.current_stream(self._cuda))
                self._pending.append(pair)
        elif pair is not None:
            self._free.append(pair)
        pending = self._pending
        while pending and pending[0][1].query():
            start, end = pending.popleft()
            self._device_ms += start.elapsed_time(end)
            self._device_n += 1
            self._free.append((start, end))

    # ------------------------------------------------------------ records
    def _window(self) -> dict[str, float]:
        """This rank's values over the window that ends now; starts the next window."""
        now = perf_counter()
        assert self._t0 is not None
        elapsed = now - self._t0 - self._paused
        local: dict[str, float] = {}
        if elapsed > 0:
            local["samples_per_sec"] = self._samples / elapsed
            local["batches_per_sec"] = self._batches / elapsed
            if self.items is not None:
                local["items_per_sec"] = self._items / elapsed
            flops = self.flops_per_step
            if flops is not None:
                local["flops_per_step"] = flops
                local["flops_per_sec"] = flops * self._batches / elapsed
                if self.peak is not None:
                    local["mfu"] = local["flops_per_sec"] / self.peak
        if self._host_n:
            local["host_ms_per_step"] = self._host_ms / self._host_n
        if self._device_n:
            local["device_ms_per_step"] = self._device_ms / self._device_n
        self._t0, self._paused = now, 0.0
        self._batches = self._samples = self._items = 0
        self._host_ms = self._device_ms = 0.0
        self._host_n = self._device_n = 0
        return local

    async def _publish(self, trainer: TrainerView) -> None:
        """Put the window's figures and deliver them now (awaiting the publication of a
        :class:`ThroughputMeasured`), so they carry the step that closed the window."""
        local = self._window()
        self.device = local
        world = local if trainer.world_size == 1 else _world(trainer, local)
        self.latest = dict(world)
        for name, value in world.items():
            self.put(f"throughput/{name}", value, self.destinations)
        await trainer.publish(ThroughputMeasured(values=dict(world), device=dict(local)))


#: Summed over the ranks (world totals) / averaged over the ranks that have them.
_SUMMED = ("samples_per_sec", "batches_per_sec", "items_per_sec", "flops_per_sec")
_AVERAGED = ("flops_per_step", "mfu", "host_ms_per_step", "device_ms_per_step")
_ORDER = (
    "samples_per_sec",
    "batches_per_sec",
    "items_per_sec",
    "flops_per_step",
    "flops_per_sec",
    "mfu",
    "host_ms_per_step",
    "device_ms_per_step",
)


def _world(trainer: TrainerView, local: Mapping[str, float]) -> dict[str, float]:
    """``local`` of every rank combined with one host all-reduce (the strategy's): a
    value and whether the rank has it, for each name; rates summed where every rank has
    them, the rest averaged over the ranks that have them."""
    names = _SUMMED + _AVERAGED
    values: list[float] = []
    for name in names:
        values += [local.get(name, 0.0), 1.0 if name in local else 0.0]
    total = trainer.strategy.all_reduce_host(values, "sum")
    # The ranks that read each batch: the tensor-parallel peers of a data-parallel replica.
    readers = trainer.world_size / trainer.strategy.data_parallel_size
    world: dict[str, float] = {}
    for i, name in enumerate(names):
        value, ranks = total[2 * i], total[2 * i + 1]
        if name in _SUMMED and ranks == trainer.world_size:
            world[name] = value if name == "flops_per_sec" else value / readers
        elif name in _AVERAGED and ranks > 0:
            world[name] = value / ranks
    return {name: world[name] for name in _ORDER if name in world}


def _destinations(value: str | Iterable[str]) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else tuple(value)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise MisconfigurationError(
            f"ThroughputMonitor(destinations={value!r}) must name one or more put "
            "destinations, e.g. ('loggers', 'external') or 'loggers'."
        )
    return names
