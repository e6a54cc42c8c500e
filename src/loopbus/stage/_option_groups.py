"""The groups of the trainer's options: one frozen, typed value per concern, each built
from ``Trainer(...)``'s flat keywords by a parser that checks every option it holds (a
full sentence naming the option, the bad value and the fix).

:class:`~loopbus.TrainerOptions` holds one of each: ``lengths``, ``validation``,
``step``, ``distribution``, ``signals``, ``responsiveness``, ``diagnostics``. Each
option keeps its flat name inside its group (``options.lengths.max_epochs``), so the
flat name (``options.max_epochs``, ``trainer.max_epochs``) reads the same value.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

import torch

from loopbus.distributed._strategy import Strategy
from loopbus.state._scope import LeakCheck, leak_check_from_env

from .._exceptions import MisconfigurationError
from .._validate import check_choice, check_int, check_number

__all__ = [
    "GROUPS",
    "Diagnostics",
    "Distribution",
    "Executor",
    "PreemptionSignals",
    "Responsiveness",
    "RunLengths",
    "StepSettings",
    "ValidationSchedule",
    "check_clip",
    "check_limit",
    "compile_optimizer_option",
    "compile_options",
    "parse_groups",
    "resolve_device",
]

Executor = Literal["inline", "thread"]

@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunLengths:
    """How long each stage runs.

    * ``max_epochs`` / ``max_steps``: stop after this many epochs / optimizer steps
      (when neither is given: 1000 epochs, with a notice logged on rank 0, and
      ``defaulted_epochs`` is True; ``-1`` means no limit, as in Lightning; no limit
      reads as ``math.inf``).
    * ``limit_{train,val,test,predict}_batches``: batches per pass: an int (a number of
      batches) or a float in [0, 1] (a fraction of the loader's length); None: all.
    * ``fast_dev_run``: ``True`` (1) or N runs N batches of each stage (train,
      validation, test, predict) and one epoch, with no sanity check, and leaves out the
      plugins that write files (``Plugin.writes_files``: checkpoints, loggers), so
      nothing is written; a notice says so. For a quick check that a script runs end
      to end.
    """

    max_epochs: float = 1000
    max_steps: float = math.inf
    #: Whether max_epochs is the default (neither limit was given).
    defaulted_epochs: bool = False
    limit_train_batches: int | float | None = None
    limit_val_batches: int | float | None = None
    limit_test_batches: int | float | None = None
    limit_predict_batches: int | float | None = None
    fast_dev_run: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ValidationSchedule:
    """When ``fit`` validates.

    * ``val_check_interval``: validate every N training batches (a number of batches);
      None (default) validates once at the end of every ``check_val_every_n_epoch``-th
      epoch (a number of epochs, default 1).
    * ``num_sanity_val_steps``: validation batches run before ``fit``'s first training
      step, so a broken ``validation_step`` fails in seconds (default 2; ``-1`` runs the
      whole validation set, 0 turns it off). Its records are dropped (no logger, plugin
      or ``trainer.latest`` sees them), it leaves the random generators as it found
      them, and a ``fit`` resumed from a checkpoint taken mid-epoch skips it.
    """

    val_check_interval: int | None = None
    check_val_every_n_epoch: int = 1
    num_sanity_val_steps: int = 2


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepSettings:
    """How each step runs.

    * ``accumulate_grad_batches``: batches whose gradients add up before one optimizer
      step; ``gradient_clip_val`` (None: no clipping) and ``gradient_clip_algorithm``
      (``"norm"``: the total norm, or ``"value"``: each element).
    * ``executor``: ``"inline"`` runs steps on the event loop thread (lowest overhead);
      ``"thread"`` runs them in a worker thread so the host application stays responsive.
    * ``compile``: None (``Trainer(compile=False)``, the default) runs the steps
      eagerly; ``True`` or a dict of ``torch.compile`` options (``backend``, ``mode``,
      ``fullgraph``, ``dynamic``, ``options``) compiles the training step (the module's
      ``training_step``, the loss included; its backward runs the compiled backward) and
      the validation, test and predict steps, once per stage; held here as the
      ``torch.compile`` keyword arguments (read-only). ``put`` inside them causes no
      graph break. A short last batch costs one more compilation (dimensions that
      changed become dynamic), not one per epoch. CUDA graphs (``mode="reduce-overhead"``)
      are refused for now. The dict's ``"target"`` key compiles only a part instead:
      ``"forward"`` (the module's call) or a submodule's (dotted) name, the steps then
      eager. torchmetrics metrics always run eagerly. See ``docs/performance.md``.
    * ``compile_optimizer``: the dict's ``"optimizer"`` key (``"auto"``, the default;
      ``True``; ``False``): whether the optimizer step is compiled as well; with
      ``"auto"`` wherever it can be (automatic optimization, no grad scaler, no DTensor
      parameters, a tensor learning rate where a scheduler changes it, one of
      ``torch.optim``'s optimizers).

    The precision (``Trainer(precision=...)``) is the trainer's ``precision`` object.
    """

    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: Literal["norm", "value"] = "norm"
    executor: Executor = "inline"
    #: ``torch.compile`` options of the steps (None: eager).
    compile: Mapping[str, Any] | None = None
    #: Whether the optimizer step is compiled too (with ``compile``): ``"auto"`` where
    #: it can be, True (raise where it cannot), False.
    compile_optimizer: bool | Literal["auto"] = "auto"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Distribution:
    """Where the run runs, and over how many processes.

    * ``device``: ``"auto"`` (CUDA if available: ``cuda:LOCAL_RANK`` when the launcher
      sets ``LOCAL_RANK``, as torchrun does), ``"cpu"``, ``"cuda"``, ``"cuda:N"``;
      held resolved, as a ``torch.device``.
    * ``strategy``: ``"auto"`` (default) runs DDP when launched by ``torchrun`` with
      more than one process (``WORLD_SIZE > 1``), else in this process; ``"ddp"`` or
      ``"single"`` force one; ``"fsdp"`` shards the module over the processes (FSDP2),
      and a strategy object (``loopbus.FSDPStrategy(units=[Block], ...)``) carries its
      options (see ``docs/distributed.md``). Under DDP and FSDP the trainer joins the
      process group unless the script already did (gloo on CPU, NCCL on CUDA).
    * ``process_group_timeout_s``: seconds a collective may wait for the other ranks
      before it fails (default 1800, torch's default); a rank that dies is normally
      noticed sooner, since torchrun then stops the others.
    * ``stop_check_interval_s``: under DDP, about how many seconds apart the ranks
      exchange stop requests (default 0.05), in a small asynchronous all-reduce no step
      waits for: a stop asked on any rank stops every rank at the same step boundary,
      one to two intervals later. 0 exchanges at every step boundary (a stop then lands
      one boundary after it was asked, whatever the timing; one all-reduce per step).
      See ``docs/distributed.md``.
    """

    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    strategy: str | Strategy = "auto"
    process_group_timeout_s: float = 1800.0
    stop_check_interval_s: float = 0.05


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PreemptionSignals:
    """What the preemption signals do (see ``docs/checkpointing.md``).

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
      and call the handler the application had.
    * ``preemption_exit_code``: the exit status :class:`~loopbus.Preempted` carries; None
      (default) is the signal's usual one, 128 + its number (143 for SIGTERM).
    * ``preemption_grace_s``: seconds after the first signal at which the process ends
      regardless, as a second signal would (None, default: no limit of loopbus's own;
      the platform's SIGKILL is the limit).
    """

    preemption: bool | Literal["auto"] = "auto"
    preemption_exit_code: int | None = None
    preemption_grace_s: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Responsiveness:
    """How the run shares the event loop and overlaps the host's work with the steps.

    * ``yield_interval_s``: the longest time (seconds) inline steps run before yielding
      to other tasks (0: after every step).
    * ``drain_timeout_s``: how long (seconds) a cancelled or failed stage waits for
      queued subscribers to finish (a normal end always waits for all of them).
    * ``prefetch``: 0 (default) fetches each batch when the loop needs it; N >= 1 has a
      worker thread fetch up to N batches ahead while the steps run, which overlaps
      loading that releases the GIL (file I/O, decoding in C, torch ops) with compute.
      Random draws in the loading code then share torch's global generator with the
      step from another thread: give the dataset its own ``torch.Generator`` to keep
      runs reproducible. Checkpoints save the position of the last batch trained on.
    * ``device_prefetch``: on a CUDA device, how many batches are copied to the device
      ahead of the step, on a side stream, while the step computes (default 1; 0 moves
      each batch in its own iteration on the compute stream). Unpinned batches are
      pinned first (by the prefetch worker when ``prefetch`` is on).
    * ``put_lag``: on a CUDA device, tensors put during a step are copied to the host
      without the host waiting, and their records are delivered once the copy is done
      (checked at every step boundary) or, at the latest, when more than ``put_lag``
      steps' records wait (a number of steps, default 4; 0: at once, a host sync per
      step). Every other boundary (epoch, validation, stage end) delivers everything
      first. See ``docs/performance.md``.
    """

    yield_interval_s: float = 0.005
    drain_timeout_s: float = 10.0
    prefetch: int = 0
    device_prefetch: int = 1
    put_lag: int = 4


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Diagnostics:
    """What the run checks and shows about itself.

    * ``leak_check``: ``"raise"``/``"warn"`` verify that scopes free what they held;
      ``Trainer``'s default (``"env"``) reads the ``LOOPBUS_LEAK_CHECK`` environment
      variable (off if unset).
    * ``enable_model_summary``: whether the ``ModelSummary`` plugin (one of the default
      plugins) prints its table of the module's layers when ``fit`` starts (default
      True).
    """

    leak_check: LeakCheck = None
    enable_model_summary: bool = True


#: Each group of :class:`~loopbus.TrainerOptions`, by its field name there.
GROUPS: dict[str, type] = {
    "lengths": RunLengths,
    "validation": ValidationSchedule,
    "step": StepSettings,
    "distribution": Distribution,
    "signals": PreemptionSignals,
    "responsiveness": Responsiveness,
    "diagnostics": Diagnostics,
}


def parse_groups(raw: dict[str, Any]) -> dict[str, Any]:
    """Every group, from ``Trainer(...)``'s keywords (``raw``: each one, the defaults
    filled in), checked and resolved."""
    lengths, validation = _run_length(raw)
    return {
        "lengths": lengths,
        "validation": validation,
        "step": _step_settings(raw),
        "distribution": _distribution(raw),
        "signals": _preemption_signals(raw),
        "responsiveness": _responsiveness(raw),
        "diagnostics": _diagnostics(raw),
    }


_STRATEGIES = {
    "auto": "DDP under torchrun, else one process",
    "ddp": "DistributedDataParallel, one process per device",
    "fsdp": "FSDP2: the module sharded over the processes",
    "single": "this process only",
}

_LIMITS = (
    "limit_train_batches",
    "limit_val_batches",
    "limit_test_batches",
    "limit_predict_batches",
)


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


def check_limit(name: str, value: Any) -> Any:
    """A ``limit_*_batches`` option checked: None, an int >= 0 or a float in [0, 1]."""
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


def check_clip(value: Any) -> float | None:
    """``gradient_clip_val`` checked: a positive number or None."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
    ):
        raise MisconfigurationError(
            f"gradient_clip_val must be a positive number or None, got {value!r}."
        )
    return value


