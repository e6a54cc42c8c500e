"""The trainer's options: one frozen, validated value (:class:`TrainerOptions`) made of
frozen, typed groups (``_option_groups``), each option also readable by its flat name.

``Trainer(**options)`` hands its keyword arguments to :meth:`TrainerOptions.parse`,
which checks every one (a full sentence naming the option, the bad value and the fix)
and resolves what follows from them (``fast_dev_run``'s limits, the default
``max_epochs``, the device). The trainer reads its options from the result; changing one
later (``trainer.max_epochs = 4``) replaces the value with a validated copy. The old
names of renamed options (``yield_interval``, now ``yield_interval_s``) still work, as
deprecated aliases (``loopbus._renamed``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Mapping
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, overload

import torch

from loopbus.distributed._strategy import Strategy
from loopbus.state._scope import LeakCheck

from .._renamed import RENAMED, renamed_keywords, warn_once
from .._validate import check_int
from ._option_groups import (
    GROUPS,
    Diagnostics,
    Distribution,
    Executor,
    PreemptionSignals,
    Responsiveness,
    RunLengths,
    StepSettings,
    ValidationSchedule,
    check_clip,
    check_limit,
    compile_optimizer_option,
    compile_options,
    parse_groups,
    resolve_device,
)

__all__ = [
    "Executor",
    "Option",
    "OptionAttributes",
    "RenamedOption",
    "TrainerOptions",
    "compile_optimizer_option",
    "compile_options",
    "resolve_device",
    "unknown_options",
]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TrainerOptions:
    """Every option of a :class:`~loopbus.Trainer`, validated and resolved: what
    ``Trainer(**options)`` builds with :meth:`parse` (``trainer.options``). Frozen;
    ``trainer.max_epochs = 4`` replaces it with a validated copy (:meth:`replace`).

    The options are held in frozen, typed groups, whose docstrings say what each option
    does: ``lengths`` (:class:`RunLengths`: epochs, steps, batch limits, ``fast_dev_run``),
    ``validation`` (:class:`ValidationSchedule`: ``val_check_interval``,
    ``check_val_every_n_epoch``, ``num_sanity_val_steps``), ``step``
    (:class:`StepSettings`: accumulation, clipping, the executor, ``compile``),
    ``distribution`` (:class:`Distribution`: the device, the strategy,
    ``process_group_timeout_s``, ``stop_check_interval_s``), ``signals``
    (:class:`PreemptionSignals`: ``preemption``, ``preemption_exit_code``,
    ``preemption_grace_s``), ``responsiveness`` (:class:`Responsiveness`:
    ``yield_interval_s``, ``drain_timeout_s``, ``prefetch``, ``device_prefetch``,
    ``put_lag``) and ``diagnostics`` (:class:`Diagnostics`: ``leak_check``,
    ``enable_model_summary``). Each option is also readable by its flat name
    (``options.max_epochs`` is ``options.lengths.max_epochs``), at no extra Python call.

    Times in seconds end in ``_s``. Their old names (``yield_interval``,
    ``drain_timeout``, ``process_group_timeout``, ``stop_check_interval``,
    ``preemption_grace``) are deprecated aliases: given to :meth:`parse` or read here,
    they warn once and stand for the new option.
    """

    lengths: RunLengths = dataclasses.field(default_factory=RunLengths)
    validation: ValidationSchedule = dataclasses.field(default_factory=ValidationSchedule)
    step: StepSettings = dataclasses.field(default_factory=StepSettings)
    distribution: Distribution = dataclasses.field(default_factory=Distribution)
    signals: PreemptionSignals = dataclasses.field(default_factory=PreemptionSignals)
    responsiveness: Responsiveness = dataclasses.field(default_factory=Responsiveness)
    diagnostics: Diagnostics = dataclasses.field(default_factory=Diagnostics)

    if TYPE_CHECKING:  # The flat names, made below from the groups' fields.

        @property
        def max_epochs(self) -> float: ...
        @property
        def max_steps(self) -> float: ...
        @property
        def defaulted_epochs(self) -> bool: ...
        @property
        def limit_train_batches(self) -> int | float | None: ...
        @property
        def limit_val_batches(self) -> int | float | None: ...
        @property
        def limit_test_batches(self) -> int | float | None: ...
        @property
        def limit_predict_batches(self) -> int | float | None: ...
        @property
        def fast_dev_run(self) -> int: ...
        @property
        def val_check_interval(self) -> int | None: ...
        @property
        def check_val_every_n_epoch(self) -> int: ...
        @property
        def num_sanity_val_steps(self) -> int: ...
        @property
        def accumulate_grad_batches(self) -> int: ...
        @property
        def gradient_clip_val(self) -> float | None: ...
        @property
        def gradient_clip_algorithm(self) -> Literal["norm", "value"]: ...
        @property
        def executor(self) -> Executor: ...
        @property
        def compile(self) -> Mapping[str, Any] | None: ...
        @property
        def compile_optimizer(self) -> bool | Literal["auto"]: ...
        @property
        def device(self) -> torch.device: ...
        @property
        def strategy(self) -> str | Strategy: ...
        @property
        def process_group_timeout_s(self) -> float: ...
        @property
        def stop_check_interval_s(self) -> float: ...
        @property
        def preemption(self) -> bool | Literal["auto"]: ...
        @property
        def preemption_exit_code(self) -> int | None: ...
        @property
        def preemption_grace_s(self) -> float | None: ...
        @property
        def yield_interval_s(self) -> float: ...
        @property
        def drain_timeout_s(self) -> float: ...
        @property
        def prefetch(self) -> int: ...
        @property
        def device_prefetch(self) -> int: ...
        @property
        def put_lag(self) -> int: ...
        @property
        def leak_check(self) -> LeakCheck: ...
        @property
        def enable_model_summary(self) -> bool: ...

    @classmethod
    def parse(cls, **given: Any) -> TrainerOptions:
        """Validate ``Trainer``'s keyword arguments (those given; the rest take the
        Trainer's defaults) and resolve what follows from them. An old name of a renamed
        option warns (once) and stands for the new one; given with it, it raises."""
        old = {name: given.pop(name) for name in list(given) if name in RENAMED}
        if old:
            given.update(renamed_keywords("Trainer", old, takes=_GIVEN_DEFAULTS, given=given))
        unknown = set(given) - set(_GIVEN_DEFAULTS)
        if unknown:
            raise unknown_options(dict.fromkeys(unknown), list(_GIVEN_DEFAULTS))
        return cls(**parse_groups({**_GIVEN_DEFAULTS, **given}))

    def replace(self, **changes: Any) -> TrainerOptions:
        """These options with ``changes`` (by flat name), validated as :meth:`parse`
        validates them."""
        for name, value in changes.items():
            if name in ("max_epochs", "max_steps"):
                if value is None or (value == -1 and type(value) is int):
                    value = math.inf
                elif value != math.inf:
                    check_int(name, value, minimum=0)
                changes[name] = value
            elif name.startswith("limit_"):
                check_limit(name, value)
            elif name in ("accumulate_grad_batches", "check_val_every_n_epoch"):
                check_int(name, value)
            elif name == "gradient_clip_val":
                check_clip(value)
            elif name == "val_check_interval":
                check_int(name, value, allow_none=True)
            else:
                raise AttributeError(
                    f"Trainer.{name} cannot be changed after the trainer is built; build a "
                    f"new Trainer({name}=...)."
                )
        grouped: dict[str, dict[str, Any]] = {}
        for name, value in changes.items():
            grouped.setdefault(_GROUP_OF[name], {})[name] = value
        return dataclasses.replace(
            self,
            **{
                group: dataclasses.replace(getattr(self, group), **values)
                for group, values in grouped.items()
            },
        )


#: Each option's group in :class:`TrainerOptions`, by the option's (flat) name.
_GROUP_OF: dict[str, str] = {
    field.name: group for group, kind in GROUPS.items() for field in dataclasses.fields(kind)
}


def _renamed_field(old: str, new: str) -> property:
    """``options.<old>``: the value of ``options.<new>``, with a deprecation warning."""
    read_new = attrgetter(f"{_GROUP_OF[new]}.{new}")

    def read(options: TrainerOptions) -> Any:
        warn_once(
            f"TrainerOptions.{old}",
            f"TrainerOptions.{old} is deprecated: read {new} (the same value, in seconds).",
        )
        return read_new(options)

    return property(read, doc=f"Deprecated: the old name of ``{new}``.")


def _add_flat_names() -> None:
    """Each option's flat name on :class:`TrainerOptions`, read through a C getter (no
    Python call per read), and each old name of a renamed option."""
    for name, group in _GROUP_OF.items():
        setattr(TrainerOptions, name, property(attrgetter(f"{group}.{name}")))
    for old, new in RENAMED.items():
        setattr(TrainerOptions, old, _renamed_field(old, new))


_add_flat_names()


def _frozen(options: TrainerOptions, name: str, *value: Any) -> None:
    raise dataclasses.FrozenInstanceError(
        f"cannot assign to field {name!r}: TrainerOptions is frozen; use replace()"
    )


# Assigning a flat name raises as assigning a field does (the generated __setattr__ of a
# slotted dataclass fails with a TypeError for a name that is not a field).
TrainerOptions.__setattr__ = _frozen  # type: ignore[assignment,method-assign]
TrainerOptions.__delattr__ = _frozen  # type: ignore[assignment,method-assign]


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


class RenamedOption:
    """A trainer attribute's old name: reads (and sets) the attribute of the new name,
    with a deprecation warning, once per process."""

    __slots__ = ("name", "new")

    def __init__(self, new: str) -> None:
        self.new = new

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type) -> RenamedOption: ...

    @overload
    def __get__(self, obj: object, owner: type) -> Any: ...

    def __get__(self, obj: object | None, owner: type) -> Any:
        if obj is None:
            return self
        self._warn()
        return getattr(obj, self.new)

    def __set__(self, obj: object, value: Any) -> None:
        self._warn()
        setattr(obj, self.new, value)

    def _warn(self) -> None:
        warn_once(
            f"Trainer.{self.name}",
            f"Trainer.{self.name} is deprecated: it is now trainer.{self.new} (the same "
            "value, in seconds).",
        )


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
    yield_interval_s: Option[float] = Option()
    drain_timeout_s: Option[float] = Option()
    prefetch: Option[int] = Option()
    device_prefetch: Option[int] = Option()
    put_lag: Option[int] = Option()
    num_sanity_val_steps: Option[int] = Option()
    fast_dev_run: Option[int] = Option()
    enable_model_summary: Option[bool] = Option()
    preemption: Option[bool | Literal["auto"]] = Option()
    preemption_exit_code: Option[int | None] = Option()
    preemption_grace_s: Option[float | None] = Option()
    compile: Option[Mapping[str, Any] | None] = Option()

    # The old names of renamed options (deprecated).
    yield_interval = RenamedOption("yield_interval_s")
    drain_timeout = RenamedOption("drain_timeout_s")
    preemption_grace = RenamedOption("preemption_grace_s")

    def set_options(self, **changes: Any) -> None:
        """Change options between stages, each validated as ``Trainer(...)`` validates
        it; only the limits and the step options can change after the trainer is built
        (the others shaped what it built)."""
        self.options = self.options.replace(**changes)


#: Lightning's names for what loopbus calls otherwise.
_LIGHTNING_NAMES = {
    "callbacks": "loopbus calls these `plugins`: Trainer(plugins=[...])",
    "logger": "loggers are plugins: Trainer(plugins=[CSVLogger(...), ...])",
    "accelerator": "choose the device with `device` ('auto', 'cpu', 'cuda', 'cuda:N')",
    "devices": "choose the device with `device`; several GPUs run under torchrun",
    "gpus": "choose the device with `device` ('cuda' or 'cuda:N')",
    "enable_progress_bar": "the progress bar is a plugin: pass plugins=[] to turn it off",
    "default_root_dir": "give each plugin that writes files its directory",
    "profiler": (
        "the profiler is a plugin: Trainer(plugins=[Profiler(...)]) with "
        "`from loopbus.plugins import Profiler` (docs/tuning.md)"
    ),
}


def unknown_options(unknown: dict[str, Any], known: list[str]) -> TypeError:
    """The error for ``Trainer(**unknown)``: Lightning's names for what loopbus calls
    otherwise, with the way to say it here, or the closest known option."""
    lines = []
    for name in unknown:
        if name in _LIGHTNING_NAMES:
            lines.append(f"{name!r}: {_LIGHTNING_NAMES[name]}")
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
    "yield_interval_s": 0.005,
    "drain_timeout_s": 10.0,
    "prefetch": 0,
    "device_prefetch": 1,
    "put_lag": 4,
    "strategy": "auto",
    "process_group_timeout_s": 1800.0,
    "stop_check_interval_s": 0.05,
    "num_sanity_val_steps": 2,
    "fast_dev_run": False,
    "enable_model_summary": True,
    "preemption": "auto",
    "preemption_exit_code": None,
    "preemption_grace_s": None,
    "compile": False,
}
