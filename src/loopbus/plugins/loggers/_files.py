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
from typing import Any

import msgspec

from loopbus import replace_atomically

__all__ = ["write_hparams_file"]

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