def _run_length(raw: dict[str, Any]) -> tuple[RunLengths, ValidationSchedule]:
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
    lengths = RunLengths(
        max_epochs=math.inf if max_epochs is None else max_epochs,
        max_steps=math.inf if max_steps is None else max_steps,
        defaulted_epochs=defaulted,
        **{name: check_limit(name, raw[name]) for name in _LIMITS},
        fast_dev_run=dev_run,
    )
    validation = ValidationSchedule(
        val_check_interval=check_int(
            "val_check_interval", raw["val_check_interval"], allow_none=True
        ),
        check_val_every_n_epoch=check_int(
            "check_val_every_n_epoch", raw["check_val_every_n_epoch"]
        ),
        num_sanity_val_steps=sanity,
    )
    return lengths, validation


def _step_settings(raw: dict[str, Any]) -> StepSettings:
    """Accumulation, clipping, the executor and compilation."""
    algorithm, executor = raw["gradient_clip_algorithm"], raw["executor"]
    if algorithm not in ("norm", "value"):
        raise MisconfigurationError(
            f"gradient_clip_algorithm must be 'norm' or 'value', got {algorithm!r}."
        )
    if executor not in ("inline", "thread"):
        raise MisconfigurationError(
            f"executor must be 'inline' (steps on the event loop thread) or 'thread' (steps "
            f"in a worker thread), got {executor!r}."
        )
    return StepSettings(
        accumulate_grad_batches=check_int(
            "accumulate_grad_batches", raw["accumulate_grad_batches"]
        ),
        gradient_clip_val=check_clip(raw["gradient_clip_val"]),
        gradient_clip_algorithm=algorithm,
        executor=executor,
        compile=compile_options(raw["compile"]),
        compile_optimizer=compile_optimizer_option(raw["compile"]),
    )


