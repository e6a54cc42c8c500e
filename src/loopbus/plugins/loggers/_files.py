"""The files that loggers write: started afresh or appended to, continued after a resume,
read back whole lines only; and the module's hyperparameters beside them.

Writes are whole lines and each batch is flushed to the operating system, so a run that
is killed leaves every fully written line readable; the readers ignore a torn last line.
A file is rewritten only through a temporary file, ``fsync`` and an atomic rename, so a
crash never loses what was written.

Resuming (``fit(..., ckpt_path=...)``) continues the same files: the lines of steps
after the checkpoint's are dropped (the resumed run writes them again), every earlier
one is kept.
"""

from __future__ import annotations

import importlib.util
import io
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from loopbus import MisconfigurationError, check_local_path, replace_atomically

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from loopbus import TrainerView

__all__ = ["read_run_info", "save_dir_of", "write_hparams_file"]

_FILE_MODES = {"w": "start a new file", "a": "append to an existing one"}


def _prepare_file(path: Path, append: bool) -> None:
    """Create the parent directory; truncate (``append=False``), or cut a torn last line
    left by a killed run (``append=True``) so new lines start on a line of their own."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not append or not path.exists():
        path.write_bytes(b"")
        return
    with path.open("rb+") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        # Find the end of the last complete line.
        end = size
        chunk = 1 << 16
        while end > 0:
            start = max(0, end - chunk)
            f.seek(start)
            data = f.read(end - start)
            nl = data.rfind(b"\n")
            if nl >= 0:
                f.truncate(start + nl + 1)
                return
            end = start
        f.truncate(0)


def _continue_after(
    path: Path,
    step: int,
    taken: float | None,
    parse: Callable[[bytes], tuple[int, float] | None],
    *,
    header: int = 0,
) -> None:
    """Prepare ``path`` to continue a history from a checkpoint at ``step`` taken at
    time ``taken`` (a resumed run): keep the first ``header`` lines and every complete
    line published before the checkpoint; drop the lines of later steps, those of
    ``step`` itself published after ``taken``, and a torn last line. ``parse`` reads a
    line's step and time (None: keep the line). The file is rewritten (crash-safely)
    only when something is dropped."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_bytes(b"")
        return

    def after(line: bytes) -> bool:
        parsed = parse(line)
        if parsed is None:
            return False
        line_step, line_time = parsed
        return line_step > step or (
            line_step == step and taken is not None and line_time > taken
        )

    with path.open("rb") as src:
        dropped = False
        for index, line in enumerate(src):
            if not line.endswith(b"\n") or (index >= header and after(line)):
                dropped = True  # a torn last line, or one to drop
                break
    if not dropped:
        return

    def keep(dst: io.BufferedWriter) -> None:
        with path.open("rb") as src:
            for index, line in enumerate(src):
                if not line.endswith(b"\n"):
                    break
                if index < header or not after(line):
                    dst.write(line)

    replace_atomically(path, keep)


def _complete_text(path: str | os.PathLike[str]) -> bytes:
    data = Path(path).read_bytes()
    return data[: data.rfind(b"\n") + 1]


def _plain(value: Any) -> Any:
    """Hyperparameters as YAML/JSON take them: tuples as lists, mappings as dicts."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _have_yaml() -> bool:
    return importlib.util.find_spec("yaml") is not None


def write_hparams_file(directory: str | os.PathLike[str], hparams: Mapping[str, Any]) -> Path:
    """Write ``hparams`` to ``directory/hparams.yaml`` (with PyYAML installed), else to
    ``directory/hparams.json``, atomically; returns the path written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    plain = _plain(hparams)
    if _have_yaml():
        path, data = directory / "hparams.yaml", msgspec.yaml.encode(plain)
    else:
        path, data = directory / "hparams.json", msgspec.json.format(msgspec.json.encode(plain))
    replace_atomically(path, lambda f: f.write(data))
    return path


#: The folder under ``save_dir`` that the file loggers write their versions into.
DEFAULT_NAME = "loopbus_logs"


def _check_level(owner: str, option: str, value: Any, *, allow_int: bool) -> None:
    ok = isinstance(value, str) or (
        allow_int and isinstance(value, int) and not isinstance(value, bool) and value >= 0
    )
    if not ok or (isinstance(value, str) and (value in (".", "..") or "\0" in value)):
        what = "a folder name, a number >= 0 or None" if allow_int else "a folder name"
        raise ValueError(f"{owner}({option}=...) must be {what}, got {value!r}.")


def save_dir_of(owner: str, save_dir: str | os.PathLike[str] | None) -> Path | None:
    """A file logger's ``save_dir``, checked (a local path); None: the run folder."""
    if save_dir is None:
        return None
    return Path(check_local_path("save_dir", save_dir, owner=owner))


def _versions(parent: Path) -> list[int]:
    """The N of the ``version_N`` folders in ``parent``."""
    try:
        names = [entry.name for entry in parent.iterdir() if entry.is_dir()]
    except OSError:
        return []
    prefix = "version_"
    return [int(n[len(prefix) :]) for n in names if n.startswith(prefix) and n[len(prefix) :].isdigit()]


