"""Loggers: put records to files, written off the event loop.

Every logger is a queued subscriber of the records addressed to ``"loggers"``: the step
only hands a record to the subscription's bounded queue. The logger's handler adds it
to a batch and, when the batch is full or ``flush_interval`` seconds have passed since
the last write, writes the batch in a worker thread (``anyio.to_thread``) while the
queue keeps filling; a timer writes a batch that would otherwise wait for the next
record. Back-pressure is the bus's: while a write runs the queue fills, and then its
``overflow`` policy applies (``"block"``: the step waits, nothing is lost; ``"drop"``:
the record is dropped and counted on the subscription). When the stage ends, however
it ends, one path writes what is left, flushes and closes.

Writes are whole lines and each batch is flushed to the operating system, so a run that
is killed leaves every fully written line readable; :func:`read_csv` and
:func:`read_jsonl` ignore a torn last line. A file is rewritten only through a temporary
file, ``fsync`` and an atomic rename, so a crash never loses what was written.

Resuming (``fit(..., ckpt_path=...)``) continues the same files: the lines of steps
after the checkpoint's are dropped (the resumed run writes them again), every earlier
one is kept.
"""

from __future__ import annotations

import contextlib
import csv
import importlib.util
import io
import math
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import anyio
import anyio.to_thread
import msgspec

from loopbus import (
    Delivery,
    Plugin,
    PutRecord,
    check_choice,
    check_int,
    check_json_nesting,
    check_number,
    naming_errors,
    on,
    replace_atomically,
)
from loopbus.events import FitStarted

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from loopbus import Trainer

__all__ = ["CSVLogger", "JSONLLogger", "Logger", "decode_records", "read_csv", "read_jsonl"]

Value = float | int | bool

_OVERFLOWS = {"block": "the step waits for the logger", "drop": "drop and count"}
_FILE_MODES = {"w": "start a new file", "a": "append to an existing one"}
_NO_HPARAMS: Mapping[str, Any] = MappingProxyType({})


