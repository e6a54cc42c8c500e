"""The groups of the trainer's options: one frozen, typed value per concern, each field
an option declared once (:func:`~loopbus.stage._declarations.option`: the type
``Trainer(...)`` accepts, its default, unit, check, docstring, whether it may change
later, its old name), or a value derived from options
(:func:`~loopbus.stage._declarations.derived`).

:class:`~loopbus.TrainerOptions` holds one of each: ``lengths``, ``validation``,
``step``, ``distribution``, ``signals``, ``responsiveness``, ``diagnostics``. Each
option keeps its flat name inside its group (``options.lengths.max_epochs``), so the
flat name (``options.max_epochs``, ``trainer.max_epochs``) reads the same value.

:func:`build_groups` is the one path from checked values to groups, for ``Trainer(...)``
and for every later change alike: it resolves what follows from several options
(``fast_dev_run``'s limits, the default ``max_epochs``, ``compile_optimizer``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

import torch

from loopbus.distributed._strategy import Strategy, StrategyName
from loopbus.state._run_folder import check_root_dir, check_run_name, check_run_version
from loopbus.state._scope import LeakCheck

from ._declarations import (
    OptionDeclaration,
    check_clip,
    check_compile,
    check_dev_run,
    check_device,
    check_exit_code,
    check_flag,
    check_leak_check,
    check_length,
    check_limit,
    check_preemption,
    check_strategy,
    choice,
    compile_optimizer_option,
    declared,
    derived,
    integer,
    option,
    seconds,
)

__all__ = [
    "DECLARATIONS",
    "DERIVED",
    "GROUPS",
    "Diagnostics",
    "Distribution",
    "Executor",
    "PreemptionSignals",
    "Responsiveness",
    "RunFolderSettings",
    "RunLengths",
    "StepSettings",
    "ValidationSchedule",
    "build_groups",
]

Executor = Literal["inline", "thread"]

_SETS_LIMITS = "it set the stages' limits and the notice when the trainer was built"
_STRATEGY_BUILT = "the trainer's strategy was built from it"
_PREEMPTION_BUILT = "the trainer's preemption handling was built with it"
_FOLDER_CHOSEN = "the trainer's run folder was chosen from it when it was built"


def _limit(stage: str) -> Any:
    return option(
        None,
        accepts=int | float | None,
        check=check_limit,
        unit="batches",
        doc=f"batches per {stage} pass: an int (a number of batches) or a float in [0, 1] "
        "(a fraction of the loader's length); None: all.",
        examples=(0, 3, 0.5, 1.0),
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunLengths:
    """How long each stage runs."""

    max_epochs: float = option(
        None,
        accepts=int | None,
        check=check_length,
        unit="epochs",
        doc="stop after this many epochs. When neither it nor ``max_steps`` is given: "
        "1000, with a notice logged on rank 0 (``defaulted_epochs``); given ``max_steps`` "
        "alone, no epoch limit, whether given to ``Trainer(...)`` or set later. ``-1`` "
        "(Lightning's word) or ``math.inf``: no limit; no limit reads as ``math.inf``.",
        examples=(0, 1, 3, -1, math.inf),
    )
    max_steps: float = option(
        None,
        accepts=int | None,
        check=check_length,
        unit="optimizer steps",
        doc="stop after this many optimizer steps (None: no step limit; ``-1`` or "
        "``math.inf``: no limit; no limit reads as ``math.inf``).",
        examples=(0, 5, 100, -1, math.inf),
    )
    defaulted_epochs: bool = derived(
        doc="whether ``max_epochs`` is the default 1000 (neither limit was given).",
        follows="max_epochs and max_steps",
    )
    limit_train_batches: int | float | None = _limit("training")
    limit_val_batches: int | float | None = _limit("validation")
    limit_test_batches: int | float | None = _limit("test")
    limit_predict_batches: int | float | None = _limit("predict")
    fast_dev_run: int = option(
        False,
        accepts=bool | int,
        check=check_dev_run,
        unit="batches",
        fixed_because=_SETS_LIMITS,
        doc="``True`` (1) or N runs N batches of each stage (train, validation, test, "
        "predict) and one epoch, with no sanity check, and leaves out the plugins that "
        "write files (``Plugin.writes_files``: checkpoints, loggers), so nothing is "
        "written; a notice says so. It overrides the limits, the epochs and steps and "
        "the validation schedule. For a quick check that a script runs end to end.",
        examples=(True, 1, 2),
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ValidationSchedule:
    """When ``fit`` validates."""

    val_check_interval: int | None = option(
        None,
        accepts=int | None,
        check=integer(allow_none=True),
        unit="training batches",
        doc="validate every N training batches as well as at the end of the epoch; None "
        "validates at the end of every ``check_val_every_n_epoch``-th epoch only.",
        examples=(1, 50),
    )
    check_val_every_n_epoch: int = option(
        1,
        accepts=int,
        check=integer(),
        unit="epochs",
        doc="validate at the end of every N-th epoch.",
        examples=(2, 5),
    )
    num_sanity_val_steps: int = option(
        2,
        accepts=int,
        check=integer(
            minimum=-1, hint="-1 runs the whole validation set, 0 turns the sanity check off"
        ),
        unit="batches",
        doc="validation batches run before ``fit``'s first training step, so a broken "
        "``validation_step`` fails in seconds (``-1``: the whole validation set, 0: off). "
        "Its records are dropped (no logger, plugin or ``trainer.latest`` sees them), it "
        "leaves the random generators as it found them, and a ``fit`` resumed from a "
        "checkpoint taken mid-epoch skips it.",
        examples=(-1, 0, 5),
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class StepSettings:
    """How each step runs. The precision (``Trainer(precision=...)``) is the trainer's
    ``precision`` object."""

    accumulate_grad_batches: int = option(
        1,
        accepts=int,
        check=integer(),
        unit="batches",
        doc="batches whose gradients add up before one optimizer step.",
        examples=(2, 8),
    )
    gradient_clip_val: float | None = option(
        None,
        accepts=float | None,
        check=check_clip,
        doc="clip gradients to this total norm (or value, per ``gradient_clip_algorithm``); "
        "None: no clipping.",
        examples=(0.5, 1, 10.0),
    )
    gradient_clip_algorithm: Literal["norm", "value"] = option(
        "norm",
        accepts=Literal["norm", "value"],
        check=choice(("norm", "value")),
        doc='``"norm"``: clip the total norm; ``"value"``: each element.',
        examples=("value",),
    )
    executor: Executor = option(  # noqa: RUF009 (a field specifier)
        "inline",
        accepts=Executor,
        check=choice(
            {
                "inline": "steps on the event loop thread",
                "thread": "steps in a worker thread",
            }
        ),
        doc='``"inline"`` runs steps on the event loop thread (lowest overhead); '
        '``"thread"`` runs them in a worker thread so the host application stays '
        "responsive.",
        examples=("thread",),
    )
    compile: Mapping[str, Any] | None = option(
        False,
        accepts=bool | Mapping[str, Any],
        check=check_compile,
        fixed_because="a trainer's steps are compiled, or not, for its whole life, so "
        "that its stages run the same code",
        doc="``False`` (held as None) runs the steps eagerly; ``True`` or a dict of "
        "``torch.compile`` options (``backend``, ``mode``, ``fullgraph``, ``dynamic``, "
        "``options``) compiles the training step (the module's ``training_step``, the "
        "loss included; its backward runs the compiled backward) and the validation, "
        "test and predict steps, once per stage; held here as the ``torch.compile`` "
        "keyword arguments (read-only). ``put`` inside them causes no graph break. A "
        "short last batch costs one more compilation (dimensions that changed become "
        'dynamic), not one per epoch. CUDA graphs (``mode="reduce-overhead"``) are '
        'refused for now. The dict\'s ``"target"`` key compiles only a part instead: '
        "``\"forward\"`` (the module's call) or a submodule's (dotted) name, the steps "
        'then eager; its ``"optimizer"`` key is ``compile_optimizer``. torchmetrics '
        "metrics always run eagerly. See ``docs/performance.md``.",
        examples=(True, {"backend": "eager"}, {"backend": "eager", "optimizer": False}),
    )
    compile_optimizer: bool | Literal["auto"] = derived(
        doc='the ``compile`` dict\'s ``"optimizer"`` key (``"auto"``, the default; '
        "``True``; ``False``): whether the optimizer step is compiled as well; with "
        '``"auto"`` wherever it can be (automatic optimization, no grad scaler, no '
        "DTensor parameters, a tensor learning rate where a scheduler changes it, one of "
        "``torch.optim``'s optimizers).",
        follows="compile",
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Distribution:
    """Where the run runs, and over how many processes."""

    device: torch.device = option(  # noqa: RUF009 (a field specifier)
        "auto",
        accepts=str | torch.device | None,
        check=check_device,
        fixed_because=_STRATEGY_BUILT + " and set up on it",
        doc='``"auto"`` (CUDA if available: ``cuda:LOCAL_RANK`` when the launcher sets '
        '``LOCAL_RANK``, as torchrun does), ``"cpu"``, ``"cuda"``, ``"cuda:N"``; '
        "held resolved, as a ``torch.device``.",
        examples=("cpu", torch.device("cpu")),
    )
    strategy: str | Strategy = option(  # noqa: RUF009 (a field specifier)
        "auto",
        accepts=StrategyName | Strategy,
        check=check_strategy,
        fixed_because=_STRATEGY_BUILT,
        doc='``"auto"`` runs DDP when launched by ``torchrun`` with more than one '
        'process (``WORLD_SIZE > 1``), else in this process; ``"ddp"`` or '
        '``"single"`` force one; ``"fsdp"`` shards the module over the processes '
        "(FSDP2), and a strategy object (``loopbus.FSDPStrategy(units=[Block], ...)``) "
        "carries its options (see ``docs/distributed.md``). Under DDP and FSDP the "
        "trainer joins the process group unless the script already did (gloo on CPU, "
        "NCCL on CUDA). Held as given; ``trainer.strategy`` is the strategy object.",
        examples=("single",),
    )
    process_group_timeout_s: float = option(
        1800.0,
        accepts=float,
        check=seconds(exclusive_minimum=0),
        unit="seconds",
        renamed_from="process_group_timeout",
        fixed_because=_STRATEGY_BUILT,
        doc="how long a collective may wait for the other ranks before it fails "
        "(torch's default); a rank that dies is normally noticed sooner, since torchrun "
        "then stops the others.",
        examples=(60, 0.5),
    )
    stop_check_interval_s: float = option(
        0.05,
        accepts=float,
        check=seconds(
            minimum=0, hint="seconds between the ranks' stop checks under DDP (0: every step)"
        ),
        unit="seconds",
        renamed_from="stop_check_interval",
        fixed_because=_STRATEGY_BUILT,
        doc="under DDP, about how far apart the ranks exchange stop requests, in a small "
        "asynchronous all-reduce no step waits for: a stop asked on any rank stops every "
        "rank at the same step boundary, one to two intervals later. 0 exchanges at "
        "every step boundary (a stop then lands one boundary after it was asked, "
        "whatever the timing; one all-reduce per step). See ``docs/distributed.md``.",
        examples=(0, 1),
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PreemptionSignals:
    """What the preemption signals do (see ``docs/checkpointing.md``)."""

    preemption: bool | Literal["auto"] = option(
        "auto",
        accepts=bool | Literal["auto"],
        check=check_preemption,
        fixed_because=_PREEMPTION_BUILT,
        doc="what SIGTERM and SIGUSR1 (SLURM's early warning with ``--signal``) do while "
        'a stage runs. ``"auto"``: handled when an active plugin acts on preemption '
        "(``Plugin.handles_preemption``, as ``Checkpoint`` does), else left alone; "
        "``True``: always handled; ``False``: never (the signals keep whatever "
        "behaviour the process had). Handled, the signal asks the stage to stop at the "
        "next step boundary (every rank at the same one); ``PreemptionRequested`` is "
        "published there (``Checkpoint`` saves a checkpoint that resumes exactly), the "
        "stage ends as a stopped one (teardown events, queues drained) and raises "
        ":class:`~loopbus.Preempted`, a ``SystemExit``. A second signal ends the process "
        "at once. Handlers are installed in the main thread only, for the stage's "
        "duration, and call the handler the application had.",
        examples=(True, False),
    )
    preemption_exit_code: int | None = option(
        None,
        accepts=int | None,
        check=check_exit_code,
        fixed_because=_PREEMPTION_BUILT,
        doc="the exit status :class:`~loopbus.Preempted` carries; None is the signal's "
        "usual one, 128 + its number (143 for SIGTERM).",
        examples=(0, 143, 255),
    )
    preemption_grace_s: float | None = option(
        None,
        accepts=float | None,
        check=seconds(
            exclusive_minimum=0,
            allow_none=True,
            hint="seconds after the first signal at which the process ends; None: no limit",
        ),
        unit="seconds",
        renamed_from="preemption_grace",
        fixed_because=_PREEMPTION_BUILT,
        doc="how long after the first signal the process ends regardless, as a second "
        "signal would (None: no limit of loopbus's own; the platform's SIGKILL is the "
        "limit).",
        examples=(30, 0.5),
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Responsiveness:
    """How the run shares the event loop and overlaps the host's work with the steps."""

    yield_interval_s: float = option(
        0.005,
        accepts=float,
        check=seconds(minimum=0),
        unit="seconds",
        renamed_from="yield_interval",
        doc="the longest time inline steps run before yielding to other tasks (0: after "
        "every step).",
        examples=(0, 0.1),
    )
    drain_timeout_s: float = option(
        10.0,
        accepts=float,
        check=seconds(minimum=0),
        unit="seconds",
        renamed_from="drain_timeout",
        doc="how long a cancelled or failed stage waits for queued subscribers to finish "
        "(a normal end always waits for all of them).",
        examples=(0, 2.5),
    )
    prefetch: int = option(
        0,
        accepts=int,
        check=integer(
            minimum=0,
            hint="0 fetches batches inline; N >= 1 fetches up to N ahead in a worker thread",
        ),
        unit="batches",
        doc="0 fetches each batch when the loop needs it; N >= 1 has a worker thread fetch "
        "up to N batches ahead while the steps run, which overlaps loading that releases "
        "the GIL (file I/O, decoding in C, torch ops) with compute. Random draws in the "
        "loading code then share torch's global generator with the step from another "
        "thread: give the dataset its own ``torch.Generator`` to keep runs reproducible. "
        "Checkpoints save the position of the last batch trained on.",
        examples=(1, 4),
    )
    device_prefetch: int = option(
        1,
        accepts=int,
        check=integer(
            minimum=0,
            hint="0 moves each batch on the compute stream; N >= 1 copies up to N ahead",
        ),
        unit="batches",
        doc="on a CUDA device, how many batches are copied to the device ahead of the "
        "step, on a side stream, while the step computes (0 moves each batch in its own "
        "iteration on the compute stream). Unpinned batches are pinned first (by the "
        "prefetch worker when ``prefetch`` is on).",
        examples=(0, 2),
    )
    put_lag: int = option(
        4,
        accepts=int,
        check=integer(
            minimum=0,
            hint="how many steps' records may wait for their values to reach the host",
        ),
        unit="steps",
        fixed_because="the trainer's recorder was built with it",
        doc="on a CUDA device, tensors put during a step are copied to the host without "
        "the host waiting, and their records are delivered once the copy is done "
        "(checked at every step boundary) or, at the latest, when more than ``put_lag`` "
        "steps' records wait (0: at once, a host sync per step). Every other boundary "
        "(epoch, validation, stage end) delivers everything first. See "
        "``docs/performance.md``.",
        examples=(0, 8),
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Diagnostics:
    """What the run checks and shows about itself."""

    leak_check: LeakCheck = option(  # noqa: RUF009 (a field specifier)
        "env",
        accepts=LeakCheck | Literal["env"],
        check=check_leak_check,
        fixed_because="the trainer's loops were attached with it",
        doc='``"raise"``/``"warn"`` verify that scopes free what they held; '
        '``"env"`` reads the ``LOOPBUS_LEAK_CHECK`` environment variable (off if '
        "unset); None: off. Held resolved.",
        examples=(None, "warn", "raise"),
    )
    enable_model_summary: bool = option(
        True,
        accepts=bool,
        check=check_flag,
        doc="whether the ``ModelSummary`` plugin (one of the default plugins) prints its "
        "table of the module's layers when ``fit`` starts.",
        examples=(False,),
    )


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class RunFolderSettings:
    """Where the run's files go: its folder ``root_dir/name/version_N`` (see
    ``docs/plugins.md``, "Run folders")."""

    root_dir: str | None = option(
        None,
        accepts=str | os.PathLike[str] | None,
        check=check_root_dir,
        fixed_because=_FOLDER_CHOSEN,
        doc="the folder the runs are written under (Lightning's ``default_root_dir``): "
        "the run gets ``root_dir/name/version_N`` (``trainer.run_dir``), created by rank 0 "
        "when the trainer is built, holding ``config.yaml`` (the run's configuration), "
        "``run.json`` (versions, git commit, host, start time, world size, the step a "
        "resume continued from), ``checkpoints/`` (a ``Checkpoint()`` given no "
        "``dirpath``) and the output of the file loggers given no ``save_dir``. None (the "
        "default): no run folder, nothing written that a plugin was not asked to write. "
        "A local path; ``fast_dev_run`` writes none.",
        examples=("runs",),
    )
    name: str = option(
        "loopbus_logs",
        accepts=str,
        check=check_run_name,
        fixed_because=_FOLDER_CHOSEN,
        doc="the experiment's folder inside ``root_dir`` (the file loggers' default name).",
        examples=("exp",),
    )
    version: int | str | None = option(
        None,
        accepts=int | str | None,
        check=check_run_version,
        fixed_because=_FOLDER_CHOSEN,
        doc="the run's folder inside ``name``: None takes the next free ``version_N`` "
        "(one more than the highest); N is ``version_N``, continued if it exists (as a "
        '``fit(ckpt_path="last")`` resuming it does); a string is the folder\'s name.',
        examples=(0, 3, "baseline"),
    )


#: Each group of :class:`~loopbus.TrainerOptions`, by its field name there.
GROUPS: dict[str, type] = {
    "lengths": RunLengths,
    "validation": ValidationSchedule,
    "step": StepSettings,
    "distribution": Distribution,
    "signals": PreemptionSignals,
    "responsiveness": Responsiveness,
    "diagnostics": Diagnostics,
    "run": RunFolderSettings,
}


def _collect() -> tuple[dict[str, OptionDeclaration], dict[str, str]]:
    options: dict[str, OptionDeclaration] = {}
    follows: dict[str, str] = {}
    for group, kind in GROUPS.items():
        declarations, derived_fields = declared(group, kind)
        options.update((d.name, d) for d in declarations)
        follows.update(derived_fields)
    return options, follows


#: Every option's declaration, by name, in the groups' order; and each derived value's
#: name, with the options it follows from.
DECLARATIONS, DERIVED = _collect()

_LIMITS = (
    "limit_train_batches",
    "limit_val_batches",
    "limit_test_batches",
    "limit_predict_batches",
)


def build_groups(checked: Mapping[str, Any]) -> dict[str, Any]:
    """Every group, from each option's checked value (``checked``: every option, by
    name), with what follows from several options resolved:

    * ``fast_dev_run`` N > 0 sets each ``limit_*_batches`` to N, one epoch, no step
      limit, validation at each epoch's end and no sanity check;
    * neither ``max_epochs`` nor ``max_steps`` given (None): 1000 epochs and
      ``defaulted_epochs``; one of them None otherwise: no limit (``math.inf``);
    * ``compile``'s ``"optimizer"`` key becomes ``compile_optimizer``.
    """
    held = dict(checked)
    dev_run = held["fast_dev_run"]
    if dev_run:
        held.update(dict.fromkeys(_LIMITS, dev_run), max_epochs=1, max_steps=None)
        held.update(val_check_interval=None, check_val_every_n_epoch=1, num_sanity_val_steps=0)
    max_epochs, max_steps = held["max_epochs"], held["max_steps"]
    held["defaulted_epochs"] = defaulted = max_epochs is None and max_steps is None
    held["max_epochs"] = 1000 if defaulted else math.inf if max_epochs is None else max_epochs
    held["max_steps"] = math.inf if max_steps is None else max_steps
    compiled = held["compile"]
    held["compile_optimizer"] = compile_optimizer_option(compiled)
    if compiled is not None and "optimizer" in compiled:
        held["compile"] = MappingProxyType({k: v for k, v in compiled.items() if k != "optimizer"})
    return {
        group: kind(**{field.name: held[field.name] for field in dataclasses.fields(kind)})
        for group, kind in GROUPS.items()
    }