def _distribution(raw: dict[str, Any]) -> Distribution:
    """The device, the strategy and its collectives."""
    if not isinstance(raw["strategy"], Strategy):
        check_choice(
            "strategy",
            raw["strategy"],
            _STRATEGIES,
            hint="or a strategy object, such as loopbus.FSDPStrategy(units=[Block])",
        )
    return Distribution(
        device=resolve_device(raw["device"]),
        strategy=raw["strategy"],
        process_group_timeout_s=float(
            check_number(
                "process_group_timeout_s",
                raw["process_group_timeout_s"],
                exclusive_minimum=0,
            )
        ),
        stop_check_interval_s=float(
            check_number(
                "stop_check_interval_s",
                raw["stop_check_interval_s"],
                minimum=0,
                hint="seconds between the ranks' stop checks under DDP (0: every step)",
            )
        ),
    )


def _responsiveness(raw: dict[str, Any]) -> Responsiveness:
    """Yields, drains, and the work done ahead of (or behind) the steps."""
    yield_interval = raw["yield_interval_s"]
    if not isinstance(yield_interval, (int, float)) or yield_interval < 0:
        raise MisconfigurationError(
            f"yield_interval_s must be a number of seconds >= 0, got {yield_interval!r}."
        )
    hints = {
        "prefetch": "0 fetches batches inline; N >= 1 fetches up to N ahead in a worker thread",
        "device_prefetch": "0 moves each batch on the compute stream; N >= 1 copies up to N ahead",
        "put_lag": "how many steps' records may wait for their values to reach the host",
    }
    return Responsiveness(
        yield_interval_s=float(yield_interval),
        drain_timeout_s=float(raw["drain_timeout_s"]),
        **{name: check_int(name, raw[name], minimum=0, hint=hint) for name, hint in hints.items()},
    )


