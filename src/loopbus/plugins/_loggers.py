"""Loggers: put records to files, written off the step's path.

Every logger is a queued subscriber of the records addressed to ``"loggers"``. Its
handler only appends the record to a batch; a writer thread of its own writes the batch
at most every ``flush_interval`` seconds (sooner when it is full), so neither the step nor
the event loop ever waits on file I/O, and a slow destination overlaps with training.
Back-pressure is the bus's: when the batch is full the handler waits for the writer, the
subscription's queue fills, and then its ``overflow`` policy applies (``"block"``: the
step waits, nothing is lost; ``"drop"``: the record is dropped and counted on the
subscription).

Writes are whole lines and each batch is flushed to the operating system, so a run that
is killed leaves every fully written line readable; :func:`read_csv` and
:func:`read_jsonl` ignore a torn last line.
"""

from __future__ import annotations

import csv
import io
import math
import os
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import anyio
import anyio.to_thread
import msgspec

from loopbus import Plugin, PutRecord, check_choice, check_int, check_number, on

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from loopbus import Trainer

__all__ = ["CSVLogger", "JSONLLogger", "Logger", "decode_records", "read_csv", "read_jsonl"]

Value = float | int | bool

_OVERFLOWS = {"block": "the step waits for the logger", "drop": "drop and count"}
_FILE_MODES = {"w": "start a new file", "a": "append to an existing one, as when resuming"}


class Logger(Plugin):
    """Base of loggers: batches put records and writes them from a thread of its own.

    Subclasses implement :meth:`write` and, as needed, :meth:`open`, :meth:`flush` and
    :meth:`close`. They run off the event loop (the writer thread, or a worker thread for
    ``open`` and ``close``), one at a time, never concurrently with each other, so they
    may block (a file, a socket, a database)::

        class PrintLogger(Logger):
            def write(self, records):
                for r in records:
                    print(f"step {r.step}: {r.name} = {r.value}")

    The writer writes a batch at most every ``flush_interval`` seconds (sooner when it
    holds ``buffer`` records), so a record waits about that long at most; ``buffer``
    bounds both the subscription's queue and the batch; ``overflow`` is what a full queue
    does to the step (``"block"`` waits, ``"drop"`` drops and counts). Everything is
    written, flushed and closed when the stage ends, however it ends.
    """

    destination: ClassVar[str] = "loggers"
    #: Acts on rank 0 only in a distributed run.
    ranks: ClassVar[Literal["all", "zero"]] = "zero"
    #: Left out by ``Trainer(fast_dev_run=...)``, which writes no log files.
    writes_files: ClassVar[bool] = True
    mode: ClassVar[Literal["inline", "queued"]] = "queued"

    def __init__(
        self,
        *,
        flush_interval: float = 0.5,
        buffer: int = 1024,
        overflow: Literal["block", "drop"] = "block",
    ) -> None:
        name = type(self).__name__
        self.flush_interval = check_number(
            "flush_interval", flush_interval, minimum=0, owner=name, what="a number of seconds"
        )
        self.batch_size = check_int("buffer", buffer, owner=name)
        check_choice("overflow", overflow, _OVERFLOWS, owner=name)
        self.overflow_policy: Literal["block", "drop"] = overflow
        self._pending: deque[PutRecord] = deque()
        self._writer_idle = False
        self._is_open = False
        self._closing = False
        self._error: BaseException | None = None
        self._error_raised = False
        lock = threading.Lock()
        self._has_work = threading.Condition(lock)
        self._has_room = threading.Condition(lock)
        self._thread: threading.Thread | None = None

    def subscription_defaults(self) -> dict[str, Any]:
        defaults = super().subscription_defaults()
        defaults["buffer"] = self.batch_size
        defaults["overflow"] = self.overflow_policy
        return defaults

    # ------------------------------------------------------------ to implement
    def open(self, stage: str) -> None:
        """Prepare the destination (called in a worker thread when a stage starts)."""

    def write(self, records: Sequence[PutRecord]) -> None:
        """Write a batch of records, in the order they were put (worker thread)."""
        raise NotImplementedError(f"{type(self).__name__} must implement write(records).")

    def flush(self) -> None:
        """Push what :meth:`write` buffered to the operating system (worker thread)."""

    def close(self) -> None:
        """Flush and release the destination at the end of the stage (worker thread,
        or the calling thread when a stage is torn down before it started)."""

    # ------------------------------------------------------------ machinery
    async def start(self, trainer: Trainer, stage: str, task_group: TaskGroup) -> None:
        await anyio.to_thread.run_sync(self.open, stage)
        self._pending.clear()
        self._closing = False
        self._error = None
        self._error_raised = False
        self._writer_idle = False
        self._thread = threading.Thread(
            target=self._run_writer, name=f"loopbus {type(self).__name__} writer", daemon=True
        )
        self._thread.start()
        self._is_open = True

    @on(PutRecord)
    async def receive(self, record: PutRecord) -> None:
        """Add ``record`` to the writer's batch; wait while the batch is full."""
        pending = self._pending
        pending.append(record)  # atomic: the writer thread pops from the other end
        if self._writer_idle or len(pending) >= self.batch_size:
            await self._wake_writer()

    async def _wake_writer(self) -> None:
        self._raise_if_failed()
        with self._has_work:
            if self._error is None:
                self._writer_idle = False  # one wake-up is enough
            self._has_work.notify()
        if len(self._pending) >= self.batch_size:
            await anyio.to_thread.run_sync(self._wait_for_room)
            self._raise_if_failed()

    def _wait_for_room(self) -> None:
        with self._has_room:
            while len(self._pending) >= self.batch_size and self._error is None:
                self._has_room.wait()

    def _raise_if_failed(self) -> None:
        error = self._error
        if error is not None and not self._error_raised:
            self._error_raised = True
            raise RuntimeError(f"{type(self).__name__} could not write: {error}") from error

    def _run_writer(self) -> None:
        """The writer thread: a batch at most every ``flush_interval`` seconds, sooner when
        it is full; it ends when the stage stops and everything is written."""
        pending, popleft = self._pending, self._pending.popleft
        has_work, has_room = self._has_work, self._has_room
        interval, batch_size = self.flush_interval, self.batch_size
        last = -math.inf
        try:
            while True:
                with has_work:
                    if not pending and not self._closing:
                        # Idle: the next record's handler wakes us (and only that one).
                        self._writer_idle = True
                        while not pending and not self._closing:
                            has_work.wait()
                        self._writer_idle = False
                    while not self._closing and len(pending) < batch_size:
                        delay = last + interval - time.monotonic()
                        if delay <= 0:
                            break
                        has_work.wait(delay)  # let a batch gather; a full one wakes us
                    closing = self._closing
                n = len(pending)
                if not n and closing:
                    return
                batch = [popleft() for _ in range(n)]
                with has_room:
                    has_room.notify_all()
                last = time.monotonic()
                self.write(batch)
                self.flush()
        except BaseException as exc:
            with has_work:
                self._error = exc
                self._writer_idle = True  # every record now takes the path that reports it
                pending.clear()
                has_room.notify_all()

    async def stop(self, trainer: Trainer, stage: str) -> None:
        if not self._is_open:
            return
        with self._has_work:
            self._closing = True
            self._has_work.notify()
        thread = self._thread
        if thread is not None:
            await anyio.to_thread.run_sync(thread.join)
            self._thread = None
        self._is_open = False
        await anyio.to_thread.run_sync(self.close)
        self._raise_if_failed()

    def teardown(self, trainer: Trainer, stage: str) -> None:
        if not self._is_open:
            return
        # The stage ended before stop() could run: finish writing here.
        self._is_open = False
        thread = self._thread
        if thread is not None:
            with self._has_work:
                self._closing = True
                self._has_work.notify()
            thread.join()
            self._thread = None
        self.close()


