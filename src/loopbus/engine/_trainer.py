"""The Trainer: owns the bus, the loops and the run's state; stages are coroutines."""

from __future__ import annotations

import functools
import logging
import math
import os
import warnings
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

import anyio
import anyio.from_thread
import anyio.to_thread
import msgspec
import torch

from .._exceptions import CheckpointError, MisconfigurationError
from .._validate import check_choice, check_int, check_number
from ..events import (
    CustomEvent,
    Event,
    EventBus,
    ExceptionRaised,
    PutRecord,
    Subscription,
    Teardown,
)
from ._checkpoint import (
    CheckpointMismatch,
    GradsPart,
    HparamsPart,
    LoaderPart,
    LoopPart,
    ModulePart,
    OptimizerPart,
    PrecisionPart,
    RngPart,
    SchedulerPart,
    collect_state,
    load_checkpoint,
    load_state,
    resolve_best,
    resolve_last,
    write_checkpoint,
)
from ._device import CudaBatchSource, pin_batch
from ._loop import Loop
from ._loops import (
    EvaluationLoop,
    FitLoop,
    PredictionLoop,
    SanityCheckLoop,
    StepBoundary,
    StepPath,
)
from ._module import Module
from ._plugin import Plugin
from ._precision import Precision, resolve_precision
from ._records import Publication, Recorder, bind_recorder
from ._rng import capture_rng, restore_rng
from ._runstate import RunState
from ._scope import LeakCheck
from ._state import Stateful
from ._strategy import Strategy, StrategyName, resolve_strategy

__all__ = ["SchedulerConfig", "Trainer", "set_default_plugins"]

Executor = Literal["inline", "thread"]

_log = logging.getLogger("loopbus")

_DEFAULT_PLUGINS: list[Callable[[], Plugin]] = []


def set_default_plugins(factories: Iterable[Callable[[], Plugin]]) -> None:
    """Set what ``Trainer(plugins=None)`` uses (``loopbus.plugins`` sets a progress bar)."""
    _DEFAULT_PLUGINS[:] = list(factories)


class SchedulerConfig:
    """A learning-rate scheduler and when to step it."""

    __slots__ = ("frequency", "interval", "monitor", "scheduler")

    def __init__(
        self,
        scheduler: Any,
        interval: str = "epoch",
        frequency: int = 1,
        monitor: str | None = None,
    ) -> None:
        if interval not in ("epoch", "step"):
            raise MisconfigurationError(
                f"lr scheduler interval must be 'epoch' or 'step', got {interval!r}."
            )
        if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
            raise MisconfigurationError(
                f"lr scheduler frequency must be an int >= 1, got {frequency!r}."
            )
        if not hasattr(scheduler, "step"):
            raise MisconfigurationError(f"{scheduler!r} is not an LR scheduler (no .step()).")
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau) and not monitor:
            raise MisconfigurationError(
                "ReduceLROnPlateau needs a metric: configure it as {'scheduler': sched, "
                "'monitor': 'val/loss'} with the name of a put record."
            )
        self.scheduler = scheduler
        self.interval = interval
        self.frequency = frequency
        self.monitor = monitor

    def __repr__(self) -> str:
        return (
            f"SchedulerConfig({type(self.scheduler).__name__}, interval={self.interval!r}, "
            f"frequency={self.frequency}, monitor={self.monitor!r})"
        )


def _parse_scheduler(item: Any) -> SchedulerConfig:
    if isinstance(item, SchedulerConfig):
        return item
    if isinstance(item, dict):
        unknown = set(item) - {"scheduler", "interval", "frequency", "monitor", "name", "strict"}
        if unknown or "scheduler" not in item:
            raise MisconfigurationError(
                "an lr scheduler config is {'scheduler': s, 'interval': 'epoch'|'step', "
                f"'frequency': 1, 'monitor': name}}; got keys {sorted(item)}."
            )
        return SchedulerConfig(
            item["scheduler"],
            item.get("interval", "epoch"),
            item.get("frequency", 1),
            item.get("monitor"),
        )
    return SchedulerConfig(item)


def _parse_optimizers(value: Any, module: Module) -> tuple[list[Any], list[SchedulerConfig]]:
    what = f"{type(module).__name__}.configure_optimizers()"
    if isinstance(value, torch.optim.Optimizer):
        return [value], []
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, (list, tuple)):
        if (
            len(value) == 2
            and isinstance(value[0], (list, tuple))
            and isinstance(value[1], (list, tuple))
        ):
            opts = list(value[0])
            scheds = [_parse_scheduler(s) for s in value[1]]
        elif all(isinstance(v, dict) for v in value) and value:
            opts, scheds = [], []
            for d in value:
                if "optimizer" not in d:
                    raise MisconfigurationError(f"{what} returned a dict without 'optimizer'.")
                opts.append(d["optimizer"])
                if d.get("lr_scheduler") is not None:
                    scheds.append(_parse_scheduler(d["lr_scheduler"]))
        else:
            opts, scheds = list(value), []
        bad = [o for o in opts if not isinstance(o, torch.optim.Optimizer)]
        if bad or not opts:
            raise MisconfigurationError(
                f"{what} must return torch optimizers; got {bad or value!r}."
            )
        return opts, scheds
    raise MisconfigurationError(
        f"{what} returned {value!r}; return an optimizer, a list of them, "
        "(optimizers, schedulers), or {'optimizer': opt, 'lr_scheduler': sched}."
    )


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        # Under torchrun (or any launcher that sets LOCAL_RANK) each process takes the
        # GPU of its local rank.
        local_rank = os.environ.get("LOCAL_RANK")
        if local_rank is not None and local_rank.isdigit():
            return torch.device("cuda", int(local_rank) % torch.cuda.device_count())
        return torch.device("cuda")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise MisconfigurationError(
            f"device={device!r} is not a device; use 'auto', 'cpu', 'cuda' or 'cuda:N'."
        ) from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise MisconfigurationError(
            f"device={device!r} but CUDA is not available here; use device='auto' or 'cpu'."
        )
    return resolved


