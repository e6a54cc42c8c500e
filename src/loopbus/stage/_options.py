"""The trainer's options: one frozen, validated value (:class:`TrainerOptions`).

``Trainer(**options)`` hands its keyword arguments to :meth:`TrainerOptions.parse`,
which checks every one (a full sentence naming the option, the bad value and the fix)
and resolves what follows from them (``fast_dev_run``'s limits, the default
``max_epochs``, the device). The trainer reads its options from the result; changing one
later (``trainer.max_epochs = 4``) replaces the value with a validated copy.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Generic, Literal, TypeVar, overload

import torch

from loopbus.distributed._strategy import Strategy
from loopbus.state._scope import LeakCheck, leak_check_from_env

from .._exceptions import MisconfigurationError
from .._validate import check_choice, check_int, check_number

__all__ = [
    "Executor",
    "Option",
    "OptionAttributes",
    "TrainerOptions",
    "compile_optimizer_option",
    "compile_options",
    "resolve_device",
    "unknown_options",
]

Executor = Literal["inline", "thread"]
T = TypeVar("T")

_STRATEGIES = {
    "auto": "DDP under torchrun, else one process",
    "ddp": "DistributedDataParallel, one process per device",
    "fsdp": "FSDP2: the module sharded over the processes",
    "single": "this process only",
}


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device of ``Trainer(device=...)`` ("auto": ``cuda:LOCAL_RANK`` under a
    launcher that sets it, else ``cuda``, else the CPU)."""
    if device is None or device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
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


