"""A configuration checked and completed, section by section, in three passes: first
the shape of every section and each ``trainer`` key and the type of its value (against
:mod:`._trainer_keys`, generated from the declarations: no torch yet), then the
``trainer`` values (against each option's declaration,
``loopbus.TrainerOptions.declarations()``), then the class paths (``model``, ``data``,
each plugin), imported, with their ``init_args`` held against the ``__init__``
signature. Every default is filled in with ``default`` as its source. Nothing is built.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
import typing
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ._annotations import coerce, describe, fits
from ._config_sources import CLASS_SECTIONS, DEFAULT, Config
from ._errors import ConfigError, Problem, did_you_mean
from ._trainer_keys import KEYS, RENAMED

__all__ = ["ClassSpec", "Resolved", "check_classes", "check_shape", "check_values"]

#: The top-level keys of a configuration, in the order they are printed.
TOP_LEVEL = ("seed_everything", "trainer", "model", "data", "ckpt_path")
_CLASS_KEYS = ("class_path", "init_args")
_PLUGIN_PACKAGES = ("loopbus.plugins", "loopbus.plugins.tuning")
_PLUGINS_FORM = (
    "loopbus calls callbacks and loggers plugins; list them under trainer.plugins:\n"
    "      trainer:\n"
    "        plugins:\n"
    "          - class_path: Checkpoint\n"
    "            init_args: {dirpath: checkpoints, monitor: val/acc, mode: max}\n"
    "          - class_path: CSVLogger\n"
    "            init_args: {save_dir: logs}"
)
_LIGHTNING_TOP = {
    "optimizer": "loopbus builds optimizers in the module's configure_optimizers(): give "
    "their settings (lr, ...) as model.init_args",
    "lr_scheduler": "loopbus builds schedulers in the module's configure_optimizers(): give "
    "their settings as model.init_args",
}


@dataclasses.dataclass(frozen=True)
class ClassSpec:
    """A class (or function) named by ``class_path``, and the keyword arguments to call
    it with (those the configuration gave; the rest keep the signature's defaults)."""

    path: str
    target: Callable[..., Any]
    kwargs: Mapping[str, Any]

    def build(self) -> Any:
        return self.target(**self.kwargs)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """A configuration checked in full: ``config`` (every key, defaults included, in the
    printed order) with each value's source in ``origins``, and what to build."""

    config: dict[str, Any]
    origins: dict[str, str]
    trainer: Mapping[str, Any]
    plugins: tuple[ClassSpec, ...] | None
    model: ClassSpec
    data: ClassSpec


def _source(config: Config, key: str) -> str | None:
    """Where the value at ``key`` came from: its own source, that of the list or
    section above it (a plugin inside ``trainer.plugins``), or of the first value under
    it."""
    parts = key.split(".")
    for depth in range(len(parts), 0, -1):
        found = config.origins.get(".".join(parts[:depth]))
        if found is not None:
            return found
    under = [v for k, v in config.origins.items() if k.startswith(key + ".")]
    return under[0] if under else None


def check_shape(config: Config, command: str) -> None:
    """The first pass: the top level, ``seed_everything``, ``ckpt_path``, the shape of
    ``model`` and ``data`` and every ``trainer`` option, checked, defaults filled in.
    Raises :class:`ConfigError` with every problem found."""
    values = config.values
    problems = [_unknown_top(config, key) for key in values if key not in TOP_LEVEL]
    seed = values.get("seed_everything")
    if seed is not None and not isinstance(seed, (bool, int)):
        problems.append(
            Problem(
                "seed_everything",
                f"must be an int (the seed), true (draw one) "
                f"or null/false (do not seed), got {seed!r}.",
                _source(config, "seed_everything"),
            )
        )
    ckpt = values.get("ckpt_path")
    if ckpt is not None and not isinstance(ckpt, str):
        problems.append(
            Problem(
                "ckpt_path",
                f"must be a checkpoint's path, 'last' or 'best', got {ckpt!r}.",
                _source(config, "ckpt_path"),
            )
        )
    for section in CLASS_SECTIONS:
        problems += _class_shape(config, section, values.get(section))
    problems += _check_trainer(config)
    if problems:
        raise ConfigError(problems)
    for key in ("seed_everything", "ckpt_path"):
        if key not in values:
            config.set(key, None, DEFAULT)


def _unknown_top(config: Config, key: str) -> Problem:
    source = _source(config, key)
    if key in _LIGHTNING_TOP:
        return Problem(key, _LIGHTNING_TOP[key] + ".", source)
    known = list(TOP_LEVEL)
    if source is not None and source.startswith("command line"):
        known += ["config", "print-config", "explain"]
    return Problem(key, "is not a key of the configuration" + did_you_mean(key, known), source)


def _class_shape(config: Config, section: str, value: Any) -> list[Problem]:
    if value is None:
        return [
            Problem(
                section,
                f"is required: name its class with {section}.class_path "
                f"(--{section}=package.module.Class, or a '{section}:' section in a file).",
            )
        ]
    return _spec_shape(config, section, value)


def _spec_shape(config: Config, path: str, value: Any) -> list[Problem]:
    source = _source(config, path)
    if not isinstance(value, dict):
        return [
            Problem(
                path,
                f"must be a class path or {{class_path: ..., init_args: {{...}}}}, got {value!r}.",
                source,
            )
        ]
    problems = [
        Problem(
            f"{path}.{key}",
            "is not a key here (a class is given by class_path and "
            f"init_args){did_you_mean(str(key), _CLASS_KEYS)}",
            _source(config, f"{path}.{key}"),
        )
        for key in value
        if key not in _CLASS_KEYS
    ]
    if not isinstance(value.get("class_path"), str) or not value["class_path"]:
        problems.append(
            Problem(
                f"{path}.class_path",
                "must name a class or function as "
                f"package.module.Name, got {value.get('class_path')!r}.",
                source,
            )
        )
    if not isinstance(value.get("init_args", {}), dict):
        problems.append(
            Problem(
                f"{path}.init_args",
                f"must be a mapping of argument names to values, got {value['init_args']!r}.",
                _source(config, f"{path}.init_args"),
            )
        )
    return problems


def _check_trainer(config: Config) -> list[Problem]:
    """Each ``trainer`` key known, not renamed, and of a type its option takes (from
    :mod:`._trainer_keys`: no torch); the values are checked by :func:`check_values`."""
    section = config.values.get("trainer")
    if section is None:
        section = {}
    elif not isinstance(section, dict):
        return [
            Problem(
                "trainer",
                f"must be a mapping of Trainer options, got {section!r}.",
                _source(config, "trainer"),
            )
        ]
    problems = []
    for key, value in section.items():
        path, source = f"trainer.{key}", _source(config, f"trainer.{key}")
        if key in ("callbacks", "logger"):
            problems.append(Problem(path, _PLUGINS_FORM, source))
        elif key in RENAMED:
            problems.append(Problem(path, f"was renamed: write trainer.{RENAMED[key]}.", source))
        elif key == "strategy" and isinstance(value, dict):  # a strategy object
            problems += _spec_shape(config, path, value)
        elif key in KEYS:
            kind = KEYS[key].type
            section[key] = value = coerce(value, kind)
            if fits(value, kind) is False:
                problems.append(
                    Problem(path, f"{key} must be {describe(kind)}, got {value!r}.", source)
                )
        elif key == "plugins":
            problems += _plugins_shape(config, value)
        else:
            known = [*KEYS, "plugins"]
            problems.append(
                Problem(path, "is not a Trainer option" + did_you_mean(key, known), source)
            )
    ordered = {k: section.get(k, spec.default) for k, spec in KEYS.items()}
    ordered["plugins"] = section.get("plugins")
    for key in ordered:
        if key not in section:
            config.origins[f"trainer.{key}"] = DEFAULT
    config.values["trainer"] = ordered
    return problems


def check_values(config: Config) -> None:
    """The values of the ``trainer`` keys the configuration gave, each checked by its
    option's declaration (imports the engine, and torch). Raises :class:`ConfigError`
    with every problem."""
    import loopbus  # the engine: its public names, as a user's script reads them

    declared = {d.name: d for d in loopbus.TrainerOptions.declarations()}
    section = config.values["trainer"]
    problems = []
    for key, value in section.items():
        if key not in declared or config.origins.get(f"trainer.{key}") == DEFAULT:
            continue
        if isinstance(value, dict) and key == "strategy":  # a class: the next pass
            continue
        try:
            declared[key].check(value)
        except (loopbus.LoopbusError, TypeError, ValueError) as exc:
            problems.append(Problem(f"trainer.{key}", str(exc), _source(config, f"trainer.{key}")))
    if problems:
        raise ConfigError(problems)


def _plugins_shape(config: Config, value: Any) -> list[Problem]:
    if value is None:
        return []
    if not isinstance(value, list):
        return [
            Problem(
                "trainer.plugins",
                f"must be a list of plugins, each a class path or "
                f"{{class_path: ..., init_args: {{...}}}}, got {value!r}.",
                _source(config, "trainer.plugins"),
            )
        ]
    for i, item in enumerate(value):
        if isinstance(item, str):
            value[i] = {"class_path": item}
    return [
        p for i, item in enumerate(value) for p in _spec_shape(config, f"trainer.plugins.{i}", item)
    ]


# ---------------------------------------------------------------- the second pass
def check_classes(config: Config) -> Resolved:
    """The second pass: each class path imported (the current directory first on the
    import path, as ``python -m`` has it), its ``init_args`` held against its signature,
    the signature's defaults filled in. Raises :class:`ConfigError` with every problem."""
    problems: list[Problem] = []
    specs: dict[str, ClassSpec | None] = {}
    with _importable_from(Path.cwd()):
        for section in CLASS_SECTIONS:
            specs[section] = _check_spec(config, section, config.values[section], problems)
        plugins = config.values["trainer"].get("plugins")
        plugin_specs = None
        if plugins is not None:
            found = [
                _check_spec(config, f"trainer.plugins.{i}", item, problems, short="plugin")
                for i, item in enumerate(plugins)
            ]
            plugin_specs = tuple(s for s in found if s is not None)
        strategy = config.values["trainer"].get("strategy")
        strategy_spec = None
        if isinstance(strategy, dict):
            strategy_spec = _check_spec(
                config, "trainer.strategy", strategy, problems, short="strategy"
            )
    model, data = specs["model"], specs["data"]
    if problems or model is None or data is None:
        raise ConfigError(problems)
    trainer = {k: v for k, v in config.values["trainer"].items() if k != "plugins"}
    if strategy_spec is not None:
        trainer["strategy"] = strategy_spec
    ordered = {k: config.values[k] for k in TOP_LEVEL}
    return Resolved(ordered, dict(config.origins), trainer, plugin_specs, model, data)


@contextmanager
def _importable_from(folder: Path) -> Iterator[None]:
    entry = str(folder)
    added = entry not in sys.path
    if added:
        sys.path.insert(0, entry)
    try:
        yield
    finally:
        if added and entry in sys.path:
            sys.path.remove(entry)


def _check_spec(
    config: Config,
    path: str,
    spec: dict[str, Any],
    problems: list[Problem],
    *,
    short: str | None = None,
) -> ClassSpec | None:
    """``spec`` checked: its class imported (a loopbus plugin or strategy also by its
    short name, where ``short`` says which), its ``init_args`` held against it."""
    source = _source(config, f"{path}.class_path")
    name = spec["class_path"]
    try:
        if short is not None and "." not in name:
            name = spec["class_path"] = _short_path(name, plugin=short == "plugin")
        target = import_object(name)
    except ImportError as exc:
        problems.append(Problem(f"{path}.class_path", str(exc), source))
        return None
    given = spec.setdefault("init_args", {})
    found = _check_arguments(config, path, target, given)
    problems += found
    return (
        None if found else ClassSpec(name, target, dict(_given(config, f"{path}.init_args", given)))
    )


def _given(config: Config, path: str, init_args: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    for key, value in init_args.items():
        if config.origins.get(f"{path}.{key}") != DEFAULT:
            yield key, value


def _short_path(name: str, *, plugin: bool) -> str:
    """A plugin's short name (``Checkpoint``) as its class path in loopbus's plugins, or
    a strategy's (``ModelParallelStrategy``) in loopbus; :class:`ImportError` naming the
    closest one when there is none."""
    names: list[str] = []
    for package in _PLUGIN_PACKAGES if plugin else ("loopbus",):
        module = importlib.import_module(package)
        known = [n for n in getattr(module, "__all__", ()) if plugin or _is_strategy(module, n)]
        if name in known:
            return f"{package}.{name}"
        names += known
    kind = "plugin" if plugin else "strategy"
    raise ImportError(
        f"there is no loopbus {kind} {name!r}"
        + did_you_mean(name, names).replace("the keys here are", f"the {kind}s are")
        + f" (a {kind} of your own: give its class path, package.module.Name)"
    )


def _is_strategy(module: Any, name: str) -> bool:
    found = getattr(module, name)
    base = module.Strategy
    return isinstance(found, type) and issubclass(found, base) and found is not base


def import_object(name: str) -> Any:
    """The object a dotted path names (``package.module.Class``); :class:`ImportError`
    with a sentence saying what failed."""
    module_name, _, attribute = name.rpartition(".")
    if not module_name:
        raise ImportError(
            f"{name!r} is no class path: write package.module.Name (loopbus's plugins may be "
            "named alone: Checkpoint, CSVLogger)."
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise ImportError(
                f"cannot import {name!r}: there is no module {exc.name!r} (class paths are "
                "imported from the current directory and the installed packages)."
            ) from None
        raise ImportError(f"importing {module_name!r} for {name!r} failed: {exc}") from None
    except Exception as exc:  # the user's module failed as it was imported
        raise ImportError(
            f"importing {module_name!r} for {name!r} failed: {type(exc).__name__}: {exc}"
        ) from None
    if not hasattr(module, attribute):
        public = [n for n in dir(module) if not n.startswith("_")]
        raise ImportError(
            f"cannot import {name!r}: module {module_name!r} has no {attribute!r}"
            + did_you_mean(attribute, public, listing=False)
        )
    return getattr(module, attribute)


def _check_arguments(
    config: Config, path: str, target: Any, given: dict[str, Any]
) -> list[Problem]:
    """``given`` (the ``init_args``) held against ``target``'s signature: unknown names,
    wrong simple types, missing required arguments; the defaults filled in."""
    owner = f"{getattr(target, '__qualname__', target)}{'.__init__' if isinstance(target, type) else ''}"
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return []  # no signature to hold them against: the call will tell
    hints = _hints(target)
    open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    named = {
        n: p
        for n, p in parameters.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    problems = []
    for key, value in given.items():
        key_path, source = f"{path}.init_args.{key}", _source(config, f"{path}.init_args.{key}")
        if key not in named:
            if not open_ended:
                problems.append(
                    Problem(
                        key_path,
                        f"{owner} takes no argument {key!r}"
                        + did_you_mean(key, named).replace("the keys here are", "it takes"),
                        source,
                    )
                )
            continue
        hint = hints.get(key)
        given[key] = value = coerce(value, hint)
        if fits(value, hint) is False:
            problems.append(
                Problem(
                    key_path,
                    f"{owner} takes {key} as {describe(hint)}, got "
                    f"{value!r} ({type(value).__name__}).",
                    source,
                )
            )
    for key, parameter in named.items():
        if key in given:
            continue
        if parameter.default is inspect.Parameter.empty:
            problems.append(
                Problem(
                    f"{path}.init_args.{key}",
                    f"{owner} requires it (it has no "
                    f"default): give it in the file or as --{path}.init_args.{key}=VALUE.",
                )
            )
        elif _plain(parameter.default):
            given[key] = parameter.default
            config.origins[f"{path}.init_args.{key}"] = DEFAULT
    return problems


def _hints(target: Any) -> dict[str, Any]:
    function = target.__init__ if isinstance(target, type) else target
    try:
        return typing.get_type_hints(function)
    except Exception:  # an annotation that does not evaluate here: no types to check
        return {}


def _plain(value: Any) -> bool:
    """Whether a default is plain data a configuration file can hold."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    return False
