"""Reading the logs loopbus's file loggers write, from where the last read stopped.

Each reader follows one file (or, for TensorBoard, the event files of one folder): every
:meth:`read` returns the points added since the previous one as a :class:`Chunk`. A file
replaced by another (the CSV logger rewrites its file when a record name appears, a
resumed run cuts the lines after its checkpoint) is read again from its start, and the
chunk says so (``reset``). Only whole lines are read: a line still being written waits
for the next read.

* ``records.jsonl`` (``JSONLLogger``): every record with its step, epoch, time and value
  (``"nan"``, ``"inf"``, ``"-inf"`` for the floats JSON has no word for);
* ``metrics.csv`` (``CSVLogger``): ``step,epoch,time`` and a column per record name;
* ``events.out.tfevents.*`` (``TensorBoardLogger``, or any TensorBoard writer): scalars
  read with TensorBoard's own event-file reader, every point (the ``tensorboard``
  extra); a purge marker at step N (a resumed run) drops the earlier points from N on.

Imports the base layer only (and ``tensorboard`` when an event file is read).
"""

from __future__ import annotations

import math
import os
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import msgspec

from ._columns import header, parse

__all__ = ["CSV", "JSONL", "TB_PREFIX", "Chunk", "LogReader", "reader_for", "reader_for_file"]

#: The file names the loggers write (and a TensorBoard event file's prefix).
JSONL = "records.jsonl"
CSV = "metrics.csv"
TB_PREFIX = "events.out.tfevents."
_TEXT = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}
#: Bytes read from a growing file at once.
_BLOCK = 16 * 1024 * 1024


@dataclass
class Chunk:
    """What a read found: ``points[name] = (steps, times, values)``, the epoch ends seen
    (``epoch -> (step, time)`` of its last point), purges (``(step, time)``: drop the
    points from that step on, a resumed run), and ``reset``: forget everything read
    before (the file was replaced)."""

    points: dict[str, tuple[list[int], list[float], list[Any]]] = field(default_factory=dict)
    #: Points read as columns at once (numpy arrays): name -> (steps, times, values).
    arrays: dict[str, tuple[Any, Any, Any]] = field(default_factory=dict)
    epochs: dict[int, tuple[int, float]] = field(default_factory=dict)
    purges: list[tuple[int, float]] = field(default_factory=list)
    reset: bool = False
    #: Record names the file has whose points are not read at all yet (None: the reader
    #: reads every name at once).
    pending: set[str] | None = None

    def add(self, name: str, step: int, time: float, value: Any) -> None:
        columns = self.points.get(name)
        if columns is None:
            columns = self.points[name] = ([], [], [])
        columns[0].append(step)
        columns[1].append(time)
        columns[2].append(value)

    def __bool__(self) -> bool:
        return bool(self.points or self.arrays or self.epochs or self.purges or self.reset)


class LogReader:
    """Follows one log file; subclasses parse its lines."""

    kind = ""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._identity: tuple[int, int] | None = None  # (device, inode) of the file read
        self._offset = 0
        self._size = 0
        self._rest = b""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {str(self.path)!r} at {self._offset}>"

    def read(self, names: Collection[str] | None = None) -> Chunk:
        """The points written since the last read (all of them the first time); a reader
        that can read some record ``names`` first (:class:`CsvReader`) reads only those,
        the others read every name."""
        chunk = Chunk()
        try:
            with self.path.open("rb") as f:
                stat = os.fstat(f.fileno())
                identity = (stat.st_dev, stat.st_ino)
                if identity != self._identity or stat.st_size < self._offset:
                    chunk.reset = self._identity is not None
                    self._identity, self._offset, self._rest = identity, 0, b""
                    self._restart()
                self._size = stat.st_size
                if stat.st_size == self._offset:
                    return chunk
                f.seek(self._offset)
                data = f.read(_BLOCK)
        except FileNotFoundError:
            return chunk
        self._offset += len(data)
        data = self._rest + data
        cut = data.rfind(b"\n") + 1
        self._rest = data[cut:]
        if cut:
            self._parse(data[:cut], chunk)
        return chunk

    def more(self, names: Collection[str] | None = None) -> bool:
        """Whether the file held more than the last read took."""
        return self._offset < self._size

    def _restart(self) -> None:
        """The file is read from its start again."""

    def _parse(self, lines: bytes, chunk: Chunk) -> None:
        raise NotImplementedError