class VersionedDir:
    """Lightning's layout of a file logger's output: ``save_dir/name/version_N``.

    ``version=None`` takes the next free N (0, 1, ...) when the logger first needs its
    folder, or the newest existing one when it continues a history (``mode="a"``, or a
    resumed ``fit``); an int N is ``version_N``, a string is the folder's name; ``""``
    for ``name`` or ``version`` drops that level. A version is taken when it holds this
    kind of logger's output (:meth:`_holds_output`), so the CSV and JSONL loggers of one
    run given the same folder write side by side into one ``version_N``.

    Given no ``save_dir``, the logger writes straight into the trainer's run folder
    (``Trainer(root_dir=...)``: ``trainer.run_dir``, known when a stage starts), where
    the trainer writes ``run.json``."""

    _root: Path | None
    _name: str
    _version: int | str | None
    _owner: str = ""
    _follows_run: bool = False
    #: The file this logger writes in its folder (what marks a version as taken).
    filename: str = ""

    def _init_dir(
        self, owner: str, save_dir: Path | None, name: str, version: int | str | None
    ) -> None:
        self._owner = owner
        self._follows_run = save_dir is None
        if save_dir is None:
            if name != DEFAULT_NAME or version is not None:
                raise ValueError(
                    f"{owner}(name=..., version=...) need a save_dir: given none, the logger "
                    "writes straight into the trainer's run folder (Trainer(root_dir=..., "
                    "name=..., version=...) names it)."
                )
            self._root, self._name, self._version = None, "", ""
            return
        _check_level(owner, "name", name, allow_int=False)
        if version is not None:
            _check_level(owner, "version", version, allow_int=True)
        self._root, self._name, self._version = save_dir, name, version

    @property
    def in_run_dir(self) -> bool:
        """Whether the logger writes into the trainer's run folder (no ``save_dir``)."""
        return self._follows_run

    async def start(self, trainer: TrainerView, stage: str, task_group: TaskGroup) -> None:
        self._bind_run_dir(trainer)
        await super().start(trainer, stage, task_group)  # type: ignore[misc]

    def _bind_run_dir(self, trainer: TrainerView) -> None:
        """Given no ``save_dir``: write into ``trainer.run_dir`` (an error without one)."""
        if not self._follows_run:
            return
        run_dir = getattr(trainer, "run_dir", None)
        if run_dir is None:
            raise MisconfigurationError(
                f"{self._owner}() was given no save_dir and the trainer has no run folder to "
                f"write into: pass {self._owner}('logs'), or give the trainer one with "
                "Trainer(root_dir='runs')."
            )
        self._root = Path(run_dir)

    def _continues(self) -> bool:
        """Whether the logger continues an earlier history (its newest version)."""
        return getattr(self, "mode", "w") == "a" or getattr(self, "resume_step", None) is not None

    def _holds_output(self, folder: Path) -> bool:
        """Whether ``folder`` (a ``version_N``) holds this logger's output already."""
        return (folder / self.filename).exists()

    @property
    def save_dir(self) -> Path:
        """The folder the versions are written under (``name`` inside it); given none,
        the trainer's run folder, once a stage has started."""
        if self._root is None:
            raise RuntimeError(
                f"{self._owner} was given no save_dir: it writes into the trainer's run "
                "folder (trainer.run_dir), known once a stage has started."
            )
        return self._root

    @property
    def name(self) -> str:
        """The experiment's folder inside :attr:`save_dir` (``""``: none)."""
        return self._name

    @property
    def version(self) -> int | str:
        """This logger's version: chosen when first needed (see the class docstring)."""
        if self._version is None:
            parent = self._root / self._name
            taken = [n for n in _versions(parent) if self._holds_output(parent / f"version_{n}")]
            if not taken:
                self._version = 0
            else:
                self._version = max(taken) if self._continues() else max(taken) + 1
        return self._version

    @property
    def log_dir(self) -> Path:
        """The folder this logger writes into: ``save_dir/name/version_N``."""
        version = self.version
        level = f"version_{version}" if isinstance(version, int) else version
        return self.save_dir / self._name / level

    def write_run_info(self, stage: str, resume_step: int | None) -> None:
        """Write :data:`RUN_INFO` in :attr:`log_dir`: which experiment and version the
        records beside it belong to (worker thread, when the destination opens). The
        loggers of one run that share a folder write the same facts; in the trainer's run
        folder the trainer writes it (with the same keys, and more)."""
        if self.in_run_dir:
            return
        info = {
            "name": self._name,
            "version": self.version,
            "stage": stage,
            "resumed_from_step": resume_step,
        }
        folder = self.log_dir
        folder.mkdir(parents=True, exist_ok=True)
        data = msgspec.json.format(msgspec.json.encode(info))
        replace_atomically(folder / RUN_INFO, lambda f: f.write(data + b"\n"))


#: The file in a logger's version folder that names the experiment and the version.
RUN_INFO = "run.json"


def read_run_info(log_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """What :meth:`VersionedDir.write_run_info` wrote in ``log_dir``: the experiment's
    ``name``, the ``version``, the ``stage`` and ``resumed_from_step`` of the run that
    wrote the records there."""
    path = Path(log_dir) / RUN_INFO
    try:
        info = msgspec.json.decode(path.read_bytes())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{path} does not exist: {os.fspath(log_dir)!r} is not a logger's version "
            "folder (save_dir/name/version_N), or no run has opened it yet."
        ) from None
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path} is not the run information a logger writes: {exc}") from None
    if not isinstance(info, dict):
        raise ValueError(f"{path} is not the run information a logger writes: not an object.")
    return info
