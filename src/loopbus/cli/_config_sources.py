"""Where a configuration's values come from: the command line read in order (files given
with ``--config`` and ``--KEY=VALUE`` overrides, the later winning), YAML, TOML and JSON
files, and the merge that keeps, for every value, the source that set it.

Nothing here imports torch or the engine.
"""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ._errors import ConfigError, Problem

__all__ = [
    "CLASS_SECTIONS",
    "DEFAULT",
    "CommandLine",
    "Config",
    "read_command_line",
]

#: The label of a value nothing gave (a declaration's or a signature's default).
DEFAULT = "default"
#: The sections that name a class (or function) and its arguments.
CLASS_SECTIONS = ("model", "data")
#: The command line's own options: those that take a value, and the flags.
_VALUED = ("config", "resume", "grid", "seeds")
_FLAGS = ("print-config", "explain", "dry-run")
_KEY = re.compile(r"^\w[\w-]*(\.\w[\w-]*)*$")
_SUFFIXES = {".yaml": "YAML", ".yml": "YAML", ".toml": "TOML", ".json": "JSON"}


@dataclasses.dataclass
class CommandLine:
    """A configuration command's arguments, read in order: ``steps`` are ``("file",
    path)`` and ``("set", key, value, text)`` in the order given; the rest are the
    command's own options."""

    command: str
    steps: list[tuple[str, ...]] = dataclasses.field(default_factory=list)
    flags: set[str] = dataclasses.field(default_factory=set)
    resume: str | None = None
    grid: list[str] = dataclasses.field(default_factory=list)
    seeds: str | None = None
    help: bool = False


def read_command_line(command: str, tokens: Sequence[str]) -> CommandLine:
    """The arguments after ``loopbus COMMAND``, in order. ``--KEY=VALUE`` and ``--KEY
    VALUE`` set a key of the configuration (VALUE read as YAML: ``3``, ``3.0e-4``,
    ``null``, ``[1, 2]``); no option may be abbreviated."""
    line = CommandLine(command)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if token in ("-h", "--help"):
            line.help = True
            continue
        if not token.startswith("--") or token == "--":
            raise ConfigError([Problem("", _stray(command, token))])
        name, has_value, value = token[2:].partition("=")
        if name in _FLAGS:
            if has_value:
                raise ConfigError([Problem("", f"--{name} takes no value, got {token!r}.")])
            line.flags.add(name)
            continue
        if not has_value:
            if i >= len(tokens) or tokens[i].startswith("--"):
                raise ConfigError([Problem(name, f"--{name} needs a value: --{name}=VALUE.")])
            value = tokens[i]
            i += 1
        _take(line, name, value)
    return line


def _stray(command: str, token: str) -> str:
    return (
        f"unexpected argument {token!r}: loopbus {command} takes --config FILE and "
        f"--KEY=VALUE (such as --trainer.max_epochs=3); see loopbus {command} --help."
    )


def _take(line: CommandLine, name: str, value: str) -> None:
    if name == "config":
        line.steps.append(("file", value))
    elif name == "resume":
        line.resume = value
    elif name == "grid":
        line.grid.append(value)
    elif name == "seeds":
        line.seeds = value
    elif not _KEY.match(name):
        raise ConfigError(
            [
                Problem(
                    "",
                    f"--{name} is no key: write --SECTION.KEY=VALUE, such as --trainer.max_epochs=3.",
                )
            ]
        )
    else:
        line.steps.append(("set", name, value, f"--{name}={value}"))