def _check_clip(value: Any) -> float | None:
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
    ):
        raise MisconfigurationError(
            f"gradient_clip_val must be a positive number or None, got {value!r}."
        )
    return value


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainerOptions:
    """Every option of a :class:`~loopbus.Trainer`, validated and resolved: what
    ``Trainer(**options)`` builds with :meth:`parse` (``trainer.options``). Frozen;
    ``trainer.max_epochs = 4`` replaces it with a validated copy (:meth:`replace`).

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
      ``"single"`` force one; ``"fsdp"`` shards the module over the processes (FSDP2),
      and a strategy object (``loopbus.FSDPStrategy(units=[Block], ...)``) carries its
      options (see ``docs/distributed.md``). Under DDP and FSDP the trainer joins the
      process group unless the script already did (gloo on CPU, NCCL on CUDA).
    * ``process_group_timeout``: seconds a collective may wait for the other ranks
      before it fails (default 1800, torch's default); a rank that dies is normally
      noticed sooner, since torchrun then stops the others.
    * ``stop_check_interval``: under DDP, about how many seconds apart the ranks
      exchange stop requests (default 0.05), in a small asynchronous all-reduce no step
      waits for: a stop asked on any rank stops every rank at the same step boundary,
      one to two intervals later. 0 exchanges at every step boundary (a stop then lands
      one boundary after it was asked, whatever the timing; one all-reduce per step).
      See ``docs/distributed.md``.
    * ``preemption``: what SIGTERM and SIGUSR1 (SLURM's early warning with ``--signal``)
      do while a stage runs. ``"auto"`` (default): handled when an active plugin acts on
      preemption (``Plugin.handles_preemption``, as ``Checkpoint`` does), else left
      alone; ``True``: always handled; ``False``: never (the signals keep whatever
      behaviour the process had). Handled, the signal asks the stage to stop at the next
      step boundary (every rank at the same one); ``PreemptionRequested`` is published
      there (``Checkpoint`` saves a checkpoint that resumes exactly), the stage ends as a
      stopped one (teardown events, queues drained) and raises
      :class:`~loopbus.Preempted`, a ``SystemExit``. A second signal ends the process at
      once. Handlers are installed in the main thread only, for the stage's duration,
      and call the handler the application had. See ``docs/checkpointing.md``.
    * ``preemption_exit_code``: the exit status :class:`~loopbus.Preempted` carries; None
      (default) is the signal's usual one, 128 + its number (143 for SIGTERM).
    * ``preemption_grace``: seconds after the first signal at which the process ends
      regardless, as a second signal would (None, default: no limit of loopbus's own;
      the platform's SIGKILL is the limit).
    * ``compile``: ``False`` (default) runs the steps eagerly; ``True`` or a dict of
      ``torch.compile`` options (``backend``, ``mode``, ``fullgraph``, ``dynamic``,
      ``options``) compiles the training step (the module's ``training_step``, the loss
      included; its backward runs the compiled backward) and the validation, test and
      predict steps, once per stage. ``put`` inside them causes no graph break. A short
      last batch costs one more compilation (dimensions that changed become dynamic),
      not one per epoch. The dict's ``"optimizer"`` key (``"auto"``, the default;
      ``True``; ``False``) says whether the optimizer step is compiled as well: with
      ``"auto"`` wherever it can be (automatic optimization, no grad scaler, no DTensor
      parameters, a tensor learning rate where a scheduler changes it, one of
      ``torch.optim``'s optimizers). CUDA graphs
      (``mode="reduce-overhead"``) are refused for now. See ``docs/performance.md``.
    """

    max_epochs: float = 1000
    max_steps: float = math.inf
    #: Whether max_epochs is the default (neither limit was given).
    defaulted_epochs: bool = False
    val_check_interval: int | None = None
    check_val_every_n_epoch: int = 1
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = None
    limit_test_batches: int | float | None = None
    limit_predict_batches: int | float | None = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: Literal["norm", "value"] = "norm"
    executor: Executor = "inline"
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    leak_check: LeakCheck = None
    yield_interval: float = 0.005
    drain_timeout: float = 10.0
    prefetch: int = 0
    device_prefetch: int = 1
    put_lag: int = 4
    strategy: str | Strategy = "auto"
    process_group_timeout: float = 1800.0
    stop_check_interval: float = 0.05
    num_sanity_val_steps: int = 2
    fast_dev_run: int = 0
    enable_model_summary: bool = True
    preemption: bool | Literal["auto"] = "auto"
    preemption_exit_code: int | None = None
    preemption_grace: float | None = None
    #: ``torch.compile`` options of the steps (None: eager).
    compile: Mapping[str, Any] | None = None
    #: Whether the optimizer step is compiled too (with ``compile``): ``"auto"`` where
    #: it can be, True (raise where it cannot), False.
    compile_optimizer: bool | Literal["auto"] = "auto"

    @classmethod
    def parse(cls, **given: Any) -> TrainerOptions:
        """Validate ``Trainer``'s keyword arguments (those given; the rest take the
        Trainer's defaults) and resolve what follows from them."""
        unknown = set(given) - set(_GIVEN_DEFAULTS)
        if unknown:
            raise unknown_options(dict.fromkeys(unknown), list(_GIVEN_DEFAULTS))
        raw = {**_GIVEN_DEFAULTS, **given}
        return cls(
            **_run_length(raw),
            **_step_options(raw),
            **_runtime_options(raw),
            **_preemption_options(raw),
            compile=compile_options(raw["compile"]),
            compile_optimizer=compile_optimizer_option(raw["compile"]),
        )

    def replace(self, **changes: Any) -> TrainerOptions:
        """These options with ``changes``, validated as :meth:`parse` validates them."""
        for name, value in changes.items():
            if name in ("max_epochs", "max_steps"):
                if value is None or (value == -1 and type(value) is int):
                    value = math.inf
                elif value != math.inf:
                    check_int(name, value, minimum=0)
                changes[name] = value
            elif name.startswith("limit_"):
                _check_limit(name, value)
            elif name in ("accumulate_grad_batches", "check_val_every_n_epoch"):
                check_int(name, value)
            elif name == "gradient_clip_val":
                _check_clip(value)
            elif name == "val_check_interval":
                check_int(name, value, allow_none=True)
            else:
                raise AttributeError(
                    f"Trainer.{name} cannot be changed after the trainer is built; build a "
                    f"new Trainer({name}=...)."
                )
        return dataclasses.replace(self, **changes)


