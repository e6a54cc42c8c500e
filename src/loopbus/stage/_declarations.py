"""How a trainer option is declared, once: :func:`option` on a field of its group
(``_option_groups``) gives its name, the type ``Trainer(...)`` accepts, its default, its
unit, its check, its docstring, whether it may change after the trainer is built and
its old name, and :class:`OptionDeclaration` is what the rest reads: ``Trainer``'s
keywords, the trainer's attributes, :meth:`~loopbus.TrainerOptions.replace`, the
deprecated aliases, ``docs/reference.md``'s table (a test compares them).

Here too are the checks the declarations name: each takes the option's name and the
value given and returns the value checked (idempotent: a checked value checks to itself,
so ``Trainer(**options.given)`` builds the same options again), or raises
:class:`~loopbus.MisconfigurationError` with a full sentence naming the option, the bad
value and the fix.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Literal, TypedDict, Unpack

import torch

from loopbus.distributed._strategy import Strategy
from loopbus.state._scope import leak_check_from_env

from .._exceptions import MisconfigurationError
from .._validate import check_choice, check_int, check_number

__all__ = [
    "Check",
    "OptionDeclaration",
    "check_clip",
    "check_compile",
    "check_dev_run",
    "check_device",
    "check_exit_code",
    "check_flag",
    "check_leak_check",
    "check_length",
    "check_limit",
    "check_preemption",
    "check_strategy",
    "choice",
    "compile_optimizer_option",
    "compile_options",
    "declared",
    "derived",
    "integer",
    "option",
    "resolve_device",
    "seconds",
]

#: A check: the option's name and the value given -> the value checked (or it raises).
Check = Callable[[str, Any], Any]

#: The key of a declaration in a dataclass field's ``metadata``.
_KEY = "loopbus.option"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class OptionDeclaration:
    """One option of :class:`~loopbus.Trainer`, as declared in its group of
    :class:`~loopbus.TrainerOptions`: listed by ``TrainerOptions.declarations()``.

    ``type`` is what ``Trainer(name=...)`` accepts (an annotation: ``int | None``,
    ``Literal["norm", "value"]``), ``default`` what it takes when not given, ``unit`` what
    a number counts (``"epochs"``, ``"seconds"``; None where it is no count), ``doc``
    what the option does. ``mutable``: whether ``trainer.<name> = value`` may change it
    after the trainer is built; ``fixed_because`` says why not, where not.
    ``renamed_from``: its deprecated old name, if it had one. ``examples``: valid values
    (for help texts and tests). :meth:`check` validates a value as ``Trainer(...)`` does.
    """

    name: str
    group: str
    type: Any
    default: Any
    unit: str | None
    doc: str
    fixed_because: str | None
    renamed_from: str | None
    examples: tuple[Any, ...]
    checker: Check = dataclasses.field(repr=False, compare=False)

    @property
    def mutable(self) -> bool:
        """Whether the option may change after the trainer is built (between stages)."""
        return self.fixed_because is None

    def check(self, value: Any) -> Any:
        """``value`` checked as ``Trainer(name=value)`` checks it: the value the options
        keep as given (``"auto"`` resolved to a device, ``-1`` to ``math.inf``); raises
        :class:`~loopbus.MisconfigurationError` if it is not valid."""
        return self.checker(self.name, value)


class OptionNotes(TypedDict, total=False):
    """What an option may say beside its type, check and doc (see
    :class:`OptionDeclaration`): its ``unit``, why it is ``fixed_because`` once the
    trainer is built, the name it was ``renamed_from``, and more ``examples`` of valid
    values than its default."""

    unit: str | None
    fixed_because: str | None
    renamed_from: str | None
    examples: tuple[Any, ...]


def option(
    default: Any, *, accepts: Any, check: Check, doc: str, **notes: Unpack[OptionNotes]
) -> Any:
    """A field of an option group that is a ``Trainer`` option (see
    :class:`OptionDeclaration`; the name and group come from the field). The field has no
    default of its own: a group is built from checked values only."""
    if unknown := notes.keys() - OptionNotes.__annotations__.keys():
        raise TypeError(f"option() got unknown notes {sorted(unknown)}")
    spec = {
        "type": accepts,
        "default": default,
        "unit": notes.get("unit"),
        "doc": doc,
        "fixed_because": notes.get("fixed_because"),
        "renamed_from": notes.get("renamed_from"),
        "examples": (default, *notes.get("examples", ())),
        "checker": check,
    }
    return dataclasses.field(metadata={_KEY: spec})


def derived(*, doc: str, follows: str) -> Any:
    """A field of an option group that is no option but follows from options
    (``follows`` names them): read like an option, never given or set."""
    return dataclasses.field(metadata={_KEY: {"doc": doc, "follows": follows}})


def declared(group: str, kind: type) -> tuple[list[OptionDeclaration], dict[str, str]]:
    """The options declared on ``kind`` (the group ``group``), and its derived fields
    (name -> the options they follow from). Appends each field's doc to ``kind``'s
    docstring, so ``help()`` shows them."""
    options: list[OptionDeclaration] = []
    follows: dict[str, str] = {}
    lines = []
    for field in dataclasses.fields(kind):
        spec = field.metadata.get(_KEY)
        if spec is None:
            raise TypeError(
                f"{kind.__name__}.{field.name} is declared with neither option() nor derived()."
            )
        if "follows" in spec:
            follows[field.name] = spec["follows"]
            lines.append(f"* ``{field.name}`` (read-only): {spec['doc']}")
            continue
        options.append(OptionDeclaration(name=field.name, group=group, **spec))
        default = f"default ``{spec['default']!r}``"
        unit = f", in {spec['unit']}" if spec["unit"] else ""
        fixed = "; fixed once the trainer is built" if spec["fixed_because"] else ""
        lines.append(f"* ``{field.name}`` ({default}{unit}{fixed}): {spec['doc']}")
    kind.__doc__ = (kind.__doc__ or "").rstrip() + "\n\n    " + "\n    ".join(lines) + "\n"
    return options, follows


# ---------------------------------------------------------------- check factories
def integer(*, minimum: int = 1, allow_none: bool = False, hint: str | None = None) -> Check:
    """An int >= ``minimum`` (and None where ``allow_none``); a bool is not one."""

    def check(name: str, value: Any) -> int | None:
        return check_int(name, value, minimum=minimum, allow_none=allow_none, hint=hint)

    return check


def seconds(
    *,
    minimum: float | None = None,
    exclusive_minimum: float | None = None,
    allow_none: bool = False,
    hint: str | None = None,
) -> Check:
    """A number of seconds within the bounds (a float; None where ``allow_none``)."""

    def check(name: str, value: Any) -> float | None:
        return check_number(
            name,
            value,
            minimum=minimum,
            exclusive_minimum=exclusive_minimum,
            allow_none=allow_none,
            what="a number of seconds",
            hint=hint,
        )

    return check


def choice(choices: Mapping[str, str] | tuple[str, ...]) -> Check:
    """One of ``choices`` (a mapping's values describe them in the message)."""

    def check(name: str, value: Any) -> str:
        return check_choice(name, value, choices)

    return check


def check_flag(name: str, value: Any) -> bool:
    """True or False."""
    if not isinstance(value, bool):
        raise MisconfigurationError(f"{name} must be True or False, got {value!r}.")
    return value


# ---------------------------------------------------------------- the checks of options
def check_length(name: str, value: Any) -> int | float | None:
    """``max_epochs``/``max_steps``: an int >= 0, None (not given), or no limit: ``-1``
    (Lightning's word for it) or ``math.inf``, checked as ``math.inf``."""
    if value is None or value == math.inf:
        return value
    if value == -1 and type(value) is int:
        return math.inf
    return check_int(name, value, minimum=0, hint="-1 or math.inf: no limit; None: not given")


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


def check_dev_run(name: str, value: Any) -> int:
    """``fast_dev_run``: True (1), False (0) or a number of batches."""
    if value is True or value is False:
        return int(value)
    return check_int(
        name,
        value,
        minimum=0,
        hint="True runs 1 batch of each stage, N runs N; False (0) turns it off",
    )


def check_clip(name: str, value: Any) -> float | None:
    """``gradient_clip_val`` checked: a positive number or None."""
    if value is not None and (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or math.isnan(value)
        or value <= 0
    ):
        raise MisconfigurationError(f"{name} must be a positive number or None, got {value!r}.")
    return value


def check_device(name: str, value: Any) -> torch.device:
    """``device``: resolved (see :func:`resolve_device`)."""
    return resolve_device(value)


_STRATEGIES = {
    "auto": "DDP under torchrun, else one process",
    "ddp": "DistributedDataParallel, one process per device",
    "fsdp": "FSDP2: the module sharded over the processes",
    "single": "this process only",
}


def check_strategy(name: str, value: Any) -> str | Strategy:
    """A strategy's name or a strategy object, as given."""
    if isinstance(value, Strategy):
        return value
    return check_choice(
        name,
        value,
        _STRATEGIES,
        hint="or a strategy object, such as loopbus.FSDPStrategy(units=[Block])",
    )


def check_leak_check(name: str, value: Any) -> Literal["raise", "warn"] | None:
    """``leak_check``: None, ``"warn"``, ``"raise"``; ``"env"`` read from the
    ``LOOPBUS_LEAK_CHECK`` environment variable."""
    if isinstance(value, str) and value == "env":
        return leak_check_from_env()
    if value is None or (isinstance(value, str) and value in ("raise", "warn")):
        return value  # type: ignore[return-value]
    raise MisconfigurationError(
        f"{name} must be None, 'warn' or 'raise' ('env': read LOOPBUS_LEAK_CHECK), got {value!r}."
    )


def check_preemption(name: str, value: Any) -> bool | Literal["auto"]:
    """``preemption``: ``"auto"``, True or False."""
    if isinstance(value, bool) or (isinstance(value, str) and value == "auto"):
        return value  # type: ignore[return-value]
    raise MisconfigurationError(
        f"{name} must be 'auto' (handle SIGTERM/SIGUSR1 when a plugin such as "
        f"Checkpoint acts on preemption), True (always) or False (never), got {value!r}."
    )


def check_exit_code(name: str, value: Any) -> int | None:
    """``preemption_exit_code``: an exit status in 0..255, or None."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255
    ):
        raise MisconfigurationError(
            f"{name} must be an exit status in 0..255 or None (128 + the "
            f"signal's number, 143 for SIGTERM), got {value!r}."
        )
    return value


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device of ``Trainer(device=...)`` ("auto": ``cuda:LOCAL_RANK`` under a
    launcher that sets it, else ``cuda``, else the CPU)."""
    if device is None or (isinstance(device, str) and device == "auto"):
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


def check_compile(name: str, value: Any) -> Mapping[str, Any] | None:
    """``compile``: None when off, else the ``torch.compile`` keyword arguments with
    ``"target"`` (see :func:`compile_options`) and the ``"optimizer"`` choice where one
    was given (read-only); the options hold the two apart (``compile``,
    ``compile_optimizer``)."""
    options = compile_options(value)
    if options is not None and isinstance(value, Mapping) and "optimizer" in value:
        return MappingProxyType({**options, "optimizer": compile_optimizer_option(value)})
    return options