def parse_value(key: str, text: str) -> Any:
    """A command-line value read as YAML (``3`` an int, ``true`` a bool, ``null`` None,
    ``[a, b]`` a list); a plain word stays a string."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(
            [
                Problem(
                    key,
                    f"{text!r} is not a value (read as YAML: {_first_line(exc)}).",
                    "command line",
                )
            ]
        ) from None


def _first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def read_file(path: str) -> dict[str, Any]:
    """A configuration file's top level: a mapping, from YAML (``.yaml``, ``.yml``),
    TOML (``.toml``) or JSON (``.json``)."""
    suffix = Path(path).suffix.lower()
    if suffix not in _SUFFIXES:
        raise ConfigError(
            [
                Problem(
                    "",
                    f"--config {path}: unknown format {suffix or '(no suffix)'!r}; "
                    "name the file .yaml, .yml, .toml or .json.",
                )
            ]
        )
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            [Problem("", f"--config {path}: cannot read it ({exc.strerror or exc}).")]
        ) from None
    try:
        data = _parse(suffix, text)
    except Exception as exc:  # each library's own error type: a file that does not parse
        raise ConfigError(
            [Problem("", f"--config {path} is not valid {_SUFFIXES[suffix]}: {_first_line(exc)}")]
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            [
                Problem(
                    "",
                    f"--config {path} must hold a mapping of sections (trainer:, model:, "
                    f"data:, ...), got a {type(data).__name__}.",
                )
            ]
        )
    return data


def _parse(suffix: str, text: str) -> Any:
    if suffix == ".toml":
        return tomllib.loads(text)
    if suffix == ".json":
        return json.loads(text)
    import yaml

    return yaml.safe_load(text)


class Config:
    """A configuration being put together: nested mappings of values, and for each value
    (a leaf: a scalar or a list) the source that set it. A later source replaces what an
    earlier one set at the same key; a section given a different ``class_path`` is
    replaced whole (the old class's ``init_args`` do not carry over)."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.origins: dict[str, str] = {}

    def merge(self, data: Mapping[str, Any], source: str, prefix: str = "") -> None:
        """Merge ``data`` (a file's top level, or a section) at ``prefix``."""
        target = self._section(prefix, source) if prefix else self.values
        for key, value in data.items():
            self._put(target, f"{prefix}.{key}" if prefix else str(key), str(key), value, source)

    def set(self, key: str, value: Any, source: str) -> None:
        """Set the value at a dotted ``key`` (``trainer.max_epochs``)."""
        parent, _, name = key.rpartition(".")
        target = self._section(parent, source) if parent else self.values
        self._put(target, key, name, value, source)

    def get(self, key: str, default: Any = None) -> Any:
        node: Any = self.values
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def drop(self, key: str) -> None:
        """Forget the origins of ``key`` and of everything under it."""
        for name in [k for k in self.origins if k == key or k.startswith(key + ".")]:
            del self.origins[name]

    def _section(self, key: str, source: str) -> dict[str, Any]:
        """The mapping at ``key``, made where missing; an item of a list (the plugins)
        by its index: ``trainer.plugins.0.init_args``."""
        node: Any = self.values
        parts = key.split(".")
        for depth, part in enumerate(parts, 1):
            path = ".".join(parts[:depth])
            if isinstance(node, list):
                child = self._item(node, part, path, source)
            else:
                child = node.get(part)
                if child is None:
                    child = node[part] = {}
            if not isinstance(child, dict) and not (isinstance(child, list) and depth < len(parts)):
                raise ConfigError(
                    [
                        Problem(
                            path,
                            f"is {child!r} ({self.origins.get(path, DEFAULT)}), not a "
                            f"section: {key} cannot be set inside it.",
                            source,
                        )
                    ]
                )
            node = child
        return node  # type: ignore[no-any-return]

    def _item(self, items: list[Any], part: str, path: str, source: str) -> Any:
        if not part.isdigit() or int(part) >= len(items):
            raise ConfigError(
                [
                    Problem(
                        path,
                        f"there is no item {part!r} here: the list has {len(items)} "
                        f"(0 to {len(items) - 1}).",
                        source,
                    )
                ]
            )
        if isinstance(items[int(part)], str):  # a plugin by its class path alone
            items[int(part)] = {"class_path": items[int(part)]}
        return items[int(part)]

    def _put(self, target: dict[str, Any], key: str, name: str, value: Any, source: str) -> None:
        if key in CLASS_SECTIONS and isinstance(value, str):
            value = {"class_path": value}  # --model=pkg.Net: the class, its defaults
        old = target.get(name)
        if isinstance(value, dict) and isinstance(old, dict) and not _new_class(old, value):
            for child, item in value.items():
                self._put(old, f"{key}.{child}", str(child), item, source)
            return
        self.drop(key)
        if isinstance(value, dict):
            target[name] = {}
            for child, item in value.items():
                self._put(target[name], f"{key}.{child}", str(child), item, source)
            if not value:
                self.origins[key] = source
            return
        target[name] = value
        self.origins[key] = source


def _new_class(old: Mapping[str, Any], new: Mapping[str, Any]) -> bool:
    """Whether ``new`` names another class than ``old`` (then it replaces it whole)."""
    return "class_path" in new and "class_path" in old and new["class_path"] != old["class_path"]


def assemble(line: CommandLine, config: Config | None = None) -> Config:
    """The configuration the command line gives: over ``config`` (a resumed run's saved
    configuration), each file and override in the order given."""
    config = config if config is not None else Config()
    for step in line.steps:
        if step[0] == "file":
            config.merge(read_file(step[1]), step[1])
        else:
            _, key, text, shown = step
            config.set(key, parse_value(key, text), f"command line: {shown}")
    return config