class _Line(msgspec.Struct):
    name: str
    value: float | int | bool | str
    step: int = 0
    epoch: int = 0
    time: float = 0.0


_LINES = msgspec.json.Decoder(_Line)


class JsonlReader(LogReader):
    """``records.jsonl``: one record a line."""

    kind = "jsonl"

    def _parse(self, lines: bytes, chunk: Chunk) -> None:
        try:
            records = _LINES.decode_lines(lines)
        except msgspec.DecodeError:  # a line of another kind: read line by line
            records = []
            for line in lines.splitlines():
                try:
                    records.append(_LINES.decode(line))
                except msgspec.DecodeError:
                    continue
        epochs = chunk.epochs
        for r in records:
            value = r.value
            if type(value) is str:
                value = _TEXT.get(value)
                if value is None:
                    continue
            chunk.add(r.name, r.step, r.time, value)
            epochs[r.epoch] = (r.step, r.time)


class CsvReader(LogReader):
    """``metrics.csv``: ``step,epoch,time``, then a column per record name, read by
    columns (:mod:`._columns`): each column from where it was last read, so that the
    columns a page asks for are read before the others (:meth:`read`)."""

    kind = "csv"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._names: list[str] | None = None  # the header's record names
        self._at: dict[str, int] = {}  # name -> the offset its column was read up to
        self._start = 0  # the offset of the first row
        # (offset, file size): where the whole lines ended when a read reached the end.
        self._tail = (0, 0)

    def read(self, names: Collection[str] | None = None) -> Chunk:
        """The points written since the last read of the columns ``names`` (every column:
        None; ``()``: only the header). The chunk's ``pending`` names the columns not read
        at all yet."""
        chunk = Chunk()
        try:
            with self.path.open("rb") as f:
                stat = os.fstat(f.fileno())
                identity = (stat.st_dev, stat.st_ino)
                if identity != self._identity or stat.st_size < max(
                    self._at.values(), default=self._start
                ):
                    chunk.reset = self._identity is not None
                    self._identity, self._names, self._at = identity, None, {}
                self._size = stat.st_size
                if self._names is None and not self._header(f):
                    return chunk
                wanted = self._at if names is None else [n for n in names if n in self._at]
                for offset in sorted({self._at[n] for n in wanted}):
                    self._read_from(f, offset, [n for n in wanted if self._at[n] == offset], chunk)
        except FileNotFoundError:
            return chunk
        chunk.pending = {n for n, at in self._at.items() if at == self._start < self._size}
        return chunk

    def _header(self, f: BinaryIO) -> bool:
        line = f.readline(_BLOCK)
        if not line.endswith(b"\n"):
            return False  # not written whole yet
        self._start = len(line)
        self._names = header(line) or []  # another CSV file: no column is read
        self._at = dict.fromkeys(self._names, self._start)
        return True

    def _read_from(self, f: BinaryIO, offset: int, names: list[str], chunk: Chunk) -> None:
        """Read the columns ``names`` from ``offset`` (a line's start) on, whole lines of
        one block at most."""
        if offset >= self._size:
            return
        f.seek(offset)
        # Exactly what is there (a file is read whole at first): a buffer of the block's
        # size would be allocated for every read, and a slice of it copied again.
        data = f.read(min(_BLOCK, self._size - offset))
        cut = data.rfind(b"\n") + 1
        if offset + len(data) == self._size:
            self._tail = (offset + cut, self._size)  # what follows is being written
        if not cut:
            return
        assert self._names is not None
        rows = parse(memoryview(data)[:cut], self._names, names)
        chunk.arrays.update(rows.arrays)
        chunk.points.update(rows.lists)
        chunk.epochs.update(rows.epochs)
        for name in names:
            self._at[name] = offset + cut

    def more(self, names: Collection[str] | None = None) -> bool:
        """Whether the file holds more than the last read of the columns ``names`` (all:
        None) took."""
        wanted = self._at if names is None else [n for n in names if n in self._at]
        size = self._size
        return self._names is not None and any(
            self._at[n] < size and (self._at[n], size) != self._tail for n in wanted
        )


