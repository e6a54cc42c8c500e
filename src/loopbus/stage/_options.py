"""The trainer's options: one frozen, validated value (:class:`TrainerOptions`) made of
frozen, typed groups (``_option_groups``), each option declared once there and also
readable by its flat name.

``Trainer(**options)`` hands its keyword arguments to :meth:`TrainerOptions.parse`, and
a later change (``trainer.max_epochs = 4``, :meth:`TrainerOptions.replace`) takes the
same path: each value is checked by its declaration's check, then what follows from
several options is resolved (``fast_dev_run``'s limits, the default ``max_epochs``,
``compile_optimizer``) from every option's value as given, so a change ends where
``Trainer(...)`` with that value would. The old names of renamed options
(``yield_interval``, now ``yield_interval_s``) still work, as deprecated aliases.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from operator import attrgetter
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Generic, Literal, TypeVar, overload

import torch

from loopbus.distributed._strategy import Strategy
from loopbus.state._scope import LeakCheck

from .._renamed import renamed_keywords, warn_once
from ._declarations import (
    OptionDeclaration,
    compile_optimizer_option,
    compile_options,
    resolve_device,
)
from ._option_groups import (
    DECLARATIONS,
    DERIVED,
    GROUPS,
    Diagnostics,
    Distribution,
    Executor,
    PreemptionSignals,
    Responsiveness,
    RunFolderSettings,
    RunLengths,
    StepSettings,
    ValidationSchedule,
    build_groups,
)

__all__ = [
    "OLD_NAMES",
    "Executor",
    "Option",
    "OptionAttributes",
    "OptionDeclaration",
    "RenamedOption",
    "TrainerOptions",
    "compile_optimizer_option",
    "compile_options",
    "resolve_device",
    "unknown_options",
]

T = TypeVar("T")

#: The old name of each renamed option -> its name (from the declarations).
OLD_NAMES: Mapping[str, str] = MappingProxyType(
    {d.renamed_from: d.name for d in DECLARATIONS.values() if d.renamed_from}
)


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
    ``put_lag``), ``diagnostics`` (:class:`Diagnostics`: ``leak_check``,
    ``enable_model_summary``) and ``run`` (:class:`RunFolderSettings`: ``root_dir``,
    ``name``, ``version``). Each option is also readable by its flat name
    (``options.max_epochs`` is ``options.lengths.max_epochs``), at no extra Python call.
    :meth:`declarations` lists the options with their types, defaults and docs.

    ``given`` holds each option as given (its default where none was), checked:
    ``Trainer(**options.given, plugins=..., precision=...)`` builds a trainer with the
    same options, and ``Trainer(**options.replace(max_steps=10).given, ...)`` one that
    differs in one. It is not compared: two options are equal when they hold the same
    values.

    Times in seconds end in ``_s``. Their old names (``yield_interval``,
    ``drain_timeout``, ``process_group_timeout``, ``stop_check_interval``,
    ``preemption_grace``) are deprecated aliases: given to :meth:`parse` or read here,
    they warn once and stand for the new option.
    """

    lengths: RunLengths
    validation: ValidationSchedule
    step: StepSettings
    distribution: Distribution
    signals: PreemptionSignals
    responsiveness: Responsiveness
    diagnostics: Diagnostics
    run: RunFolderSettings
    # Each option as given (its default where none was), checked: read as ``given``.
    _given: tuple[tuple[str, Any], ...] = dataclasses.field(compare=False, repr=False)

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
        @property
        def root_dir(self) -> str | None: ...
        @property
        def name(self) -> str: ...
        @property
        def version(self) -> int | str | None: ...

    @property
    def given(self) -> Mapping[str, Any]:
        """Each option as given (its default where none was), checked (read-only)."""
        return MappingProxyType(dict(self._given))

    @classmethod
    def declarations(cls) -> tuple[OptionDeclaration, ...]:
        """Every option, as declared in its group (name, group, type, default, unit,
        doc, whether it may change after the trainer is built, old name), in the
        groups' order."""
        return tuple(DECLARATIONS.values())

    @classmethod
    def parse(cls, **given: Any) -> TrainerOptions:
        """Validate ``Trainer``'s keyword arguments (those given; the rest take the
        Trainer's defaults) and resolve what follows from them. An old name of a renamed
        option warns (once) and stands for the new one; given with it, it raises."""
        given = _new_names("Trainer", given)
        checked = {
            name: declaration.check(given[name] if name in given else declaration.default)
            for name, declaration in DECLARATIONS.items()
        }
        return cls(**build_groups(checked), _given=tuple(checked.items()))

    def replace(self, **changes: Any) -> TrainerOptions:
        """These options with ``changes`` (by flat name): each checked as :meth:`parse`
        checks it, and what follows from it resolved again from the options as given,
        so the result is what ``parse`` makes of :attr:`given` with the changes."""
        changes = _new_names("TrainerOptions.replace", changes)
        checked = dict(self._given)
        checked.update((name, DECLARATIONS[name].check(v)) for name, v in changes.items())
        groups = build_groups(checked)
        for name, group in groups.items():  # an unchanged group stays the same object
            if group == getattr(self, name):
                groups[name] = getattr(self, name)
        return TrainerOptions(**groups, _given=tuple(checked.items()))