class Option(Generic[T]):
    """A trainer attribute that reads (and, validated, replaces) one of its options."""

    __slots__ = ("name",)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> Option[T]: ...

    @overload
    def __get__(self, obj: object, owner: type) -> T: ...

    def __get__(self, obj: object | None, owner: type) -> T | Option[T]:
        if obj is None:
            return self
        return getattr(obj.options, self.name)  # type: ignore[attr-defined,no-any-return]

    def __set__(self, obj: Any, value: T) -> None:
        obj.set_options(**{self.name: value})


class OptionAttributes:
    """Each option of :attr:`options` as an attribute of its own (``trainer.max_epochs``):
    read from the options, and set (``trainer.max_epochs = 4``) by :meth:`set_options`,
    which validates the change and replaces the frozen options with the new value."""

    options: TrainerOptions

    max_epochs: Option[float] = Option()
    max_steps: Option[float] = Option()
    val_check_interval: Option[int | None] = Option()
    check_val_every_n_epoch: Option[int] = Option()
    limit_train_batches: Option[int | float | None] = Option()
    limit_val_batches: Option[int | float | None] = Option()
    limit_test_batches: Option[int | float | None] = Option()
    limit_predict_batches: Option[int | float | None] = Option()
    accumulate_grad_batches: Option[int] = Option()
    gradient_clip_val: Option[float | None] = Option()
    gradient_clip_algorithm: Option[Literal["norm", "value"]] = Option()
    executor: Option[Executor] = Option()
    device: Option[torch.device] = Option()
    leak_check: Option[LeakCheck] = Option()
    yield_interval: Option[float] = Option()
    drain_timeout: Option[float] = Option()
    prefetch: Option[int] = Option()
    device_prefetch: Option[int] = Option()
    put_lag: Option[int] = Option()
    num_sanity_val_steps: Option[int] = Option()
    fast_dev_run: Option[int] = Option()
    enable_model_summary: Option[bool] = Option()
    preemption: Option[bool | Literal["auto"]] = Option()
    preemption_exit_code: Option[int | None] = Option()
    preemption_grace: Option[float | None] = Option()
    compile: Option[Mapping[str, Any] | None] = Option()

    def set_options(self, **changes: Any) -> None:
        """Change options between stages, each validated as ``Trainer(...)`` validates
        it; only the limits and the step options can change after the trainer is built
        (the others shaped what it built)."""
        self.options = self.options.replace(**changes)


_RENAMED = {
    "callbacks": "loopbus calls these `plugins`: Trainer(plugins=[...])",
    "logger": "loggers are plugins: Trainer(plugins=[CSVLogger(...), ...])",
    "accelerator": "choose the device with `device` ('auto', 'cpu', 'cuda', 'cuda:N')",
    "devices": "choose the device with `device`; several GPUs run under torchrun",
    "gpus": "choose the device with `device` ('cuda' or 'cuda:N')",
    "enable_progress_bar": "the progress bar is a plugin: pass plugins=[] to turn it off",
    "default_root_dir": "give each plugin that writes files its directory",
}


def unknown_options(unknown: dict[str, Any], known: list[str]) -> TypeError:
    """The error for ``Trainer(**unknown)``: Lightning's names for what loopbus calls
    otherwise, with the way to say it here, or the closest known option."""
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