class Logger(Plugin):
    """Base of loggers: batches put records and writes them off the event loop.

    Subclasses implement :meth:`write` and, as needed, :meth:`open`, :meth:`flush`,
    :meth:`close` and :meth:`write_hparams`. They run in worker threads, one at a time,
    never concurrently with each other, so they may block (a file, a socket, a
    database)::

        class PrintLogger(Logger):
            def write(self, records):
                for r in records:
                    print(f"step {r.step}: {r.name} = {r.value}")

    A batch is written when it holds ``buffer`` records or ``flush_interval`` seconds
    after the previous write, so a record waits about that long at most; ``buffer``
    bounds both the subscription's queue and the batch; ``overflow`` is what a full queue
    does to the step (``"block"`` waits, ``"drop"`` drops and counts). Everything is
    written, flushed and closed when the stage ends, however it ends.

    :meth:`open` is called when the stage starts; for ``fit`` once it is known whether
    the run resumes from a checkpoint, which :attr:`resume_step` then tells (the
    checkpoint's step; None for a fresh start): a logger that continues a history drops
    what it wrote after that step. :meth:`write_hparams` follows with the module's
    hyperparameters (:attr:`loopbus.Module.hparams`) when it saved any.
    """

    #: Queued, for the loggers destination, on rank 0 only in a distributed run.
    delivery = Delivery(destination="loggers", mode="queued", ranks="zero")
    #: Left out by ``Trainer(fast_dev_run=...)``, which writes no log files.
    writes_files: ClassVar[bool] = True

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
        # This logger's queue: the batch size, and what a full one does.
        self.delivery = type(self).delivery.replace(buffer=self.batch_size, overflow=overflow)
        # Per stage. The batch is filled on the event loop and handed over whole.
        self._batch: list[PutRecord] = []
        self._executor: ThreadPoolExecutor | None = None
        self._in_flight: Future[None] | None = None
        self._due = -math.inf
        self._timer: anyio.CancelScope | None = None
        self._trainer: Trainer | None = None
        self._stage: str | None = None
        self._hparams: Mapping[str, Any] = _NO_HPARAMS
        self._resume_step: int | None = None
        self._resume_time: float | None = None
        self._is_open = False
        self._error: BaseException | None = None
        self._error_raised = False
        self._error_at_close = False

    @property
    def overflow_policy(self) -> Literal["block", "drop"]:
        """Deprecated: ``delivery.overflow``."""
        warnings.warn(
            "Logger.overflow_policy is deprecated; read logger.delivery.overflow.",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.delivery.overflow

    @property
    def resume_step(self) -> int | None:
        """The step of the checkpoint the running ``fit`` resumed from, or None (a fresh
        start, or another stage). Set before :meth:`open` is called."""
        return self._resume_step

    @property
    def resume_time(self) -> float | None:
        """When the checkpoint the running ``fit`` resumed from was taken
        (``time.time()``), if it says: a record of :attr:`resume_step` published later
        (a validation that ran after the checkpoint) is written again by the resumed run.
        """
        return self._resume_time

    # ------------------------------------------------------------ to implement
    def open(self, stage: str) -> None:
        """Prepare the destination (worker thread). For ``fit`` it is called once the
        resume is known: see :attr:`resume_step`."""

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        """Record the module's hyperparameters (worker thread, after :meth:`open`; only
        when the module saved some with ``save_hyperparameters``)."""

    def write(self, records: Sequence[PutRecord]) -> None:
        """Write a batch of records, in the order they were put (worker thread)."""
        raise NotImplementedError(f"{type(self).__name__} must implement write(records).")

    def flush(self) -> None:
        """Push what :meth:`write` buffered to the operating system (worker thread)."""

    def close(self) -> None:
        """Flush and release the destination at the end of the stage (worker thread,
        or the calling thread when a stage is torn down before it could stop)."""

    # ------------------------------------------------------------ machinery
    async def start(self, trainer: Trainer, stage: str, task_group: TaskGroup) -> None:
        self._trainer = trainer
        self._stage = stage
        self._hparams = getattr(trainer.module, "hparams", _NO_HPARAMS)
        self._batch = []
        self._resume_step = self._resume_time = None
        self._error = None
        self._error_raised = False
        self._error_at_close = False
        self._in_flight = None
        self._due = -math.inf
        # One worker thread: writes (and open, close) run off the event loop, one at a
        # time and in the order they were handed over.
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=f"loopbus-{type(self).__name__}")
        if stage != "fit":
            # fit opens at FitStarted, once it is known whether it resumes.
            await self._run(self._open, stage)
        self._timer = anyio.CancelScope()
        task_group.start_soon(self._write_when_due, self._timer)

    async def _run(self, func: Callable[..., Any], *args: Any) -> Any:
        """Run ``func`` in the writer thread after what was handed over before; wait."""
        assert self._executor is not None
        future = self._executor.submit(func, *args)
        await anyio.to_thread.run_sync(wait_futures, [future])
        return future.result()

    @on(FitStarted, mode="inline", priority=1000)
    async def fit_started(self, event: FitStarted) -> None:
        """Open the destination for ``fit``, continuing the history when it resumes."""
        trainer = self._trainer
        if trainer is None or self._executor is None or self._is_open:
            return
        plan = trainer.state.resume
        if plan is not None:
            self._resume_step, self._resume_time = plan.step, plan.created
        await self._run(self._open, "fit")

    def _open(self, stage: str) -> None:
        self.open(stage)
        self._is_open = True
        if self._hparams:
            self.write_hparams(self._hparams)

    @on(PutRecord)
    async def receive(self, record: PutRecord) -> None:
        """Add ``record`` to the batch; hand the batch to the writer thread when it is
        full or due."""
        batch = self._batch
        batch.append(record)
        if len(batch) >= self.batch_size or time.monotonic() >= self._due:
            await self._hand_over()

    async def _hand_over(self) -> None:
        if not self._is_open:
            return  # fit before FitStarted: kept until the destination is open
        in_flight = self._in_flight
        if in_flight is not None and not in_flight.done():
            if len(self._batch) < self.batch_size:
                return  # the writer is busy: the batch grows meanwhile
            # Full while the writer is busy: wait for it. The queue fills meanwhile, and
            # its overflow policy applies.
            await anyio.to_thread.run_sync(wait_futures, [in_flight])
        self._raise_if_failed()
        self._submit()

    def _submit(self) -> None:
        assert self._executor is not None
        batch, self._batch = self._batch, []
        self._in_flight = self._executor.submit(self._write_flushed, batch)
        self._due = time.monotonic() + self.flush_interval

    def _write_flushed(self, batch: list[PutRecord]) -> None:
        """The writer thread: write and flush one batch; keep a failure for the event
        loop to raise (at the next hand-over, or when the stage stops)."""
        if self._error is not None:
            return
        try:
            self.write(batch)
            self.flush()
        except Exception as exc:
            self._error = exc

    def _raise_if_failed(self) -> None:
        error = self._error
        if error is not None and not self._error_raised:
            self._error_raised = True
            message = _failure(type(self).__name__, error, self._error_at_close)
            raise RuntimeError(message) from error

    async def _write_when_due(self, scope: anyio.CancelScope) -> None:
        """Hand over a batch that no further record comes to hand over: checked every
        ``flush_interval`` seconds (every 10 ms at most). Ends when the stage stops."""
        period = max(self.flush_interval, 0.01)
        with scope:
            while True:
                await anyio.sleep(period)
                if scope.cancel_called:
                    # stop() ran between the sleep's end and this task's turn: it hands
                    # what is left to the writer itself, and the executor may be gone.
                    return
                in_flight = self._in_flight
                if (
                    self._batch
                    and self._is_open
                    and (in_flight is None or in_flight.done())
                    and self._error is None
                ):
                    self._submit()

    async def stop(self, trainer: Trainer, stage: str) -> None:
        # The bus drained the queue: every record it accepted is in a batch or written.
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        executor, self._executor = self._executor, None
        if executor is None:
            return
        future = executor.submit(self._finish)
        executor.shutdown(wait=False)
        await anyio.to_thread.run_sync(wait_futures, [future])
        future.result()
        self._raise_if_failed()

    def teardown(self, trainer: Trainer, stage: str) -> None:
        # After stop() this finds nothing left to do; if the stage ended before stop()
        # could run, the same path finishes here.
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)
        self._finish()
        self._trainer = None
        self._stage = None

    def _finish(self) -> None:
        """The one shutdown path: write what is left, flush, close. Idempotent."""
        batch, self._batch = self._batch, []
        try:
            if batch and self._error is None:
                if not self._is_open and self._stage is not None:
                    self._open(self._stage)
                self._write_flushed(batch)
        except Exception as exc:
            self._error = exc
        finally:
            if self._is_open:
                self._is_open = False
                try:
                    self.close()
                except Exception as exc:  # raised by stop(), naming the logger
                    if self._error is None:
                        self._error, self._error_at_close = exc, True