def _check_limit(name: str, value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, float) and 0.0 <= value <= 1.0:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise MisconfigurationError(
        f"{name} must be a number of batches (int >= 0) or a fraction (float in [0, 1]), "
        f"got {value!r}."
    )


def _check_data(data: Any, name: str) -> None:
    if data is None:
        raise MisconfigurationError(f"{name} is None; pass a DataLoader or another iterable.")
    if not hasattr(data, "__iter__"):
        hint = ""
        if hasattr(data, "__getitem__"):
            hint = (
                " It looks like a Dataset: wrap it in "
                "torch.utils.data.DataLoader(dataset, batch_size=...)."
            )
        raise MisconfigurationError(
            f"{name} must be an iterable of batches (a DataLoader), got "
            f"{type(data).__name__}.{hint}"
        )


def _collapse(group: BaseExceptionGroup[Any]) -> BaseException | None:
    """The one meaningful exception in a task group's group, if there is exactly one."""
    cancelled = anyio.get_cancelled_exc_class()
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for sub in exc.exceptions:
                walk(sub)
        else:
            leaves.append(exc)

    walk(group)
    meaningful = [e for e in leaves if not isinstance(e, cancelled)]
    if len(meaningful) == 1:
        return meaningful[0]
    if not meaningful and leaves:
        return leaves[0]
    return None


# Lightning's names for what loopbus calls otherwise, with the way to say it here.
_RENAMED = {
    "callbacks": "loopbus calls these `plugins`: Trainer(plugins=[...])",
    "logger": "loggers are plugins: Trainer(plugins=[CSVLogger(...), ...])",
    "accelerator": "choose the device with `device` ('auto', 'cpu', 'cuda', 'cuda:N')",
    "devices": "choose the device with `device`; several GPUs run under torchrun",
    "gpus": "choose the device with `device` ('cuda' or 'cuda:N')",
    "enable_progress_bar": "the progress bar is a plugin: pass plugins=[] to turn it off",
    "default_root_dir": "give each plugin that writes files its directory",
}


def _unknown_options(unknown: dict[str, Any]) -> TypeError:
    import difflib
    import inspect

    known = [p for p in inspect.signature(Trainer.__init__).parameters if p not in ("self", "unknown")]
    lines = []
    for name in unknown:
        if name in _RENAMED:
            lines.append(f"{name!r}: {_RENAMED[name]}")
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        lines.append(
            f"{name!r}: did you mean `{close[0]}`?" if close else f"{name!r} is not an option"
        )
    return TypeError(
        "Trainer() got unknown option(s): " + "; ".join(lines) + f". Its options are {known}."
    )