def _diagnostics(raw: dict[str, Any]) -> Diagnostics:
    """The leak check and the model summary."""
    leak_check = raw["leak_check"]
    if leak_check == "env":
        leak_check = leak_check_from_env()
    if leak_check not in (None, "raise", "warn"):
        raise MisconfigurationError(
            f"leak_check must be None, 'warn' or 'raise', got {leak_check!r}."
        )
    if not isinstance(raw["enable_model_summary"], bool):
        raise MisconfigurationError(
            f"enable_model_summary must be True or False, got {raw['enable_model_summary']!r}."
        )
    return Diagnostics(leak_check=leak_check, enable_model_summary=raw["enable_model_summary"])


def _preemption_signals(raw: dict[str, Any]) -> PreemptionSignals:
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
        "preemption_grace_s",
        raw["preemption_grace_s"],
        exclusive_minimum=0,
        allow_none=True,
        hint="seconds after the first signal at which the process ends; None: no limit",
    )
    return PreemptionSignals(
        preemption=mode,
        preemption_exit_code=code,
        preemption_grace_s=None if grace is None else float(grace),
    )


#: The ``torch.compile`` options ``Trainer(compile={...})`` passes on.
_COMPILE_KEYS = ("backend", "mode", "fullgraph", "dynamic", "options")
#: The keys of ``Trainer(compile={...})`` that are loopbus's own.
_OWN_COMPILE_KEYS = ("optimizer", "target")
_COMPILE_MODES = (None, "default", "max-autotune", "max-autotune-no-cudagraphs")
_NO_CUDA_GRAPHS = (
    "CUDA graphs are not supported by loopbus yet (the design, with the static input "
    "buffers the device prefetch must fill, is in docs/performance.md); use compile=True "
    "or mode='max-autotune-no-cudagraphs'"
)


def compile_options(value: Any) -> Mapping[str, Any] | None:
    """``Trainer(compile=...)`` checked: None when off, else the ``torch.compile``
    keyword arguments (read-only), with ``"target"`` (a tuple of names) when only a
    part of the module is compiled."""
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
            f"passes on are {list(_COMPILE_KEYS)}, 'optimizer' says whether the "
            "optimizer step is compiled too and 'target' what is compiled."
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
    options = {k: v for k, v in value.items() if k in _COMPILE_KEYS}
    target = _compile_target(value.get("target", "steps"))
    return MappingProxyType({**options, "target": target} if target else options)


def _compile_target(value: Any) -> tuple[str, ...]:
    """The ``"target"`` key of ``Trainer(compile={...})`` checked: the names of the
    modules compiled (``"forward"``: the module's call; dotted names: its submodules),
    empty for ``"steps"`` (the steps compiled whole, the default). Whether the module
    has such submodules is checked when a stage starts."""
    names = (value,) if isinstance(value, str) else value
    if (
        not isinstance(names, (list, tuple))
        or not names
        or not all(isinstance(n, str) and n and not n.startswith(".") for n in names)
    ):
        raise MisconfigurationError(
            f"compile={{'target': ...}} must be 'steps' (the default: the training and "
            f"evaluation steps compiled whole), 'forward' (only the module's call), a "
            f"submodule's name ('encoder', dotted paths such as 'encoder.layers') or a list "
            f"of such names, got {value!r}."
        )
    if "steps" in names:
        if len(names) > 1:
            raise MisconfigurationError(
                f"compile={{'target': {value!r}}}: 'steps' compiles the steps whole and "
                "cannot be combined with other targets."
            )
        return ()
    return tuple(names)


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