def _failure(name: str, error: BaseException, at_close: bool) -> str:
    """Why a logger failed, for the error the run raises: the file and the cause when
    the file system said (a full disk), else the logger's own exception."""
    what = "finish writing" if at_close else "write"
    if isinstance(error, OSError) and error.filename is not None:
        text = f"{name} could not {what} {error.filename}: {error.strerror or error}"
    else:
        text = f"{name} could not {what}: {error}"
    if at_close:
        text += (
            " (when it closed its file at the end of the stage: the records it still held "
            "are missing; what it wrote before is intact)"
        )
    return text


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


def _csv_step_time(line: bytes) -> tuple[int, float] | None:
    cells = line.split(b",", 3)
    try:
        return int(cells[0]), float(cells[2])
    except (ValueError, IndexError):
        return None


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
    rewrite leaves the old file intact.

    ``mode="w"`` starts a new file with the first stage, ``mode="a"`` appends to an
    existing one; a resumed ``fit`` (``ckpt_path=...``) always continues the file,
    dropping the rows of steps after the checkpoint's. The module's hyperparameters go
    to ``hparams.yaml`` beside it. Read it back with :func:`read_csv` (or pandas).
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
        return f"CSVLogger({str(self.path)!r})"

    async def start(self, trainer: Trainer, stage: str, task_group: TaskGroup) -> None:
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

    ``mode`` and resuming work as for :class:`CSVLogger` (a resumed ``fit`` continues
    the file, dropping the lines of steps after the checkpoint's), and so do the
    hyperparameters (``hparams.yaml`` beside the file).
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
        self.mode = mode
        self._opened = False
        self._file: io.BufferedWriter | None = None
        self._encoder = msgspec.json.Encoder()

    def __repr__(self) -> str:
        return f"JSONLLogger({str(self.path)!r})"

    def open(self, stage: str) -> None:
        resume = self.resume_step
        if resume is not None:
            _continue_after(self.path, resume, self.resume_time, _jsonl_step_time)
        else:
            _prepare_file(self.path, self._opened or self.mode == "a")
        self._opened = True
        self._file = self.path.open("ab")

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        write_hparams_file(self.path.parent, hparams)

    def write(self, records: Sequence[PutRecord]) -> None:
        assert self._file is not None
        with naming_errors(self.path):
            self._file.write(self._encoder.encode_lines([_wire(r) for r in records]))

    def flush(self) -> None:
        if self._file is not None:
            with naming_errors(self.path):
                self._file.flush()

    def close(self) -> None:
        f, self._file = self._file, None
        if f is not None:
            with naming_errors(self.path):
                f.close()


_DECODER = msgspec.json.Decoder(PutRecord, strict=False)


class _StepTime(msgspec.Struct):
    step: int = 0
    time: float = 0.0


_STEP_TIME_DECODER = msgspec.json.Decoder(_StepTime)


def _jsonl_step_time(line: bytes) -> tuple[int, float] | None:
    try:
        decoded = _STEP_TIME_DECODER.decode(check_json_nesting(line))
    except msgspec.DecodeError:
        return None  # not a record: kept as it is
    return decoded.step, decoded.time


def decode_records(lines: Iterable[bytes]) -> list[PutRecord]:
    """Decode JSON lines written by :class:`JSONLLogger` into :class:`PutRecord`\\ s.
    Blank lines are skipped; a line that does not decode, or that nests arrays and
    objects more than 64 levels deep (it is not decoded), raises ``msgspec.DecodeError``
    naming its number (the first line is line 1) and the problem."""
    return _decode_lines(lines, "")


def _decode_lines(lines: Iterable[bytes], where: str) -> list[PutRecord]:
    decode = _DECODER.decode
    records: list[PutRecord] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(decode(check_json_nesting(line)))
        except msgspec.DecodeError as exc:
            raise type(exc)(f"{where}line {number}: {exc}") from None
    return records


def read_jsonl(path: str | os.PathLike[str]) -> list[PutRecord]:
    """Read a :class:`JSONLLogger` file back into :class:`PutRecord`\\ s, in the order they
    were put. A torn last line (from a killed run) is ignored; any other line that does
    not decode, or that nests arrays and objects more than 64 levels deep, raises
    ``msgspec.DecodeError`` naming the file, the line's number and the problem."""
    return _decode_lines(_complete_text(path).splitlines(), f"{os.fspath(path)}, ")