class EventsReader:
    """The TensorBoard event files of one folder, oldest first, each followed with
    TensorBoard's own reader (every event, not TensorBoard's sampled view)."""

    kind = "tensorboard"

    def __init__(self, folder: Path, files: list[Path]) -> None:
        from tensorboard.backend.event_processing import event_file_loader

        self.path = folder
        self._loader = event_file_loader.LegacyEventFileLoader
        self._loaders: dict[Path, Any] = {}
        self.files = files

    def __repr__(self) -> str:
        return f"<EventsReader {str(self.path)!r} ({len(self.files)} files)>"

    def read(self, names: Collection[str] | None = None) -> Chunk:
        """The points of every name written since the last read."""
        chunk = Chunk()
        for path in sorted(self.files, key=lambda p: p.name):
            loader = self._loaders.get(path)
            if loader is None:
                loader = self._loaders[path] = self._loader(str(path))
            try:
                for event in loader.Load():
                    _event(event, chunk)
            except (OSError, ValueError):  # a file gone, or a torn record: next time
                continue
        return chunk


def _event(event: Any, chunk: Chunk) -> None:
    """Add one TensorBoard event's scalars (or its purge marker) to ``chunk``."""
    if event.HasField("session_log") and event.session_log.status == 1:  # START
        chunk.purges.append((event.step, event.wall_time))
        for steps, times, values in chunk.points.values():  # this chunk's own points
            while steps and steps[-1] >= event.step:
                steps.pop(), times.pop(), values.pop()
        return
    if not event.HasField("summary"):
        return
    for value in event.summary.value:
        kind = value.WhichOneof("value")
        if kind == "simple_value":
            chunk.add(value.tag, event.step, event.wall_time, value.simple_value)
        elif kind == "tensor" and value.metadata.plugin_data.plugin_name == "scalars":
            from tensorboard.util import tensor_util

            number = tensor_util.make_ndarray(value.tensor)
            if number.size == 1:
                chunk.add(value.tag, event.step, event.wall_time, number.item())


def have_tensorboard() -> bool:
    """Whether TensorBoard's event-file reader can be imported (the ``tensorboard``
    extra)."""
    try:
        from tensorboard.backend.event_processing import event_file_loader  # noqa: F401
    except ImportError:
        return False
    return True


def reader_for_file(path: Path) -> LogReader | EventsReader | None:
    """The reader of one log file given by its path (by its name: ``*.jsonl``, ``*.csv``
    or a TensorBoard event file)."""
    name = path.name
    if name.endswith(".jsonl"):
        return JsonlReader(path)
    if name.endswith(".csv"):
        return CsvReader(path)
    if name.startswith(TB_PREFIX) and have_tensorboard():
        return EventsReader(path.parent, [path])
    return None


def reader_for(folder: Path, names: set[str]) -> LogReader | EventsReader | None:
    """The reader of a run folder holding the files ``names``: its JSONL file first (the
    most exact), then its CSV file, then its event files (None when none is there)."""
    if JSONL in names:
        return JsonlReader(folder / JSONL)
    if CSV in names:
        return CsvReader(folder / CSV)
    events = [folder / n for n in names if n.startswith(TB_PREFIX)]
    if events and have_tensorboard():
        return EventsReader(folder, events)
    return None
