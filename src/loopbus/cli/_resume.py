"""``loopbus fit --resume RUN_DIR``: a run folder's saved configuration as the base of a
new one, pointed back at the same folder (``root_dir``, ``name``, ``version``) and its
newest complete checkpoint (``ckpt_path: last``); and the changes against it that the
command line made, to print.

Nothing here imports torch or the engine.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ._config_sources import read_file
from ._errors import ConfigError, Problem

__all__ = ["changes", "saved_config"]

_RUN_JSON = "run.json"
_CONFIG = "config.yaml"
_RUN_JSON_LIMIT = 4 * 2**20


def saved_config(run_dir: str) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """The configuration ``run_dir`` was last started with (the file its ``run.json``
    names, else ``config.yaml``), the file's path, and the keys that point the new run
    at the same folder and its last checkpoint."""
    folder = Path(run_dir)
    if not folder.is_dir():
        raise ConfigError(
            [
                Problem(
                    "",
                    f"--resume {run_dir}: there is no such folder; give a run folder, "
                    "root_dir/name/version_N (trainer.run_dir of the run).",
                )
            ]
        )
    path = folder / _config_name(folder)
    if not path.is_file():
        raise ConfigError(
            [
                Problem(
                    "",
                    f"--resume {run_dir}: it holds no {path.name}, so it is no run folder "
                    "a configuration started (loopbus fit --config FILE with trainer.root_dir "
                    "set writes one); resume such a run with --config FILE --ckpt_path=last.",
                )
            ]
        )
    saved = read_file(str(path))
    tail = folder.name.removeprefix("version_")
    version: int | str = (
        int(tail) if folder.name.startswith("version_") and tail.isdigit() else folder.name
    )
    pointed = {
        "trainer": {
            "root_dir": str(folder.resolve().parent.parent),
            "name": folder.resolve().parent.name,
            "version": version,
        },
        "ckpt_path": "last",
    }
    return saved, str(path), pointed


def _config_name(folder: Path) -> str:
    """The configuration file of the folder's latest start, as its ``run.json`` names it
    (a plain file name in the folder), else ``config.yaml``."""
    try:
        with (folder / _RUN_JSON).open("rb") as file:
            data = json.loads(file.read(_RUN_JSON_LIMIT))
    except (OSError, ValueError):
        return _CONFIG
    name = data.get("config") if isinstance(data, dict) else None
    if isinstance(name, str) and name.endswith(".yaml") and Path(name).name == name:
        return name
    return _CONFIG


def _leaves(node: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in node.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def changes(saved: Mapping[str, Any], resolved: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """The keys whose value differs between the saved configuration and the resolved
    one: (key, saved value or None, new value)."""
    before = dict(_leaves(saved))
    return [
        (key, before.get(key), value)
        for key, value in _leaves(resolved)
        if before.get(key) != value
    ]