#: What each option is when ``Trainer(...)`` is not given it (as given, before parsing).
_GIVEN_DEFAULTS: dict[str, Any] = {
    "max_epochs": None,
    "max_steps": None,
    "val_check_interval": None,
    "check_val_every_n_epoch": 1,
    "limit_train_batches": None,
    "limit_val_batches": None,
    "limit_test_batches": None,
    "limit_predict_batches": None,
    "accumulate_grad_batches": 1,
    "gradient_clip_val": None,
    "gradient_clip_algorithm": "norm",
    "executor": "inline",
    "device": "auto",
    "leak_check": "env",
    "yield_interval": 0.005,
    "drain_timeout": 10.0,
    "prefetch": 0,
    "device_prefetch": 1,
    "put_lag": 4,
    "strategy": "auto",
    "process_group_timeout": 1800.0,
    "stop_check_interval": 0.05,
    "num_sanity_val_steps": 2,
    "fast_dev_run": False,
    "enable_model_summary": True,
    "preemption": "auto",
    "preemption_exit_code": None,
    "preemption_grace": None,
    "compile": False,
}


def _run_length(raw: dict[str, Any]) -> dict[str, Any]:
    """How long each stage runs: epochs, steps, batch limits, validation schedule,
    sanity check; ``fast_dev_run`` overrides them."""
    fast_dev_run = raw["fast_dev_run"]
    if fast_dev_run is True or fast_dev_run is False:
        fast_dev_run = int(fast_dev_run)
    dev_run = check_int(
        "fast_dev_run",
        fast_dev_run,
        minimum=0,
        hint="True runs 1 batch of each stage, N runs N; False (0) turns it off",
    )
    sanity = check_int(
        "num_sanity_val_steps",
        raw["num_sanity_val_steps"],
        minimum=-1,
        hint="-1 runs the whole validation set, 0 turns the sanity check off",
    )
    if dev_run:
        limits = dict.fromkeys(_LIMITS, dev_run)
        raw = {**raw, **limits, "max_epochs": 1, "max_steps": None}
        raw.update(val_check_interval=None, check_val_every_n_epoch=1)
        sanity = 0
    max_epochs, max_steps = raw["max_epochs"], raw["max_steps"]
    # -1 is Lightning's "no limit" (None here); asked for, it replaces the default.
    unlimited = False
    if max_epochs == -1 and type(max_epochs) is int:
        max_epochs, unlimited = None, True
    if max_steps == -1 and type(max_steps) is int:
        max_steps, unlimited = None, True
    check_int("max_epochs", max_epochs, minimum=0, allow_none=True)
    check_int("max_steps", max_steps, minimum=0, allow_none=True)
    defaulted = max_epochs is None and max_steps is None and not unlimited
    if defaulted:
        max_epochs = 1000
    return {
        "max_epochs": math.inf if max_epochs is None else max_epochs,
        "max_steps": math.inf if max_steps is None else max_steps,
        "defaulted_epochs": defaulted,
        "val_check_interval": check_int(
            "val_check_interval", raw["val_check_interval"], allow_none=True
        ),
        "check_val_every_n_epoch": check_int(
            "check_val_every_n_epoch", raw["check_val_every_n_epoch"]
        ),
        **{name: _check_limit(name, raw[name]) for name in _LIMITS},
        "num_sanity_val_steps": sanity,
        "fast_dev_run": dev_run,
    }


_LIMITS = (
    "limit_train_batches",
    "limit_val_batches",
    "limit_test_batches",
    "limit_predict_batches",
)


def _step_options(raw: dict[str, Any]) -> dict[str, Any]:
    """Accumulation and clipping."""
    algorithm = raw["gradient_clip_algorithm"]
    if algorithm not in ("norm", "value"):
        raise MisconfigurationError(
            f"gradient_clip_algorithm must be 'norm' or 'value', got {algorithm!r}."
        )
    return {
        "accumulate_grad_batches": check_int(
            "accumulate_grad_batches", raw["accumulate_grad_batches"]
        ),
        "gradient_clip_val": _check_clip(raw["gradient_clip_val"]),
        "gradient_clip_algorithm": algorithm,
    }


