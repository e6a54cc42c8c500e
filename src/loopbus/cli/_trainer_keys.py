"""The ``trainer`` section's keys as a configuration file writes them, for the checks
made before torch is imported: each option's name, the type a file can give it and its
default, and the old names. Generated from the declarations
(``loopbus.TrainerOptions.declarations()``) and ``Trainer``'s other keywords by
``python -m loopbus.cli._trainer_keys``, which rewrites this file; a test holds it equal
to them. The values themselves are checked by the declarations, once the engine is
imported.

Imports neither torch nor the engine (but :func:`render`, on use).
"""

from __future__ import annotations

import collections.abc
import json
import os
import sys
import types
import typing
from typing import Any, Literal, NamedTuple

__all__ = ["KEYS", "RENAMED", "TrainerKey", "render"]


class TrainerKey(NamedTuple):
    """A ``trainer`` key: the type of the values a file may give it, and its default."""

    type: Any
    default: Any


# ---- generated: begin
KEYS: dict[str, TrainerKey] = {
    "max_epochs": TrainerKey(int | None, None),
    "max_steps": TrainerKey(int | None, None),
    "limit_train_batches": TrainerKey(int | float | None, None),
    "limit_val_batches": TrainerKey(int | float | None, None),
    "limit_test_batches": TrainerKey(int | float | None, None),
    "limit_predict_batches": TrainerKey(int | float | None, None),
    "fast_dev_run": TrainerKey(bool | int, False),
    "val_check_interval": TrainerKey(int | None, None),
    "check_val_every_n_epoch": TrainerKey(int, 1),
    "num_sanity_val_steps": TrainerKey(int, 2),
    "accumulate_grad_batches": TrainerKey(int, 1),
    "gradient_clip_val": TrainerKey(float | None, None),
    "gradient_clip_algorithm": TrainerKey(Literal["norm", "value"], "norm"),
    "executor": TrainerKey(Literal["inline", "thread"], "inline"),
    "compile": TrainerKey(bool | dict[str, Any], False),
    "device": TrainerKey(str | None, "auto"),
    "strategy": TrainerKey(Literal["auto", "ddp", "fsdp", "ft", "single"], "auto"),
    "process_group_timeout_s": TrainerKey(float, 1800.0),
    "stop_check_interval_s": TrainerKey(float, 0.05),
    "preemption": TrainerKey(bool | Literal["auto"], "auto"),
    "preemption_exit_code": TrainerKey(int | None, None),
    "preemption_grace_s": TrainerKey(float | None, None),
    "yield_interval_s": TrainerKey(float, 0.005),
    "drain_timeout_s": TrainerKey(float, 10.0),
    "prefetch": TrainerKey(int, 0),
    "device_prefetch": TrainerKey(int, 1),
    "put_lag": TrainerKey(int, 4),
    "leak_check": TrainerKey(Literal["raise", "warn"] | None | Literal["env"], "env"),
    "enable_model_summary": TrainerKey(bool, True),
    "root_dir": TrainerKey(str | None, None),
    "name": TrainerKey(str, "loopbus_logs"),
    "version": TrainerKey(int | str | None, None),
    "precision": TrainerKey(str | int | None, "32"),
}
RENAMED: dict[str, str] = {
    "process_group_timeout": "process_group_timeout_s",
    "stop_check_interval": "stop_check_interval_s",
    "preemption_grace": "preemption_grace_s",
    "yield_interval": "yield_interval_s",
    "drain_timeout": "drain_timeout_s",
}
# ---- generated: end

_BEGIN, _END = "# ---- generated: begin\n", "# ---- generated: end\n"


def _file_atoms(annotation: Any) -> list[str]:
    """The members of ``annotation`` a file can write, as source: plain values, literals
    and mappings; an object only code can make (a ``torch.device``, a strategy or
    precision object) is left out."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return [a for arg in typing.get_args(annotation) for a in _file_atoms(arg)]
    if annotation is None or annotation is type(None):
        return ["None"]
    if origin is Literal:
        return [f"Literal[{', '.join(_source(a) for a in typing.get_args(annotation))}]"]
    if origin in (dict, collections.abc.Mapping):
        return ["dict[str, Any]"]
    if annotation in (bool, int, float, str):
        return [annotation.__name__]
    if annotation is os.PathLike or origin is os.PathLike:
        return ["str"]
    return []


def _source(value: Any) -> str:
    """``value`` as this file's source writes it (strings in double quotes)."""
    return json.dumps(value) if isinstance(value, str) else repr(value)


def render() -> str:
    """This file as the declarations give it now (imports the engine)."""
    import inspect

    import loopbus

    declared = loopbus.TrainerOptions.declarations()
    names = {d.name for d in declared}
    lines = ["KEYS: dict[str, TrainerKey] = {\n"]
    entries = [(d.name, d.type, d.default) for d in declared]
    entries += [
        (name, p.annotation, p.default)
        for name, p in inspect.signature(loopbus.Trainer).parameters.items()
        if name not in names and p.kind is inspect.Parameter.KEYWORD_ONLY and name != "plugins"
    ]
    for name, annotation, default in entries:
        if isinstance(annotation, str):  # a keyword's annotation, unevaluated
            annotation = eval(annotation, vars(sys.modules[loopbus.Trainer.__module__]))
        atoms = " | ".join(dict.fromkeys(_file_atoms(annotation)))
        lines.append(f"    {_source(name)}: TrainerKey({atoms}, {_source(default)}),\n")
    lines.append("}\nRENAMED: dict[str, str] = {\n")
    lines += [
        f"    {_source(d.renamed_from)}: {_source(d.name)},\n" for d in declared if d.renamed_from
    ]
    lines.append("}\n")
    with open(__file__, encoding="utf-8") as file:
        text = file.read()
    head, rest = text.split(_BEGIN, 1)
    return head + _BEGIN + "".join(lines) + _END + rest.split(_END, 1)[1]


if __name__ == "__main__":
    rendered = render()
    with open(__file__, "w", encoding="utf-8") as out:
        out.write(rendered)