# ---------------------------------------------------------------- shared file helpers
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


def _complete_text(path: str | os.PathLike[str]) -> bytes:
    data = Path(path).read_bytes()
    return data[: data.rfind(b"\n") + 1]


# ---------------------------------------------------------------- CSV
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


class CSVLogger(Logger):
    """Writes one row per step: the records put at that step, a column per name.

    ``CSVLogger("runs/exp1")`` writes ``runs/exp1/metrics.csv`` with the columns
    ``step``, ``epoch``, ``time`` (of the row's first record), then one column per record
    name in the order the names first appeared. A row is closed when a record of another
    step arrives or when a name repeats within the step (a per-batch validation loss, for
    example): then a second row with the same step follows, so no record is lost.

    How the header grows: when a batch brings names that have no column yet, the file is
    rewritten once through a temporary file and an atomic rename: the new header, then
    every old row unchanged but for one empty cell per new column. Columns are only ever
    appended, so an old row keeps each value under the same heading; a crash during the
    rewrite leaves the old file intact. With ``mode="a"`` (resuming) an existing file's
    columns are kept and new rows appended. Read it back with :func:`read_csv` (or
    pandas).
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        *,
        filename: str = "metrics.csv",
        mode: Literal["w", "a"] = "w",
        flush_interval: float = 0.5,
        buffer: int = 1024,
        overflow: Literal["block", "drop"] = "block",
    ) -> None:
        super().__init__(flush_interval=flush_interval, buffer=buffer, overflow=overflow)
        check_choice("mode", mode, _FILE_MODES, owner="CSVLogger")
        self.path = Path(save_dir) / filename
        self.file_mode = mode
        self._opened = False
        self._file: io.TextIOWrapper | None = None
        self._columns: list[str] = []
        self._column_of: dict[str, str] = {}
        self._header_written = False
        self._row: dict[str, Value] = {}
        self._row_key: tuple[int, int] = (0, 0)
        self._row_time = 0.0

    def __repr__(self) -> str:
        return f"CSVLogger({str(self.path)!r})"

    def open(self, stage: str) -> None:
        append = self._opened or self.file_mode == "a"
        _prepare_file(self.path, append)
        if not self._opened:
            self._columns, self._column_of, self._header_written = [], {}, False
            if append and self.path.stat().st_size:
                with self.path.open(newline="", encoding="utf-8") as f:
                    header = next(csv.reader(f), [])
                if list(header[: len(_FIXED)]) != list(_FIXED):
                    raise ValueError(
                        f"{self.path} does not start with the header {','.join(_FIXED)}, so "
                        "it was not written by CSVLogger; choose another file or mode='w'."
                    )
                self._columns = list(header[len(_FIXED) :])
                self._column_of = {c: c for c in self._columns}
                self._header_written = True
        self._opened = True
        self._file = self.path.open("a", newline="", encoding="utf-8")

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
        self._columns.extend(new)
        if not self._header_written:
            return  # the header is written with the first row
        f = self._file
        assert f is not None
        f.flush()
        f.close()
        self._file = None
        pad = "," * len(new)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with (
            self.path.open(newline="", encoding="utf-8") as src,
            tmp.open("w", newline="", encoding="utf-8") as dst,
        ):
            src.readline()  # the old header (names never contain a newline)
            self._write_header(dst)
            for line in src:
                if line.endswith("\n"):
                    dst.write(line[:-1] + pad + "\n")
            dst.flush()
            os.fsync(dst.fileno())
        os.replace(tmp, self.path)
        self._file = self.path.open("a", newline="", encoding="utf-8")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is None:
            return
        row = self._row
        if row:
            self._row = {}
            step, epoch = self._row_key
            self._emit([(step, epoch, self._row_time, row)], [])
        self._file.close()
        self._file = None


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


# ---------------------------------------------------------------- JSON lines
_NONFINITE = {math.inf: "inf", -math.inf: "-inf"}


def _wire(record: PutRecord) -> PutRecord:
    value = record.value
    if type(value) is float and not math.isfinite(value):
        # JSON has no literal for these; write a string that read_jsonl turns back.
        text = _NONFINITE.get(value, "nan")
        return msgspec.structs.replace(record, value=text)
    return record


class JSONLLogger(Logger):
    """Writes each put record as one line of JSON (msgspec-encoded :class:`PutRecord`,
    tagged ``"type": "PutRecord"``) to ``save_dir/records.jsonl``.

    Non-finite floats, which JSON cannot represent, are written as the strings ``"nan"``,
    ``"inf"`` and ``"-inf"``. :func:`read_jsonl` decodes the file back into
    :class:`PutRecord` objects equal to the ones that were put.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str],
        *,
        filename: str = "records.jsonl",
        mode: Literal["w", "a"] = "w",
        flush_interval: float = 0.5,
        buffer: int = 1024,
        overflow: Literal["block", "drop"] = "block",
    ) -> None:
        super().__init__(flush_interval=flush_interval, buffer=buffer, overflow=overflow)
        check_choice("mode", mode, _FILE_MODES, owner="JSONLLogger")
        self.path = Path(save_dir) / filename
        self.file_mode = mode
        self._opened = False
        self._file: io.BufferedWriter | None = None
        self._encoder = msgspec.json.Encoder()

    def __repr__(self) -> str:
        return f"JSONLLogger({str(self.path)!r})"

    def open(self, stage: str) -> None:
        _prepare_file(self.path, self._opened or self.file_mode == "a")
        self._opened = True
        self._file = self.path.open("ab")

    def write(self, records: Sequence[PutRecord]) -> None:
        assert self._file is not None
        self._file.write(self._encoder.encode_lines([_wire(r) for r in records]))

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


_DECODER = msgspec.json.Decoder(PutRecord, strict=False)


def decode_records(lines: Iterable[bytes]) -> list[PutRecord]:
    """Decode JSON lines written by :class:`JSONLLogger` into :class:`PutRecord`\\ s."""
    decode = _DECODER.decode
    return [decode(line) for line in lines if line.strip()]


def read_jsonl(path: str | os.PathLike[str]) -> list[PutRecord]:
    """Read a :class:`JSONLLogger` file back into :class:`PutRecord`\\ s, in the order they
    were put. A torn last line (from a killed run) is ignored; any other line that does
    not decode raises ``msgspec.DecodeError`` naming the problem."""
    return decode_records(_complete_text(path).splitlines())