def _runtime_options(raw: dict[str, Any]) -> dict[str, Any]:
    """Where and how steps run: executor, device, data movement, leak check, yields,
    the strategy and its collectives, the model summary."""
    executor, leak_check = raw["executor"], raw["leak_check"]
    if executor not in ("inline", "thread"):
        raise MisconfigurationError(
            f"executor must be 'inline' (steps on the event loop thread) or 'thread' (steps "
            f"in a worker thread), got {executor!r}."
        )
    if leak_check == "env":
        leak_check = leak_check_from_env()
    if leak_check not in (None, "raise", "warn"):
        raise MisconfigurationError(
            f"leak_check must be None, 'warn' or 'raise', got {leak_check!r}."
        )
    yield_interval = raw["yield_interval"]
    if not isinstance(yield_interval, (int, float)) or yield_interval < 0:
        raise MisconfigurationError(
            f"yield_interval must be a number of seconds >= 0, got {yield_interval!r}."
        )
    if not isinstance(raw["enable_model_summary"], bool):
        raise MisconfigurationError(
            f"enable_model_summary must be True or False, got {raw['enable_model_summary']!r}."
        )
    if not isinstance(raw["strategy"], Strategy):
        check_choice(
            "strategy",
            raw["strategy"],
            _STRATEGIES,
            hint="or a strategy object, such as loopbus.FSDPStrategy(units=[Block])",
        )
    hints = {
        "prefetch": "0 fetches batches inline; N >= 1 fetches up to N ahead in a worker thread",
        "device_prefetch": "0 moves each batch on the compute stream; N >= 1 copies up to N ahead",
        "put_lag": "how many steps' records may wait for their values to reach the host",
    }
    return {
        "executor": executor,
        "device": resolve_device(raw["device"]),
        "leak_check": leak_check,
        "yield_interval": float(yield_interval),
        "drain_timeout": float(raw["drain_timeout"]),
        **{name: check_int(name, raw[name], minimum=0, hint=hint) for name, hint in hints.items()},
        "strategy": raw["strategy"],
        "process_group_timeout": float(
            check_number("process_group_timeout", raw["process_group_timeout"], exclusive_minimum=0)
        ),
        "stop_check_interval": float(
            check_number(
                "stop_check_interval",
                raw["stop_check_interval"],
                minimum=0,
                hint="seconds between the ranks' stop checks under DDP (0: every step)",
            )
        ),
        "enable_model_summary": raw["enable_model_summary"],
    }


def _preemption_options(raw: dict[str, Any]) -> dict[str, Any]:
    """What the preemption signals do (see ``docs/checkpointing.md``)."""
    mode = raw["preemption"]
    if not (mode == "auto" or isinstance(mode, bool)):
        raise MisconfigurationError(
            f"preemption must be 'auto' (handle SIGTERM/SIGUSR1 when a plugin such as "
            f"Checkpoint acts on preemption), True (always) or False (never), got {mode!r}."
        )
    code = raw["preemption_exit_code"]
    if code is not None and (
        isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= 255
    ):
        raise MisconfigurationError(
            f"preemption_exit_code must be an exit status in 0..255 or None (128 + the "
            f"signal's number, 143 for SIGTERM), got {code!r}."
        )
    grace = check_number(
        "preemption_grace",
        raw["preemption_grace"],
        exclusive_minimum=0,
        allow_none=True,
        hint="seconds after the first signal at which the process ends; None: no limit",
    )
    return {
        "preemption": mode,
        "preemption_exit_code": code,
        "preemption_grace": None if grace is None else float(grace),
    }


#: The ``torch.compile`` options ``Trainer(compile={...})`` passes on.
_COMPILE_KEYS = ("backend", "mode", "fullgraph", "dynamic", "options")
#: The keys of ``Trainer(compile={...})`` that are loopbus's own.
_OWN_COMPILE_KEYS = ("optimizer",)
_COMPILE_MODES = (None, "default", "max-autotune", "max-autotune-no-cudagraphs")
_NO_CUDA_GRAPHS = (
    "CUDA graphs are not supported by loopbus yet (the design, with the static input "
    "buffers the device prefetch must fill, is in docs/performance.md); use compile=True "
    "or mode='max-autotune-no-cudagraphs'"
)