def _new_names(owner: str, given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with the old names of renamed options replaced by the new ones (each
    warns once; one given with its new name raises); an unknown name raises."""
    old = {name: given.pop(name) for name in list(given) if name in OLD_NAMES}
    if old:
        given.update(
            renamed_keywords(owner, old, takes=DECLARATIONS, given=given, renames=OLD_NAMES)
        )
    unknown = [name for name in given if name not in DECLARATIONS]
    if unknown:
        raise unknown_options(dict.fromkeys(unknown), list(DECLARATIONS), owner=owner)
    return given


#: Each option's group in :class:`TrainerOptions`, by the option's (flat) name.
_GROUP_OF: dict[str, str] = {
    field.name: group for group, kind in GROUPS.items() for field in dataclasses.fields(kind)
}


def _renamed_field(old: str, new: str) -> property:
    """``options.<old>``: the value of ``options.<new>``, with a deprecation warning."""
    read_new = attrgetter(f"{_GROUP_OF[new]}.{new}")
    unit = DECLARATIONS[new].unit

    def read(options: TrainerOptions) -> Any:
        warn_once(
            f"TrainerOptions.{old}",
            f"TrainerOptions.{old} is deprecated: read {new} (the same value, in {unit}).",
        )
        return read_new(options)

    return property(read, doc=f"Deprecated: the old name of ``{new}``.")


def _add_flat_names() -> None:
    """Each option's flat name on :class:`TrainerOptions`, read through a C getter (no
    Python call per read), and each old name of a renamed option."""
    for name, group in _GROUP_OF.items():
        setattr(TrainerOptions, name, property(attrgetter(f"{group}.{name}")))
    for old, new in OLD_NAMES.items():
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

    def __init__(self, name: str = "") -> None:
        self.name = name

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

    def __init__(self, new: str, name: str = "") -> None:
        self.new = new
        self.name = name

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
            f"value, in {DECLARATIONS[self.new].unit}).",
        )


#: The options read on the options only: ``trainer.strategy`` is the strategy object the
#: option was resolved to (``trainer.options.strategy`` is the option as given).
NOT_ATTRIBUTES = frozenset({"strategy"})


class OptionAttributes:
    """Each option of :attr:`options` as an attribute of its own (``trainer.max_epochs``),
    and each value that follows from options (``trainer.defaulted_epochs``): read from
    the options, and set (``trainer.max_epochs = 4``) by :meth:`set_options`, which
    validates the change and replaces the frozen options with the new value. The
    attributes are made from the declarations (below the class); ``strategy`` is the
    exception: ``trainer.strategy`` is the strategy object the option resolved to."""

    options: TrainerOptions

    if TYPE_CHECKING:  # The attributes, made below from the declarations.
        max_epochs: Option[float] = Option()
        max_steps: Option[float] = Option()
        defaulted_epochs: Option[bool] = Option()
        limit_train_batches: Option[int | float | None] = Option()
        limit_val_batches: Option[int | float | None] = Option()
        limit_test_batches: Option[int | float | None] = Option()
        limit_predict_batches: Option[int | float | None] = Option()
        fast_dev_run: Option[int] = Option()
        val_check_interval: Option[int | None] = Option()
        check_val_every_n_epoch: Option[int] = Option()
        num_sanity_val_steps: Option[int] = Option()
        accumulate_grad_batches: Option[int] = Option()
        gradient_clip_val: Option[float | None] = Option()
        gradient_clip_algorithm: Option[Literal["norm", "value"]] = Option()
        executor: Option[Executor] = Option()
        compile: Option[Mapping[str, Any] | None] = Option()
        compile_optimizer: Option[bool | Literal["auto"]] = Option()
        device: Option[torch.device] = Option()
        process_group_timeout_s: Option[float] = Option()
        stop_check_interval_s: Option[float] = Option()
        preemption: Option[bool | Literal["auto"]] = Option()
        preemption_exit_code: Option[int | None] = Option()
        preemption_grace_s: Option[float | None] = Option()
        yield_interval_s: Option[float] = Option()
        drain_timeout_s: Option[float] = Option()
        prefetch: Option[int] = Option()
        device_prefetch: Option[int] = Option()
        put_lag: Option[int] = Option()
        leak_check: Option[LeakCheck] = Option()
        enable_model_summary: Option[bool] = Option()
        root_dir: Option[str | None] = Option()
        name: Option[str] = Option()
        version: Option[int | str | None] = Option()
        # The old names of renamed options (deprecated).
        yield_interval = RenamedOption("yield_interval_s")
        drain_timeout = RenamedOption("drain_timeout_s")
        process_group_timeout = RenamedOption("process_group_timeout_s")
        stop_check_interval = RenamedOption("stop_check_interval_s")
        preemption_grace = RenamedOption("preemption_grace_s")

    def set_options(self, **changes: Any) -> None:
        """Change options between stages, each validated as ``Trainer(...)`` validates
        it, with what follows from it resolved as ``Trainer(...)`` resolves it (setting
        ``max_steps`` on a trainer built without ``max_epochs`` leaves no epoch limit,
        as ``Trainer(max_steps=...)`` does). Only the options declared mutable can
        change (``TrainerOptions.declarations()``); the others shaped what the trainer
        built, and setting one raises an ``AttributeError`` that says why. A change
        takes effect at the next stage."""
        for name in changes:
            refused = _refusal(OLD_NAMES.get(name, name))
            if refused:
                raise AttributeError(refused)
        self.options = self.options.replace(**changes)


def _refusal(name: str) -> str | None:
    """Why ``trainer.<name>`` cannot be set, or None if it can."""
    if name in DERIVED:
        return (
            f"Trainer.{name} cannot be set: it is no option but follows from "
            f"{DERIVED[name]}; set those instead."
        )
    declaration = DECLARATIONS.get(name)
    if declaration is None or declaration.mutable:
        return None
    return (
        f"Trainer.{name} cannot be changed after the trainer is built: "
        f"{declaration.fixed_because}. Build a new trainer for another value: "
        f"Trainer({name}=...), or Trainer(**trainer.options.replace({name}=...).given, "
        "plugins=..., precision=...) to keep the other options."
    )


def _add_attributes() -> None:
    """Each option and derived value as a trainer attribute, and each old name."""
    for name in _GROUP_OF:
        if name not in NOT_ATTRIBUTES:
            setattr(OptionAttributes, name, Option(name))
    for old, new in OLD_NAMES.items():
        setattr(OptionAttributes, old, RenamedOption(new, old))


_add_attributes()


#: Lightning's names for what loopbus calls otherwise.
_LIGHTNING_NAMES = {
    "callbacks": "loopbus calls these `plugins`: Trainer(plugins=[...])",
    "logger": "loggers are plugins: Trainer(plugins=[CSVLogger(...), ...])",
    "accelerator": "choose the device with `device` ('auto', 'cpu', 'cuda', 'cuda:N')",
    "devices": "choose the device with `device`; several GPUs run under torchrun",
    "gpus": "choose the device with `device` ('cuda' or 'cuda:N')",
    "enable_progress_bar": "the progress bar is a plugin: pass plugins=[] to turn it off",
    "default_root_dir": (
        "loopbus calls it `root_dir`: Trainer(root_dir='runs') writes each run into "
        "runs/<name>/version_N (docs/plugins.md, 'Run folders')"
    ),
    "profiler": (
        "the profiler is a plugin: Trainer(plugins=[Profiler(...)]) with "
        "`from loopbus.plugins import Profiler` (docs/tuning.md)"
    ),
}


def unknown_options(
    unknown: dict[str, Any], known: list[str], *, owner: str = "Trainer"
) -> TypeError:
    """The error for ``Trainer(**unknown)``: Lightning's names for what loopbus calls
    otherwise, with the way to say it here, a value that follows from options, or the
    closest known option."""
    lines = []
    for name in unknown:
        if name in DERIVED:
            lines.append(f"{name!r} is no option but follows from {DERIVED[name]}")
            continue
        if name in _LIGHTNING_NAMES:
            lines.append(f"{name!r}: {_LIGHTNING_NAMES[name]}")
            continue
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
        lines.append(
            f"{name!r}: did you mean `{close[0]}`?" if close else f"{name!r} is not an option"
        )
    return TypeError(
        f"{owner}() got unknown option(s): " + "; ".join(lines) + f". Its options are {known}."
    )