class Trainer:
    """Runs a :class:`Module` through ``fit``, ``validate``, ``test`` and ``predict``.

    Every stage is a coroutine: ``await trainer.fit(module, train_data, val_data)``, or
    from synchronous code ``loopbus.run(trainer.fit, module, train_data, val_data)``.

    Options (all keyword-only):

    * ``max_epochs`` / ``max_steps``: stop after this many epochs / optimizer steps
      (when neither is given: 1000 epochs, with a notice logged on rank 0; ``-1`` means
      no limit, as in Lightning).
    * ``num_sanity_val_steps``: validation batches run before ``fit``'s first training
      step, so a broken ``validation_step`` fails in seconds (default 2; ``-1`` runs the
      whole validation set, 0 turns it off). Its records are dropped (no logger, plugin
      or ``trainer.latest`` sees them), it leaves the random generators as it found them,
      and a ``fit`` resumed from a checkpoint taken mid-epoch skips it.
    * ``fast_dev_run``: ``True`` (1) or N runs N batches of each stage (train, validation,
      test, predict) and one epoch, with no sanity check, and leaves out the plugins
      that write files (``Plugin.writes_files``: checkpoints, loggers), so nothing is
      written; a notice says so. For a quick check that a script runs end to end.
    * ``enable_model_summary``: whether the ``ModelSummary`` plugin (one of the default
      plugins) prints its table of the module's layers when ``fit`` starts (default
      True).
    * ``val_check_interval``: validate every N training batches; None (default) validates
      once at the end of every ``check_val_every_n_epoch``-th epoch.
    * ``limit_{train,val,test,predict}_batches``: an int (batches) or a float (fraction).
    * ``accumulate_grad_batches``, ``gradient_clip_val``, ``gradient_clip_algorithm``
      (``"norm"`` or ``"value"``).
    * ``plugins``: the plugins of every stage; None means the default set (a progress
      bar), ``[]`` means none.
    * ``executor``: ``"inline"`` runs steps on the event loop thread (lowest overhead);
      ``"thread"`` runs them in a worker thread so the host application stays responsive.
    * ``device``: ``"auto"`` (CUDA if available: ``cuda:LOCAL_RANK`` when the launcher
      sets ``LOCAL_RANK``, as torchrun does), ``"cpu"``, ``"cuda"``, ``"cuda:N"``.
    * ``precision``: ``"32"`` (default) or a registered name such as ``"bf16-mixed"``.
    * ``leak_check``: ``"raise"``/``"warn"`` verify that scopes free what they held;
      the default reads the ``LOOPBUS_LEAK_CHECK`` environment variable (off if unset).
    * ``yield_interval``: the longest time (s) steps run before yielding to other tasks.
    * ``drain_timeout``: how long (s) a cancelled or failed stage waits for queued
      subscribers to finish (a normal end always waits for all of them).
    * ``prefetch``: 0 (default) fetches each batch when the loop needs it; N >= 1 has a
      worker thread fetch up to N batches ahead while the steps run, which overlaps
      loading that releases the GIL (file I/O, decoding in C, torch ops) with compute.
      Random draws in the loading code then share torch's global generator with the
      step from another thread: give the dataset its own ``torch.Generator`` to keep
      runs reproducible. Checkpoints save the position of the last batch trained on.
    * ``put_lag``: on a CUDA device, tensors put during a step are copied to the host
      without the host waiting, and their records are delivered once the copy is done
      (checked at every step boundary) or, at the latest, when more than ``put_lag``
      steps' records wait (default 4; 0: at once, a host sync per step). Every other
      boundary (epoch, validation, stage end) delivers everything first. See
      ``docs/performance.md``.
    * ``device_prefetch``: on a CUDA device, how many batches are copied to the device
      ahead of the step, on a side stream, while the step computes (default 1; 0 moves
      each batch in its own iteration on the compute stream). Unpinned batches are
      pinned first (by the prefetch worker when ``prefetch`` is on). See
      ``docs/performance.md``.
    * ``strategy``: ``"auto"`` (default) runs DDP when launched by ``torchrun`` with
      more than one process (``WORLD_SIZE > 1``), else in this process; ``"ddp"`` or
      ``"single"`` force one (see ``docs/distributed.md``). Under DDP the trainer joins
      the process group unless the script already did (gloo on CPU, NCCL on CUDA).
    * ``process_group_timeout``: seconds a collective may wait for the other ranks
      before it fails (default 1800, torch's default); a rank that dies is normally
      noticed sooner, since torchrun then stops the others.
    * ``stop_check_interval``: under DDP, about how many seconds apart the ranks
      exchange stop requests (default 0.05), in a small asynchronous all-reduce no step
      waits for: a stop asked on any rank stops every rank at the same step boundary,
      one to two intervals later. 0 exchanges at every step boundary (a stop then lands
      one boundary after it was asked, whatever the timing; one all-reduce per step).
      See ``docs/distributed.md``.
    """

    def __init__(
        self,
        *,
        max_epochs: int | None = None,
        max_steps: int | None = None,
        val_check_interval: int | None = None,
        check_val_every_n_epoch: int = 1,
        limit_train_batches: int | float | None = None,
        limit_val_batches: int | float | None = None,
        limit_test_batches: int | float | None = None,
        limit_predict_batches: int | float | None = None,
        accumulate_grad_batches: int = 1,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: Literal["norm", "value"] = "norm",
        plugins: Iterable[Plugin] | None = None,
        executor: Executor = "inline",
        device: str | torch.device | None = "auto",
        precision: str | int | Precision | None = "32",
        leak_check: LeakCheck | Literal["env"] = "env",
        yield_interval: float = 0.005,
        drain_timeout: float = 10.0,
        prefetch: int = 0,
        device_prefetch: int = 1,
        put_lag: int = 4,
        strategy: StrategyName = "auto",
        process_group_timeout: float = 1800.0,
        stop_check_interval: float = 0.05,
        num_sanity_val_steps: int = 2,
        fast_dev_run: bool | int = False,
        enable_model_summary: bool = True,
        **unknown: Any,
    ) -> None:
        if unknown:
            raise _unknown_options(unknown)
        dev_run_hint = "True runs 1 batch of each stage, N runs N; False (0) turns it off"
        if fast_dev_run is True or fast_dev_run is False:
            fast_dev_run = int(fast_dev_run)
        #: Batches of each stage under ``fast_dev_run`` (0: off).
        self.fast_dev_run: int = check_int(
            "fast_dev_run", fast_dev_run, minimum=0, hint=dev_run_hint
        )
        self.num_sanity_val_steps = check_int(
            "num_sanity_val_steps",
            num_sanity_val_steps,
            minimum=-1,
            hint="-1 runs the whole validation set, 0 turns the sanity check off",
        )
        if not isinstance(enable_model_summary, bool):
            raise MisconfigurationError(
                f"enable_model_summary must be True or False, got {enable_model_summary!r}."
            )
        self.enable_model_summary = enable_model_summary
        defaulted_epochs = False
        if self.fast_dev_run:
            n = self.fast_dev_run
            max_epochs, max_steps = 1, None
            limit_train_batches = limit_val_batches = n
            limit_test_batches = limit_predict_batches = n
            val_check_interval, check_val_every_n_epoch = None, 1
            self.num_sanity_val_steps = 0
        # -1 is Lightning's "no limit" (None here); asked for, it replaces the default.
        unlimited = False
        if max_epochs == -1 and type(max_epochs) is int:
            max_epochs, unlimited = None, True
        if max_steps == -1 and type(max_steps) is int:
            max_steps, unlimited = None, True
        check_int("max_epochs", max_epochs, minimum=0, allow_none=True)
        check_int("max_steps", max_steps, minimum=0, allow_none=True)
        if max_epochs is None and max_steps is None and not unlimited:
            max_epochs, defaulted_epochs = 1000, True
        self.max_epochs: float = math.inf if max_epochs is None else max_epochs
        self.max_steps: float = math.inf if max_steps is None else max_steps
        self.val_check_interval = check_int(
            "val_check_interval", val_check_interval, allow_none=True
        )
        self.check_val_every_n_epoch = check_int("check_val_every_n_epoch", check_val_every_n_epoch)
        self.limit_train_batches = _check_limit("limit_train_batches", limit_train_batches)
        self.limit_val_batches = _check_limit("limit_val_batches", limit_val_batches)
        self.limit_test_batches = _check_limit("limit_test_batches", limit_test_batches)
        self.limit_predict_batches = _check_limit("limit_predict_batches", limit_predict_batches)
        self.accumulate_grad_batches = check_int("accumulate_grad_batches", accumulate_grad_batches)
        if gradient_clip_val is not None and (
            isinstance(gradient_clip_val, bool)
            or not isinstance(gradient_clip_val, (int, float))
            or gradient_clip_val <= 0
        ):
            raise MisconfigurationError(
                f"gradient_clip_val must be a positive number or None, got {gradient_clip_val!r}."
            )
        self.gradient_clip_val = gradient_clip_val
        if gradient_clip_algorithm not in ("norm", "value"):
            raise MisconfigurationError(
                f"gradient_clip_algorithm must be 'norm' or 'value', got {gradient_clip_algorithm!r}."
            )
        self.gradient_clip_algorithm = gradient_clip_algorithm
        if executor not in ("inline", "thread"):
            raise MisconfigurationError(
                f"executor must be 'inline' (steps on the event loop thread) or 'thread' (steps "
                f"in a worker thread), got {executor!r}."
            )
        self.executor: Executor = executor
        self.device = _resolve_device(device)
        self.precision = resolve_precision(precision)
        if leak_check == "env":
            from ._loop import _default_leak_check

            leak_check = _default_leak_check()
        if leak_check not in (None, "raise", "warn"):
            raise MisconfigurationError(
                f"leak_check must be None, 'warn' or 'raise', got {leak_check!r}."
            )
        self.leak_check: LeakCheck = leak_check
        if not isinstance(yield_interval, (int, float)) or yield_interval < 0:
            raise MisconfigurationError(
                f"yield_interval must be a number of seconds >= 0, got {yield_interval!r}."
            )
        self.yield_interval = float(yield_interval)
        self.prefetch = check_int(
            "prefetch",
            prefetch,
            minimum=0,
            hint="0 fetches batches inline; N >= 1 fetches up to N ahead in a worker thread",
        )
        self.device_prefetch = check_int(
            "device_prefetch",
            device_prefetch,
            minimum=0,
            hint="0 moves each batch on the compute stream; N >= 1 copies up to N ahead",
        )
        self.put_lag = check_int(
            "put_lag",
            put_lag,
            minimum=0,
            hint="how many steps' records may wait for their values to reach the host",
        )
        self.drain_timeout = float(drain_timeout)
        check_choice(
            "strategy",
            strategy,
            {
                "auto": "DDP under torchrun, else one process",
                "ddp": "DistributedDataParallel, one process per device",
                "single": "this process only",
            },
        )
        timeout = check_number("process_group_timeout", process_group_timeout, exclusive_minimum=0)
        check_interval = check_number(
            "stop_check_interval",
            stop_check_interval,
            minimum=0,
            hint="seconds between the ranks' stop checks under DDP (0: every step)",
        )
        #: How the run is spread over processes (one, or DDP); owns the DDP wrapper.
        self.strategy: Strategy = resolve_strategy(strategy, float(timeout), float(check_interval))
        self.strategy.setup_environment(self.device)
        if self.strategy.is_global_zero:
            if defaulted_epochs:
                _log.warning(
                    "Trainer: neither max_epochs nor max_steps was given, so training stops "
                    "after max_epochs=1000; pass max_epochs=-1 to train without a limit."
                )
            if self.fast_dev_run:
                _log.warning(
                    "Trainer(fast_dev_run=%d): runs %d batch(es) of each stage and one "
                    "epoch, with no sanity check; plugins that write files (checkpoints, "
                    "logs) are left out, so none are written.",
                    self.fast_dev_run,
                    self.fast_dev_run,
                )

        if plugins is None:
            self.plugins: list[Plugin] = [factory() for factory in _DEFAULT_PLUGINS]
        else:
            self.plugins = list(plugins)
        for plugin in self.plugins:
            if not isinstance(plugin, Plugin):
                raise MisconfigurationError(
                    f"plugins must be loopbus.Plugin instances, got {plugin!r}"
                    + (" (a class: instantiate it)" if isinstance(plugin, type) else "")
                    + "."
                )

        self.bus = EventBus()
        self.recorder = Recorder(self, self.bus, self.put_lag)
        self.bus.attach_records(self.recorder)
        self.fit_loop = FitLoop()
        self.validate_loop = EvaluationLoop(stage="validate")
        self.test_loop = EvaluationLoop(stage="test")
        self.predict_loop = PredictionLoop()
        for loop in self.loops.values():
            loop.attach(bus=self.bus, trainer=self, leak_check=self.leak_check)

        self.module: Module | None = None
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_scheduler_configs: list[SchedulerConfig] = []
        #: The run's state (step, epoch, stage, stop request, resume plan): read it here
        #: or through the properties below; the trainer and its loops advance it.
        self.state = RunState()
        self._registered: dict[str, Stateful] = {}
        self._parts: dict[str, Any] | None = None
        # Steps at which the LR schedulers may step before the optimizer has in this
        # process (right after a resume), which torch would otherwise warn about.
        self._resumed_at_step: int | None = None
        self._automatic = True
        self._step_schedulers = False
        self._configured_for: Module | None = None
        self._step_path: StepPath | None = None
        # The training data of the current (or last) fit, for its loader's state.
        self._train_data: Any = None

    def __repr__(self) -> str:
        return f"<Trainer stage={self.stage!r} step={self.global_step} epoch={self.current_epoch}>"

    @property
    def loops(self) -> dict[str, Loop[Any]]:
        """The root loops of the stages."""
        return {
            "fit": self.fit_loop,
            "validate": self.validate_loop,
            "test": self.test_loop,
            "predict": self.predict_loop,
        }

    @property
    def global_step(self) -> int:
        """Optimizer steps completed (read-only; ``trainer.state.step``)."""
        return self.state.step

    @property
    def current_epoch(self) -> int:
        """The current (or last) epoch, 0-based (read-only; ``trainer.state.epoch``)."""
        return self.state.epoch

    @property
    def stage(self) -> str | None:
        """The running stage ("fit", "validate", "test", "predict"), or None."""
        return self.state.stage

    @property
    def world_size(self) -> int:
        """The number of processes of the run (1 unless launched for DDP)."""
        return self.strategy.world_size

    @property
    def global_rank(self) -> int:
        """This process's rank among all processes of the run (0 in a single process)."""
        return self.strategy.global_rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its machine (0 in a single process)."""
        return self.strategy.local_rank

    @property
    def is_global_zero(self) -> bool:
        """Whether this is rank 0 (always, in a single process): the process that
        writes logs and checkpoints."""
        return self.strategy.is_global_zero

    def _acts_here(self, plugin: Plugin) -> bool:
        if self.fast_dev_run and plugin.writes_files:
            return False
        return plugin.delivery.ranks == "all" or self.strategy.is_global_zero

    @property
    def sanity_checking(self) -> bool:
        """Whether ``fit`` is running its sanity check (see ``num_sanity_val_steps``)."""
        return self.state.sanity_checking

    @property
    def should_stop(self) -> bool:
        """Whether the running stage was asked to stop (see :meth:`request_stop`)."""
        return self.state.stop_requested

    @property
    def stop_reason(self) -> str | None:
        """Why the running (or last) stage was asked to stop, if it was."""
        return self.state.stop_reason

    @property
    def latest(self) -> dict[str, PutRecord]:
        """The last record of each name put so far, in any stage of this trainer.

        A stage keeps the records of earlier ones until it puts a record of the same
        name: after ``fit`` then ``test``, both stages' names are here (``test``'s
        value wherever both put one). Records are here once flushed: at every step
        boundary, and between two handlers of one event when the first put something
        (so a handler sees what an earlier handler of the same event put)."""
        return self.recorder.latest_records()

    @property
    def stage_latest(self) -> dict[str, PutRecord]:
        """The last record of each name put during the running (or last) stage only
        (what ``validate`` and ``test`` return, and the results table shows)."""
        return self.recorder.stage_records()

    def request_stop(self, reason: str | None = None) -> None:
        """Ask the running stage to stop at the next step boundary, without an exception
        (validation inside ``fit`` finishes its pass first). Safe to call from any task
        and from other threads."""
        self.state.request_stop(reason)

    def subscribe(self, event_type: Any, handler: Any, **options: Any) -> Subscription:
        """Shortcut for ``trainer.bus.subscribe``."""
        return self.bus.subscribe(event_type, handler, **options)

    def publish(self, event: Event) -> Publication:
        """Publish a (custom) event on this trainer's bus while a stage runs.

        The event is queued at once, after the records put and the events published
        before it, and delivered in that order. ``await trainer.publish(event)`` (from
        async code: a handler, a plugin's ``start``) delivers it before returning; called
        without ``await`` (from synchronous code: ``training_step``, a plain ``def``
        handler) it is delivered at the next step boundary, or between two handlers of
        the event being handled. Either way it is delivered: leaving out ``await`` loses
        nothing. (A stage that fails or is cancelled drops what is still queued, as it
        drops unflushed records.)

        A :class:`~loopbus.events.CustomEvent` left with ``step``/``epoch`` at -1 gets
        the trainer's ``global_step`` and ``current_epoch`` of the moment of this call.

        Raises :class:`RuntimeError` outside a stage, where nothing would deliver it:
        there, ``await trainer.bus.publish(event)`` delivers to inline subscribers.
        """
        if not isinstance(event, Event):
            raise TypeError(
                f"trainer.publish() takes an event (an instance of a loopbus.Event "
                f"subclass), got {event!r}."
            )
        state = self.state
        if state.stage is None:
            raise RuntimeError(
                f"trainer.publish({type(event).__name__}(...)) was called while no stage "
                "runs, so nothing would deliver it; publish from a step, a handler or a "
                "plugin while fit/validate/test/predict runs, or call "
                "`await trainer.bus.publish(event)`."
            )
        if isinstance(event, CustomEvent) and (event.step < 0 or event.epoch < 0):
            event = msgspec.structs.replace(
                event,
                step=state.step if event.step < 0 else event.step,
                epoch=state.epoch if event.epoch < 0 else event.epoch,
            )
        return self.recorder.queue_event(event)

    # ------------------------------------------------------------ stages
    async def fit(
        self,
        module: Module,
        train_data: Any,
        val_data: Any = None,
        *,
        ckpt_path: str | os.PathLike[str] | None = None,
        ckpt_strict: bool = True,
    ) -> None:
        """Train ``module`` on ``train_data``, validating on ``val_data`` when given.

        ``ckpt_path`` resumes from a checkpoint exactly where it was taken (mid-epoch
        included): a file, a directory (its last checkpoint) or ``"last"`` (the newest
        checkpoint of the plugins that write them, such as ``Checkpoint``; a warning and
        a fresh start if there is none yet). ``ckpt_strict=False`` loads what matches the
        current run and warns about the rest (see ``docs/checkpointing.md``).
        """
        _check_data(train_data, "train_data")
        if val_data is not None:
            _check_data(val_data, "val_data")
        self._check_module(module, "fit", "training_step")
        if val_data is not None:
            self._check_module(module, "fit with val_data", "validation_step")
        train_data = self.strategy.prepare_train_data(train_data)
        async with self._stage("fit", module, train_data=train_data):
            if ckpt_path is not None:
                await self._resume(ckpt_path, ckpt_strict)
            if val_data is not None:
                await self._sanity_check(module, val_data)
            await self.fit_loop.run(train_data, val_data)

    async def _sanity_check(self, module: Module, val_data: Any) -> None:
        """Run ``num_sanity_val_steps`` validation batches before training, unseen by the
        plugins (a bus of its own) and unrecorded (records dropped), and leave the random
        generators as they were. Skipped when resuming mid-epoch."""
        steps = self.num_sanity_val_steps
        if not steps or self.limit_val_batches == 0 or self.fit_loop.epoch_loop.resumes_mid_epoch:
            return
        if self.recorder.pending or self.recorder.inflight:
            await self.recorder.flush()  # what was put before belongs to the run
        loop = SanityCheckLoop(math.inf if steps == -1 else steps)
        bus = EventBus()
        loop.attach(bus=bus, trainer=self, leak_check=self.leak_check)
        subscriptions = bus.subscribe_methods(module, owner=type(module).__name__)
        rng = capture_rng()
        self.state.begin_sanity_check()
        try:
            async with bus.running(self.drain_timeout):
                await loop.run(val_data)
        except BaseException as exc:
            grouped = isinstance(exc, BaseExceptionGroup)
            error = _collapse(exc) if isinstance(exc, BaseExceptionGroup) else exc
            if not isinstance(error, Exception):
                raise  # cancelled, or several failures
            error.add_note(
                f"raised during fit's sanity check (num_sanity_val_steps={steps}), before "
                "the first training step: validation_step or a validation handler fails."
            )
            if grouped:
                raise error from error.__cause__
            raise
        finally:
            self.state.end_sanity_check()
            for sub in subscriptions:
                sub.unsubscribe()
            loop.teardown_tree()
            self.recorder.discard_pending()
            restore_rng(rng)

    async def _resume(self, ckpt_path: str | os.PathLike[str], strict: bool) -> None:
        if ckpt_path == "last":
            # Resolved once, on rank 0, so that every rank loads the same file.
            found = resolve_last(self.plugins) if self.strategy.is_global_zero else None
            path = self.strategy.broadcast_object(found)
        else:
            path = ckpt_path
        if path is None:
            return
        state = await anyio.to_thread.run_sync(load_checkpoint, path)
        mismatch = self._load(state, strict=strict, source=str(path))
        if mismatch:
            warnings.warn(
                f"resumed from {path} with ckpt_strict=False; what did not match kept its "
                f"current state:\n{mismatch}",
                UserWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------ checkpoints
    def register_stateful(self, name: str, obj: Stateful) -> None:
        """Save and restore ``obj`` (anything with ``state_dict``/``load_state_dict``: a
        data module, an EMA copy of the weights, a metric) with every checkpoint of this
        trainer, under the key ``"user/<name>"``. Register before the stage whose
        checkpoints should hold it starts; a resumed run must register the same names."""
        if not isinstance(name, str) or not name or "/" in name:
            raise MisconfigurationError(
                f"register_stateful needs a non-empty name without '/', got {name!r}."
            )
        if not isinstance(obj, Stateful):
            raise MisconfigurationError(
                f"register_stateful({name!r}, ...) needs an object with state_dict() and "
                f"load_state_dict(state), got {type(obj).__name__}."
            )
        if name in self._registered and self._registered[name] is not obj:
            raise MisconfigurationError(
                f"another object is already registered as {name!r}; choose another name."
            )
        if self.state.stage is not None:
            raise RuntimeError(
                f"register_stateful({name!r}, ...) was called while {self.state.stage!r} "
                "runs; register objects before the stage starts."
            )
        self._registered[name] = obj

    def stateful_parts(self) -> dict[str, Stateful]:
        """The registry a checkpoint is composed from, key -> :class:`Stateful` part:
        the run state, the generators, the module, its hyperparameters, each optimizer and scheduler, the
        precision, the loop tree, every stateful plugin, the training loader when it is
        stateful, gradients mid-accumulation, the latest records and every registered
        object. Built when a stage starts; a new dict each call."""
        if self._parts is not None:
            return dict(self._parts)
        return self._build_parts()

    def _build_parts(self) -> dict[str, Any]:
        module = self.module
        if module is None:
            raise CheckpointError(
                "the trainer has no module yet, so there is no run state to save or load; "
                "a checkpoint can be taken once fit (or another stage) has started, and is "
                "loaded with trainer.fit(module, data, ckpt_path=...)."
            )
        parts: dict[str, Any] = {
            "run": self.state,
            "rng": RngPart(self.strategy),
            "module": ModulePart(module),
            "hparams": HparamsPart(module),
        }
        for index, opt in enumerate(self.optimizers):
            parts[f"optimizers/{index}"] = OptimizerPart(opt)
        for index, config in enumerate(self.lr_scheduler_configs):
            parts[f"lr_schedulers/{index}"] = SchedulerPart(config.scheduler)
        parts["precision"] = PrecisionPart(self.precision)
        for name, loop in self.loops.items():
            parts[f"loops/{name}"] = LoopPart(loop)
        for plugin in self.plugins:
            if type(plugin).state_dict is Plugin.state_dict:
                continue  # keeps no state
            key = f"plugins/{plugin.state_key}"
            if key in parts:
                # Two plugins with one key (two instances of a class): number them in
                # the order they were given, which a resumed run repeats.
                n = 2
                while f"{key}#{n}" in parts:
                    n += 1
                key = f"{key}#{n}"
            parts[key] = plugin
        data = self._train_data
        if isinstance(data, Stateful):
            epoch_loop = self.fit_loop.epoch_loop
            parts["data/train"] = LoaderPart(
                data,
                epoch_loop.loader_position,
                lambda: epoch_loop.next_epoch_fresh,
                lambda: self.state.epoch,
            )
        parts["grads"] = GradsPart(module)
        parts["records"] = self.recorder
        for name, obj in self._registered.items():
            parts[f"user/{name}"] = obj
        return parts

    def state_dict(self, *, to_host: bool = False) -> dict[str, Any]:
        """The run's state as a checkpoint dict of plain tensors and Python primitives,
        one entry per part of :meth:`stateful_parts`. With ``to_host`` the tensors are
        copies in host memory (safe to write while training goes on); otherwise the live
        tensors."""
        return collect_state(self, self.stateful_parts(), to_host=to_host)

    def load_state_dict(
        self, state: dict[str, Any], strict: bool = True
    ) -> CheckpointMismatch:
        """Load a checkpoint dict into this run (module and optimizers must be set up:
        resume through ``fit(..., ckpt_path=...)``). With ``strict`` any part that is
        missing, unexpected or incompatible raises :class:`CheckpointError`; without,
        what matches loads and the returned :class:`CheckpointMismatch` lists the rest."""
        return self._load(state, strict=strict)

    def _load(
        self, state: dict[str, Any], *, strict: bool, source: str | None = None
    ) -> CheckpointMismatch:
        mismatch, plan = load_state(self.stateful_parts(), state, strict=strict, source=source)
        self.state.plan_resume(plan)
        self._resumed_at_step = plan.step
        return mismatch

    def save_checkpoint(self, path: str | os.PathLike[str]) -> Path:
        """Write the run's state to ``path`` atomically (temporary file, fsync, rename,
        completeness marker) and return the path. Blocks until the file is durable.

        Under DDP every rank must call it (the state holds every rank's generators):
        rank 0 writes, and all ranks return once the file is there."""
        state = self.state_dict()
        target = Path(os.fspath(path))
        if self.strategy.is_global_zero:
            target = write_checkpoint(state, path)
        self.strategy.barrier()
        return target

    async def save_checkpoint_async(self, path: str | os.PathLike[str]) -> Path:
        """Copy the run's state to host memory now, write it in a worker thread, and
        return once it is durable; the event loop stays free meanwhile. Under DDP, as
        :meth:`save_checkpoint`: called on every rank, written by rank 0."""
        state = self.state_dict(to_host=True)
        target = Path(os.fspath(path))
        if self.strategy.is_global_zero:
            target = await anyio.to_thread.run_sync(write_checkpoint, state, path)
        self.strategy.barrier()
        return target

    async def validate(
        self, module: Module, data: Any, *, ckpt_path: str | os.PathLike[str] | None = None
    ) -> dict[str, float | int | bool]:
        """One pass of ``validation_step`` over ``data``; returns the last value of each
        record put during it. ``ckpt_path`` loads the module's weights first (see
        :meth:`test`)."""
        return await self._evaluate("validate", self.validate_loop, module, data, ckpt_path)

    async def test(
        self, module: Module, data: Any, *, ckpt_path: str | os.PathLike[str] | None = None
    ) -> dict[str, float | int | bool]:
        """One pass of ``test_step`` over ``data``; returns the last value of each record.

        ``ckpt_path`` loads the module's weights (only those: not the optimizers or the
        loops' state) before the pass: ``"best"`` is the best checkpoint of the
        ``Checkpoint`` plugin that monitors a record (its ``best_model_path``; an error
        without such a plugin or before it saved one), ``"last"`` the newest checkpoint
        (as for ``fit``; an error if none was written), anything else a checkpoint file
        or directory. None (default) uses the module as it is."""
        return await self._evaluate("test", self.test_loop, module, data, ckpt_path)

    async def predict(
        self, module: Module, data: Any, *, ckpt_path: str | os.PathLike[str] | None = None
    ) -> list[Any]:
        """``predict_step`` over ``data``; returns the outputs in order. ``ckpt_path``
        loads the module's weights first (see :meth:`test`)."""
        _check_data(data, "data")
        self._check_module(module, "predict", None)
        async with self._stage("predict", module):
            if ckpt_path is not None:
                await self._load_weights(ckpt_path)
            result: list[Any] = await self.predict_loop.run(data)
        return result

    async def _evaluate(
        self,
        stage: str,
        loop: EvaluationLoop,
        module: Module,
        data: Any,
        ckpt_path: str | os.PathLike[str] | None = None,
    ) -> dict[str, float | int | bool]:
        _check_data(data, "data")
        self._check_module(module, stage, f"{'validation' if stage == 'validate' else 'test'}_step")
        async with self._stage(stage, module):
            if ckpt_path is not None:
                await self._load_weights(ckpt_path)
            await loop.run(data)
        return {name: record.value for name, record in self.stage_latest.items()}

    async def _load_weights(self, ckpt_path: str | os.PathLike[str]) -> None:
        """Load the module's weights (nothing else) from ``ckpt_path``: ``"best"``,
        ``"last"`` or a path. The names are resolved once, on rank 0, and broadcast."""
        path: str | os.PathLike[str] | None = ckpt_path
        if ckpt_path in ("best", "last"):
            found: Path | None = None
            problem: str | None = None
            if self.strategy.is_global_zero:
                try:
                    if ckpt_path == "best":
                        found = resolve_best(self.plugins)
                    else:
                        found = resolve_last(self.plugins, warn=False)
                        if found is None:
                            problem = (
                                "ckpt_path='last' but no checkpoint has been written yet, so "
                                "there are no weights to load; fit first, or pass the path "
                                "of a checkpoint."
                            )
                except MisconfigurationError as exc:
                    problem = str(exc)
            # Every rank raises the same error, or loads the same file.
            found, problem = self.strategy.broadcast_object((found, problem))
            if problem is not None:
                raise MisconfigurationError(problem)
            path = found
        assert path is not None
        state = await anyio.to_thread.run_sync(load_checkpoint, path)
        module = self.module
        assert module is not None
        weights: dict[str, Any] = {k: state[k] for k in ("loopbus", "module") if k in state}
        load_state({"module": ModulePart(module)}, weights, strict=True, source=str(path))

    def _check_module(self, module: Any, stage: str, method: str | None) -> None:
        if not isinstance(module, Module):
            extra = ""
            if isinstance(module, torch.nn.Module):
                extra = (
                    f" {type(module).__name__} is a plain torch.nn.Module: subclass "
                    "loopbus.Module instead and add training_step and configure_optimizers."
                )
            raise MisconfigurationError(
                f"{stage} needs a loopbus.Module, got {type(module).__name__}.{extra}"
            )
        if method is not None and getattr(type(module), method) is getattr(Module, method):
            raise MisconfigurationError(
                f"{stage} needs {type(module).__name__}.{method}(self, batch, ctx); define it."
            )

    @asynccontextmanager
    async def _stage(
        self, stage: str, module: Module, *, train_data: Any = None
    ) -> AsyncIterator[None]:
        self.state.begin_stage(stage)  # refuses (changing nothing) if a stage runs
        subscriptions: list[Subscription] = []
        set_up: list[Plugin] = []
        try:
            if stage == "fit":
                self._train_data = train_data
            self._prepare(stage, module)
            self._parts = self._build_parts()
            active = [p for p in self.plugins if self._acts_here(p)]
            for plugin in active:
                bind_recorder(plugin, self.recorder, type(plugin).__name__)
                plugin.setup(self, stage)
                set_up.append(plugin)
                subscriptions += self.bus.subscribe_methods(
                    plugin, owner=type(plugin).__name__, **plugin.subscription_defaults()
                )
            subscriptions += self.bus.subscribe_methods(module, owner=type(module).__name__)
            try:
                async with anyio.create_task_group() as tg:
                    self.bus.start(tg)
                    started: list[Plugin] = []
                    reason, failure = "completed", None
                    try:
                        for plugin in active:
                            await plugin.start(self, stage, tg)
                            started.append(plugin)
                        yield
                        reason = "stopped" if self.should_stop else "completed"
                    except BaseException as exc:
                        reason, failure = self._classify(exc)
                        raise
                    finally:
                        with anyio.CancelScope(shield=True):
                            await self._finish(stage, reason, failure, started)
            except BaseExceptionGroup as group:
                single = _collapse(group)
                if single is None:
                    raise
                raise single from single.__cause__
        finally:
            for sub in subscriptions:
                sub.unsubscribe()
            for plugin in reversed(set_up):
                plugin.teardown(self, stage)
                bind_recorder(plugin, None, "")
            bind_recorder(module, None, "")
            object.__setattr__(module, "_loopbus_trainer", None)
            self._parts = None
            self._step_path = None
            self._resumed_at_step = None
            self.state.end_stage()

    def _classify(self, exc: BaseException) -> tuple[str, BaseException | None]:
        if isinstance(exc, anyio.get_cancelled_exc_class()):
            if self.bus.failure is not None:
                return "failed", self.bus.failure
            return "cancelled", None
        return "failed", exc

    async def _finish(
        self, stage: str, reason: str, failure: BaseException | None, started: list[Plugin]
    ) -> None:
        """Fire the closing events, drain the queues, stop plugins and loops."""
        errors: list[BaseException] = []

        async def attempt(step: Any) -> None:
            try:
                await step()
            except Exception as exc:
                errors.append(exc)

        if failure is not None:
            await attempt(lambda: self.bus.publish(ExceptionRaised(stage=stage, error=failure)))
        if reason in ("completed", "stopped"):
            await attempt(self.recorder.flush)
        else:
            self.recorder.discard_pending()
        await attempt(
            lambda: self.bus.publish(
                Teardown(
                    stage=stage, reason=reason, step=self.global_step, epoch=self.current_epoch
                )
            )
        )
        if reason in ("completed", "stopped"):
            # What Teardown's handlers put or published (without awaiting it).
            await attempt(self.recorder.flush)
        else:
            self.recorder.discard_pending()
        timeout = None if reason in ("completed", "stopped") else self.drain_timeout
        await self.bus.drain(timeout)
        late = self.bus.failure
        if failure is None and late is not None:
            # A queued handler failed while its queue drained: tell the inline handlers.
            await attempt(lambda: self.bus.publish(ExceptionRaised(stage=stage, error=late)))
        for plugin in reversed(started):
            await attempt(functools.partial(plugin.stop, self, stage))
        for loop in self.loops.values():
            loop.teardown_tree()
        if errors:
            if failure is not None:
                for err in errors:
                    failure.add_note(f"while tearing down, also: {type(err).__name__}: {err}")
            else:
                raise errors[0]

    def _prepare(self, stage: str, module: Module) -> None:
        self.module = module
        object.__setattr__(module, "_loopbus_trainer", self)
        bind_recorder(module, self.recorder, type(module).__name__)
        self.recorder.reset()
        device = self.device
        self.recorder.use_device(device)
        module.to(device)
        self.precision.setup(device)
        forward: Any = None
        if stage == "fit":
            if self.strategy.distributed:
                # The training step's forward goes through DDP; stop requests wait
                # for the ranks to agree.
                forward = self.strategy.wrap(module, self.state)
                self.state.make_stop_collective()
            if self._configured_for is not module:
                opts, scheds = _parse_optimizers(module.configure_optimizers(), module)
                self.optimizers, self.lr_scheduler_configs = opts, scheds
                self._configured_for = module
            self._automatic = bool(module.automatic_optimization)
            if self._automatic and len(self.optimizers) != 1:
                raise MisconfigurationError(
                    f"{type(module).__name__} configures {len(self.optimizers)} optimizers; "
                    "automatic optimization steps exactly one. Set "
                    "`automatic_optimization = False` and step them in training_step."
                )
            self._step_schedulers = any(c.interval == "step" for c in self.lr_scheduler_configs)
            module.train()
        # The step path of this stage, chosen once (the loops take it when they start).
        if self.executor == "thread":
            worker: anyio.CapacityLimiter | None = anyio.CapacityLimiter(1)
            emit: Callable[[Any, Any], Any] = self._emit_from_worker
        else:
            worker, emit = None, self.bus.deliver_sync
        move_to: torch.device | None = None if device.type == "cpu" else device
        prepare: Callable[[Any], Any] | None = None
        device_source: Callable[..., Any] | None = None
        if device.type == "cuda" and self.device_prefetch:
            move_to = None  # the batch source moves them, on the copy stream
            device_source = functools.partial(
                CudaBatchSource, device=device, depth=self.device_prefetch
            )
            if self.prefetch:
                prepare = pin_batch  # pinned on the prefetch worker
        self._step_path = StepPath(
            move_to=move_to,
            worker=worker,
            emit=emit,
            boundary=StepBoundary(self.recorder, self.yield_interval),
            prefetch=self.prefetch,
            forward=forward,
            strategy=self.strategy if self.strategy.distributed else None,
            prepare=prepare,
            device_source=device_source,
        )

    def _emit_from_worker(self, entries: Any, event: Any) -> None:
        """Deliver an in-step event from the worker thread on the event loop's thread."""
        anyio.from_thread.run_sync(self.bus.deliver_sync, entries, event)

    @property
    def step_path(self) -> StepPath:
        """How the running stage runs its steps (chosen when it started)."""
        path = self._step_path
        if path is None:
            raise RuntimeError("the trainer is not running a stage, so it has no step path.")
        return path

    @property
    def automatic_optimization(self) -> bool:
        """Whether the trainer runs backward and optimizer steps (as of the last fit)."""
        return self._automatic

    @property
    def steps_schedulers_per_step(self) -> bool:
        """Whether an LR scheduler is configured with ``interval="step"``."""
        return self._step_schedulers

    def step_lr_schedulers(self, interval: str) -> None:
        """Step the LR schedulers configured with ``interval`` (``"step"`` or
        ``"epoch"``) that are due; the loops call it at those boundaries."""
        if self._resumed_at_step is not None and self._resumed_at_step == self.global_step:
            # Resumed, and no optimizer step in this process yet: torch cannot know that
            # the optimizer stepped before the checkpoint and would warn that the order
            # is wrong. It is not.
            with warnings.catch_warnings():
                warnings.filterwarnings(
                    "ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before"
                )
                self._step_lr_schedulers(interval)
            return
        self._step_lr_schedulers(interval)

    def _step_lr_schedulers(self, interval: str) -> None:
        for config in self.lr_scheduler_configs:
            if config.interval != interval:
                continue
            counter = self.global_step if interval == "step" else self.current_epoch + 1
            if counter % config.frequency:
                continue
            if config.monitor is None:
                config.scheduler.step()
                continue
            value = self.recorder.last_value(config.monitor)
            if value is None:
                raise MisconfigurationError(
                    f"the LR scheduler monitors {config.monitor!r}, but no record of that name "
                    f"was put; put names so far: {sorted(self.recorder.latest_records())}."
                )
            config.scheduler.step(value)
