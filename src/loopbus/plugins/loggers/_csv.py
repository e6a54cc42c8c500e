"""``CSVLogger``: a row per step, a column per record name; and :func:`read_csv`."""

from __future__ import annotations

import contextlib
import csv
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.to_thread

from loopbus import (
    PutRecord,
    check_choice,
    naming_errors,
    replace_atomically,
)

from ._base import Logger
from ._files import (
    _FILE_MODES,
    DEFAULT_NAME,
    VersionedDir,
    _complete_text,
    _continue_after,
    _prepare_file,
    save_dir_of,
    write_hparams_file,
)

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from loopbus import TrainerView

__all__ = ["CSVLogger", "read_csv"]

Value = float | int | bool

_FIXED = ("step", "epoch", "time")


def _parse_cell(text: str) -> Value:
    if text == "True":
        return True
    if text == "False":
        return False
    try:
        return int(text)
    except ValueError:
        return float(text)


def _csv_step_time(line: bytes) -> tuple[int, float] | None:
    cells = line.split(b",", 3)
    try:
        return int(cells[0]), float(cells[2])
    except (ValueError, IndexError):
        return None


class CSVLogger(VersionedDir, Logger):
    """Writes one row per step: the records put at that step, a column per name.

    ``CSVLogger("runs")`` writes ``runs/loopbus_logs/version_0/metrics.csv`` (the next
    run ``version_1``, and so on: see :attr:`log_dir`; ``name=""`` and ``version=""``
    write straight into ``save_dir``) with the columns
    ``step``, ``epoch``, ``time`` (of the row's first record), then one column per record
    name in the order the names first appeared. A row is closed when a record of another
    step arrives or when a name repeats within the step (a per-batch validation loss, for
    example): then a second row with the same step follows, so no record is lost.

    How the header grows: when a batch brings names that have no column yet, the file is
    rewritten once through a temporary file and an atomic rename: the new header, then
    every old row unchanged but for one empty cell per new column. Columns are only ever
    appended, so an old row keeps each value under the same heading; a crash during the
    rewrite leaves the old file intact.

    ``mode="w"`` starts a new file with the first stage, ``mode="a"`` appends to an
    existing one; a resumed ``fit`` (``ckpt_path=...``) always continues the file,
    dropping the rows of steps after the checkpoint's. The module's hyperparameters go
    to ``hparams.yaml`` beside it. Read it back with :func:`read_csv` (or pandas).
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str] | None = None,
        *,
        filename: str = "metrics.csv",
        name: str = DEFAULT_NAME,
        version: int | str | None = None,
        mode: Literal["w", "a"] = "w",
        flush_interval: float = 0.5,
        buffer: int = 1024,
        overflow: Literal["block", "drop"] = "block",
    ) -> None:
        super().__init__(flush_interval=flush_interval, buffer=buffer, overflow=overflow)
        check_choice("mode", mode, _FILE_MODES, owner="CSVLogger")
        self._init_dir("CSVLogger", save_dir_of("CSVLogger", save_dir), name, version)
        self.filename = filename
        self.mode = mode
        self._opened = False
        self._file: io.TextIOWrapper | None = None
        self._columns: list[str] = []
        self._column_of: dict[str, str] = {}
        self._header_written = False
        self._row: dict[str, Value] = {}
        self._row_key: tuple[int, int] = (0, 0)
        self._row_time = 0.0

    def __repr__(self) -> str:
        return f"CSVLogger({str(self._root)!r}, name={self.name!r})"

    @property
    def path(self) -> Path:
        """The CSV file: ``filename`` in :attr:`log_dir`."""
        return self.log_dir / self.filename

    async def start(self, trainer: TrainerView, stage: str, task_group: TaskGroup) -> None:
        self._bind_run_dir(trainer)
        if not self._opened and self.mode == "a":
            # Refuse another program's file before the stage runs (nothing written yet).
            await anyio.to_thread.run_sync(self._read_header)
        await super().start(trainer, stage, task_group)

    def _read_header(self) -> list[str]:
        if not self.path.exists() or not self.path.stat().st_size:
            return []
        with self.path.open(newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), [])
        if list(header[: len(_FIXED)]) != list(_FIXED):
            raise ValueError(
                f"{self.path} does not start with the header {','.join(_FIXED)}, so it was "
                "not written by CSVLogger; choose another file or mode='w'."
            )
        return header

    def open(self, stage: str) -> None:
        resume = self.resume_step
        if resume is not None:
            self._read_header()  # refuse a foreign file before changing it
            _continue_after(self.path, resume, self.resume_time, _csv_step_time, header=1)
        else:
            _prepare_file(self.path, self._opened or self.mode == "a")
        if not self._opened:
            header = self._read_header()
            self._columns = list(header[len(_FIXED) :])
            self._column_of = {c: c for c in self._columns}
            self._header_written = bool(header)
        self._opened = True
        self._file = self.path.open("a", newline="", encoding="utf-8")

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        write_hparams_file(self.path.parent, hparams)

    def _column(self, name: str, new: list[str]) -> str:
        column = name.replace("\r", " ").replace("\n", " ")
        if column in _FIXED:
            column = f"{column} (put)"
        # A record named like a renamed fixed column ("step" and "step (put)") or like
        # another name after the newline replacement must not share its column.
        taken = set(self._column_of.values()) | set(new)
        base, n = column, 2
        while column in taken:
            column = f"{base} ({n})"
            n += 1
        self._column_of[name] = column
        new.append(column)
        return column

    def write(self, records: Sequence[PutRecord]) -> None:
        new: list[str] = []
        rows: list[tuple[int, int, float, dict[str, Value]]] = []
        column_of = self._column_of
        row, (step, epoch), row_time = self._row, self._row_key, self._row_time
        for record in records:
            name = record.name
            column = column_of.get(name) or self._column(name, new)
            if row:
                if record.step != step or record.epoch != epoch or column in row:
                    rows.append((step, epoch, row_time, row))
                    row = {}
                    step, epoch, row_time = record.step, record.epoch, record.time
            else:
                step, epoch, row_time = record.step, record.epoch, record.time
            row[column] = record.value
        self._row, self._row_key, self._row_time = row, (step, epoch), row_time
        with naming_errors(self.path):
            self._emit(rows, new)

    def _emit(self, rows: list[tuple[int, int, float, dict[str, Value]]], new: list[str]) -> None:
        if new:
            self._add_columns(new)
        if not rows:
            return
        f = self._file
        assert f is not None
        if not self._header_written:
            self._write_header(f)
        index = {c: i for i, c in enumerate(self._columns)}
        blank = [""] * len(index)
        lines = []
        for step, epoch, t, row in rows:
            cells = blank.copy()
            for column, value in row.items():
                cells[index[column]] = str(value)  # str(float) is its shortest round trip
            lines.append(f"{step},{epoch},{t!r},{','.join(cells)}\n")
        f.write("".join(lines))

    def _write_header(self, f: io.TextIOWrapper) -> None:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow([*_FIXED, *self._columns])
        f.write(buf.getvalue())
        self._header_written = True

    def _add_columns(self, new: list[str]) -> None:
        if not self._header_written:
            self._columns.extend(new)
            return  # the header is written with the first row
        f = self._file
        assert f is not None
        f.flush()
        f.close()
        self._file = None
        columns = [*self._columns, *new]
        pad = b"," * len(new)

        def rewrite(dst: io.BufferedWriter) -> None:
            header = io.StringIO()
            csv.writer(header, lineterminator="\n").writerow([*_FIXED, *columns])
            dst.write(header.getvalue().encode("utf-8"))
            with self.path.open("rb") as src:
                src.readline()  # the old header (names never contain a newline)
                for line in src:
                    if line.endswith(b"\n"):
                        dst.write(line[:-1] + pad + b"\n")

        try:
            # A failure leaves the old file (and no temporary): the columns stay as they were.
            replace_atomically(self.path, rewrite)
            self._columns = columns
        finally:
            self._file = self.path.open("a", newline="", encoding="utf-8")

    def flush(self) -> None:
        if self._file is not None:
            with naming_errors(self.path):
                self._file.flush()

    def close(self) -> None:
        if self._file is None:
            return
        f, row = self._file, self._row
        self._row = {}
        try:
            with naming_errors(self.path):
                if row and self._error is None:  # after a failure the row may not fit
                    step, epoch = self._row_key
                    self._emit([(step, epoch, self._row_time, row)], [])
                f.close()
        finally:
            self._file = None
            if not f.closed:
                with contextlib.suppress(OSError):
                    f.close()


def read_csv(path: str | os.PathLike[str]) -> list[dict[str, Value]]:
    """Read a :class:`CSVLogger` file back: one dict per row with ``step``, ``epoch``,
    ``time`` and the non-empty cells (ints, floats and bools as they were put). A torn
    last line (from a killed run) is ignored."""
    text = _complete_text(path).decode("utf-8")
    reader = csv.reader(io.StringIO(text, newline=""))
    header = next(reader, None)
    if header is None:
        return []
    out: list[dict[str, Value]] = []
    for cells in reader:
        row: dict[str, Value] = {}
        for name, cell in zip(header, cells, strict=False):  # a short row: empty cells
            if cell != "":
                row[name] = _parse_cell(cell)
        out.append(row)
    return out