def compile_options(value: Any) -> Mapping[str, Any] | None:
    """``Trainer(compile=...)`` checked: None when off, else the ``torch.compile``
    keyword arguments (read-only)."""
    if value is False or value is None:
        return None
    if value is True:
        return MappingProxyType({})
    if isinstance(value, str):
        raise MisconfigurationError(
            f"compile={value!r} is not supported: {_NO_CUDA_GRAPHS}."
            if value in ("cudagraphs", "reduce-overhead")
            else f"compile must be True, False or a dict of torch.compile options "
            f"(keys {list(_COMPILE_KEYS)}), got {value!r}; for a backend or mode write "
            f"compile={{'backend': ...}} or compile={{'mode': ...}}."
        )
    if not isinstance(value, Mapping):
        raise MisconfigurationError(
            f"compile must be True, False or a dict of torch.compile options (keys "
            f"{list(_COMPILE_KEYS)}), got {type(value).__name__}: {value!r}."
        )
    unknown = sorted(str(k) for k in value if k not in _COMPILE_KEYS + _OWN_COMPILE_KEYS)
    if unknown:
        raise MisconfigurationError(
            f"compile={{...}} got unknown torch.compile option(s) {unknown}; the options it "
            f"passes on are {list(_COMPILE_KEYS)}, and 'optimizer' says whether the "
            "optimizer step is compiled too."
        )
    compile_optimizer_option(value)
    mode = value.get("mode")
    if mode == "reduce-overhead" or value.get("backend") == "cudagraphs":
        raise MisconfigurationError(f"compile={dict(value)!r}: {_NO_CUDA_GRAPHS}.")
    if mode not in _COMPILE_MODES:
        raise MisconfigurationError(
            f"compile={{'mode': {mode!r}}} is not a torch.compile mode loopbus runs; use one "
            f"of {[m for m in _COMPILE_MODES if m]} or leave it out."
        )
    if not isinstance(value.get("fullgraph", False), bool):
        raise MisconfigurationError(
            f"compile={{'fullgraph': ...}} must be True or False, got {value['fullgraph']!r}."
        )
    if not isinstance(value.get("options", {}), Mapping):
        raise MisconfigurationError(
            f"compile={{'options': ...}} must be a dict of backend options, got "
            f"{value['options']!r}."
        )
    if value.get("dynamic") not in (None, True, False):
        raise MisconfigurationError(
            f"compile={{'dynamic': ...}} must be None (automatic), True or False, got "
            f"{value['dynamic']!r}."
        )
    backend = value.get("backend", "inductor")
    if not (isinstance(backend, str) or callable(backend)):
        raise MisconfigurationError(
            f"compile={{'backend': ...}} must be a backend name (such as 'inductor' or "
            f"'aot_eager') or a callable backend, got {backend!r}."
        )
    return MappingProxyType({k: v for k, v in value.items() if k in _COMPILE_KEYS})


def compile_optimizer_option(value: Any) -> bool | Literal["auto"]:
    """The ``"optimizer"`` key of ``Trainer(compile={...})`` checked (``"auto"`` when
    absent, or when ``compile`` is not a dict)."""
    if not isinstance(value, Mapping):
        return "auto"
    choice = value.get("optimizer", "auto")
    if choice is True or choice is False or choice == "auto":
        return choice  # type: ignore[no-any-return]
    raise MisconfigurationError(
        f"compile={{'optimizer': ...}} must be 'auto' (compile the optimizer step where it "
        f"can be), True (compile it, or say why not) or False (keep it eager), got {choice!r}."
    )
