"""A run's configuration as plain data: what ``config.yaml`` in the run folder holds,
what every checkpoint carries and what the loggers get as hyperparameters.

:func:`plain_config` turns anything into values every consumer takes (YAML, JSON, a
checkpoint loaded with ``weights_only=True``, TensorBoard, MLflow, W&B): dicts with
string keys, lists, ``None``, ``bool``, ``int``, ``float`` and ``str``; any other object
becomes a string (a class or an instance: ``"module.Class"``). :func:`json_safe` also
spells out the floats JSON has no word for (``inf``, ``nan``). :func:`config_text` is the
YAML text of a configuration (sorted keys off).

Imports the base layer only, and torch.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import math
import os
from collections.abc import Mapping
from typing import Any

import torch

from .._exceptions import MisconfigurationError

__all__ = ["check_run_config", "config_text", "default_config", "json_safe", "plain_config"]

#: How deep a configuration nests before the rest of a branch becomes a string.
MAX_DEPTH = 16


def _class_path(obj: Any) -> str:
    """``"module.Class"`` of a class, a function, or an instance's class."""
    target = (
        obj
        if isinstance(obj, type) or (callable(obj) and hasattr(obj, "__qualname__"))
        else type(obj)
    )
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", type(target).__qualname__)
    return f"{module}.{name}" if module and module != "builtins" else str(name)


def plain_config(value: Any, depth: int = 0) -> Any:
    """``value`` made plain (see the module docstring): mappings become dicts with
    string keys, lists, tuples and sets lists, paths, devices and dtypes strings, enums
    their value, anything else ``"module.Class"``. Past :data:`MAX_DEPTH` levels a
    branch becomes its ``repr``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value if type(value) in (bool, int, float, str, type(None)) else _scalar(value)
    if depth >= MAX_DEPTH:
        return repr(value)[:200]
    if isinstance(value, Mapping):
        return {str(key): plain_config(item, depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_config(item, depth + 1) for item in value]
    if isinstance(value, (set, frozenset)):
        return sorted((plain_config(item, depth + 1) for item in value), key=repr)
    if isinstance(value, enum.Enum):
        return plain_config(value.value, depth + 1)
    if isinstance(value, (os.PathLike, torch.device, torch.dtype)):
        return os.fspath(value) if isinstance(value, os.PathLike) else str(value)
    return _class_path(value)


def _scalar(value: Any) -> Any:
    """A subclass of a plain scalar (an ``IntEnum``, numpy's ``float64``) as the scalar."""
    for kind in (bool, int, float, str):
        if isinstance(value, kind):
            return kind(value)
    return str(value)


def check_run_config(config: Any) -> dict[str, Any]:
    """``Trainer.set_run_config``'s argument, checked (a mapping) and made plain."""
    if not isinstance(config, Mapping):
        raise MisconfigurationError(
            "Trainer.set_run_config(config) takes a mapping (the resolved configuration: "
            f"{{'trainer': {{...}}, 'model': {{...}}, ...}}), got {type(config).__name__}."
        )
    return plain_config(config)  # type: ignore[no-any-return]


def default_config(given: Mapping[str, Any], module: Any) -> dict[str, Any]:
    """The configuration recorded when none was set: the trainer's options as given,
    plain, and the module's class with its hyperparameters (``Module.hparams``), in
    LightningCLI's shape (``{"trainer": {...}, "model": {"class_path": ...,
    "init_args": {...}}}``)."""
    config: dict[str, Any] = {"trainer": plain_config(given)}
    if module is not None:
        model: dict[str, Any] = {"class_path": _class_path(module)}
        hparams = getattr(module, "hparams", None)
        if hparams:
            model["init_args"] = plain_config(hparams)
        config["model"] = model
    return config


def json_safe(config: Any) -> Any:
    """A plain configuration with the floats JSON cannot hold (``inf``, ``-inf``,
    ``nan``) as strings."""
    if isinstance(config, float) and not math.isfinite(config):
        return str(config)
    if isinstance(config, dict):
        return {key: json_safe(value) for key, value in config.items()}
    if isinstance(config, list):
        return [json_safe(value) for value in config]
    return config


def config_text(config: Mapping[str, Any]) -> bytes:
    """The YAML text of a plain configuration, keys in their order. Without PyYAML, the
    same as indented JSON (which YAML reads too)."""
    if importlib.util.find_spec("yaml") is None:
        return json.dumps(json_safe(dict(config)), indent=2).encode() + b"\n"
    import yaml

    text = yaml.safe_dump(
        dict(config), sort_keys=False, default_flow_style=False, allow_unicode=True
    )
    return text.encode()
