"""A run's folder, ``root_dir/name/version_N`` (Lightning's layout): where the run's
configuration (``config.yaml``), its facts (``run.json``), its checkpoints
(``checkpoints/``) and the file loggers' output go.

:func:`choose_run_folder` picks the folder once, when the trainer is built: rank 0 takes
``version_N`` (the given N, or the next free one, reserved by creating it) and the other
ranks are told which. :class:`RunFolder` holds it and writes its files, on rank 0 only,
each atomically: :meth:`RunFolder.record_start` when a stage starts and
:meth:`RunFolder.record_end` when that stage ends.

``run.json`` describes the latest start in the folder (``name``, ``version``,
``stage``, ``resumed_from_step``, ``started``, ``host``, ``world_size``, the versions of
loopbus, torch and Python, ``commit`` and ``dirty`` when the working directory is in a
git repository, ``config``: the file holding its configuration; once that stage ended,
``ended``, ``outcome``, ``end_step`` and ``end_epoch``), and lists the earlier starts in
``earlier``, oldest first. ``config.yaml`` is the configuration of the
folder's first start; a later start whose configuration differs writes its own beside
it (``config_1.yaml``, ...), named in its ``run.json`` entry.

Imports the base layer only.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import subprocess
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .._durable import replace_atomically
from .._exceptions import MisconfigurationError
from .._validate import check_local_path
from .._version import __version__
from ._run_config import config_text, json_safe

__all__ = [
    "CHECKPOINTS",
    "CONFIG",
    "RUN_JSON",
    "RunFolder",
    "check_root_dir",
    "check_run_name",
    "check_run_version",
    "choose_run_folder",
    "git_state",
]

#: The files and folder of a run folder.
CONFIG = "config.yaml"
RUN_JSON = "run.json"
CHECKPOINTS = "checkpoints"

_GIT_TIMEOUT_S = 5.0


# ---------------------------------------------------------------- the options' checks
def check_root_dir(name: str, value: Any) -> str | None:
    """``root_dir``: None, or a local folder path (not a URL, not a file)."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise MisconfigurationError(
            f"Trainer({name}=...) must be a folder path (the runs are written in "
            f"{name}/name/version_N) or None, got {value!r}."
        )
    text = os.fspath(check_local_path(name, value, owner="Trainer"))
    if not isinstance(text, str):
        raise MisconfigurationError(f"Trainer({name}=...) must be a text path, got {value!r}.")
    if os.path.exists(text) and not os.path.isdir(text):
        raise MisconfigurationError(
            f"Trainer({name}={text!r}) is a file, not a folder: pass a folder to hold the "
            "run folders (it is created if missing)."
        )
    return text


def _folder_name(name: str, value: Any) -> bool:
    return (
        isinstance(value, str)
        and value not in ("", ".", "..")
        and not any(c in value for c in ("/", "\\", "\0"))
    )


def check_run_name(name: str, value: Any) -> str:
    """``name``: a folder name (no separator)."""
    if not _folder_name(name, value):
        raise MisconfigurationError(
            f"Trainer({name}=...) must be a folder name (no '/'), the experiment's folder "
            f"inside root_dir, got {value!r}."
        )
    return str(value)


def check_run_version(name: str, value: Any) -> int | str | None:
    """``version``: None (the next free one), an int N >= 0 or a folder name."""
    if value is None or _folder_name(name, value):
        return value  # type: ignore[no-any-return]
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    raise MisconfigurationError(
        f"Trainer({name}=...) must be None (the next free version_N), a number N >= 0 "
        f"(version_N, continued if it exists) or a folder name, got {value!r}."
    )


# ---------------------------------------------------------------- choosing the folder
def _taken_versions(parent: Path) -> list[int]:
    try:
        names = [entry.name for entry in parent.iterdir() if entry.is_dir()]
    except OSError:
        return []
    digits = [n[len("version_") :] for n in names if n.startswith("version_")]
    return [int(d) for d in digits if d.isdigit()]


def _reserve(root: Path, name: str, version: int | str | None) -> Path:
    """Rank 0: the run folder, created (``version=None``: the next free N, reserved by
    creating it, so that two runs started at once take different ones)."""
    parent = root / name
    if version is not None:
        folder = parent / (f"version_{version}" if isinstance(version, int) else version)
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    parent.mkdir(parents=True, exist_ok=True)
    number = max(_taken_versions(parent), default=-1) + 1
    while True:
        folder = parent / f"version_{number}"
        try:
            folder.mkdir()
        except FileExistsError:
            number += 1
            continue
        return folder


def choose_run_folder(
    root_dir: str | None,
    name: str,
    version: int | str | None,
    *,
    writes: bool,
    broadcast: Callable[[Any], Any] | None = None,
) -> RunFolder:
    """The trainer's run folder (None without ``root_dir``): chosen and created by the
    rank that ``writes`` (rank 0), and handed to the other ranks through ``broadcast``
    (None in one process), so that every rank names the same folder."""
    if root_dir is None:
        return RunFolder(None, writes=False)
    found: str | None = None
    problem: str | None = None
    if writes:
        try:
            found = str(_reserve(Path(root_dir), name, version))
        except OSError as exc:
            problem = (
                f"Trainer(root_dir={root_dir!r}): cannot create the run folder under "
                f"{os.path.join(root_dir, name)}: {exc.strerror or exc}. Pass a folder this "
                "process may write to."
            )
    if broadcast is not None:
        found, problem = broadcast((found, problem))
    if problem is not None:
        raise MisconfigurationError(problem)
    return RunFolder(None if found is None else Path(found), name=name, writes=writes)


# ---------------------------------------------------------------- the facts of a start
def git_state(cwd: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """``{"commit": ..., "dirty": ...}`` of the git repository ``cwd`` (default: the
    working directory) is in; ``{}`` outside one, without git, or where no process can
    be started. ``dirty``: tracked files differ from the commit (left out if git could
    not say in time). Best effort: a failure of git never fails the run."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args],
                cwd=cwd,
                capture_output=True,
                text=True,
                timeout=_GIT_TIMEOUT_S,
                check=False,
            )
        except Exception:  # no git, too slow, or no processes here: the facts without
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None or not commit.strip():
        return {}
    state: dict[str, Any] = {"commit": commit.strip()}
    status = git("status", "--porcelain", "--untracked-files=no")
    if status is not None:
        state["dirty"] = bool(status.strip())
    return state


def _facts(stage: str, resume_step: int | None, world_size: int) -> dict[str, Any]:
    import torch

    return {
        "stage": stage,
        "resumed_from_step": resume_step,
        "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "world_size": world_size,
        "loopbus": __version__,
        "torch": str(torch.__version__),
        "python": platform.python_version(),
        **git_state(),
    }


def _read_json(path: Path) -> dict[str, Any] | None:
    """A ``run.json`` written before (None if absent or unreadable)."""
    import json

    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _same_config(path: Path, text: bytes) -> bool:
    try:
        return path.read_bytes() == text
    except OSError:
        return False


class RunFolder:
    """The trainer's run folder (``path``: None without one) and what is written in it.
    Only the rank that ``writes`` (rank 0) writes; the trainer owns it."""

    def __init__(self, path: Path | None, *, name: str = "", writes: bool) -> None:
        self.path = path
        self.name = name
        self.writes = writes and path is not None
        #: The configuration given with ``Trainer.set_run_config`` (plain), if any.
        self.config: dict[str, Any] | None = None
        self._recorded = False
        #: The stage whose start ``run.json`` describes, until its end is recorded.
        self._open: str | None = None

    @property
    def checkpoints(self) -> Path | None:
        """Where a ``Checkpoint`` given no ``dirpath`` writes."""
        return None if self.path is None else self.path / CHECKPOINTS

    def due(self, resume_step: int | None) -> bool:
        """Whether a start is recorded: a trainer's first, and each that resumes."""
        return self.writes and (not self._recorded or resume_step is not None)

    def record_start(
        self,
        *,
        stage: str,
        config: Mapping[str, Any] | None,
        resume_step: int | None,
        world_size: int,
    ) -> None:
        """Write ``run.json`` (this start, after the earlier ones) and the configuration
        (``config.yaml``, or ``config_K.yaml`` when it differs from the folder's first),
        atomically (blocking: call it in a worker thread)."""
        folder = self.path
        if folder is None or not self.writes:
            return
        self._recorded = True
        self._open = stage
        folder.mkdir(parents=True, exist_ok=True)
        before = _read_json(folder / RUN_JSON)
        earlier: list[Any] = []
        if before is not None:
            earlier = [e for e in before.pop("earlier", []) if isinstance(e, dict)]
            earlier.append(before)
        entry: dict[str, Any] = {"name": self.name, "version": _version_of(folder)}
        entry.update(_facts(stage, resume_step, world_size))
        if config is not None:
            entry["config"] = self._write_config(folder, config, len(earlier))
        entry["earlier"] = earlier
        data = _json_bytes(entry)
        replace_atomically(folder / RUN_JSON, lambda f: f.write(data))

    def record_end(self, *, stage: str, outcome: str, step: int, epoch: int) -> None:
        """Add to ``run.json`` how the start it describes ended: ``ended`` (the time),
        ``outcome`` (``"completed"``, ``"stopped"``, ``"cancelled"`` or ``"failed"``),
        ``end_step`` and ``end_epoch``, atomically (blocking; a small file). Nothing when
        this process recorded no start of ``stage`` (a ``test`` after a recorded ``fit``
        leaves the fit's entry as it is). A write that fails warns; the stage's outcome
        stands."""
        folder = self.path
        if folder is None or not self.writes or self._open != stage:
            return
        self._open = None
        entry = _read_json(folder / RUN_JSON)
        if entry is None:
            return
        entry.update(
            ended=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            outcome=outcome,
            end_step=step,
            end_epoch=epoch,
        )
        data = _json_bytes(entry)
        try:
            replace_atomically(folder / RUN_JSON, lambda f: f.write(data))
        except OSError as exc:
            warnings.warn(
                f"could not record the {stage} stage's end in {folder / RUN_JSON}: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )

    def _write_config(self, folder: Path, config: Mapping[str, Any], index: int) -> str:
        """The configuration's file: ``config.yaml`` unless it holds another one."""
        text = config_text(config)
        first = folder / CONFIG
        if not first.exists() or _same_config(first, text):
            name = CONFIG
        else:
            name = f"config_{index}.yaml"
        if not (folder / name).exists() or not _same_config(folder / name, text):
            replace_atomically(folder / name, lambda f: f.write(text))
        return name


def _version_of(folder: Path) -> int | str:
    tail = folder.name.removeprefix("version_")
    return int(tail) if folder.name.startswith("version_") and tail.isdigit() else folder.name


def _json_bytes(entry: dict[str, Any]) -> bytes:
    import json

    return json.dumps(json_safe(entry), indent=1).encode() + b"\n"
