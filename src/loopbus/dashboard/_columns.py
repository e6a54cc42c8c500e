"""Reading rows of a ``metrics.csv`` (``CSVLogger``: ``step,epoch,time`` and a column per
record name) as numpy columns, only the record columns asked for.

:func:`parse` reads whole lines (no header) with pyarrow's CSV reader when pyarrow is
installed (the ``web`` extra): it parses at C speed, converts only the columns asked for,
and rounds floats correctly. Without pyarrow, numpy's ``loadtxt`` reads rows whose every
cell is a number. What neither reads as a column (an empty cell for numpy, a cell that is
no number, rows of another length) is read cell by cell, as the CSV logger wrote it
(:func:`cell`). An empty cell is no point for its name; ``True`` and ``False`` count as 1
and 0; an integer beyond 2**53, which a float64 would change, is kept as a Python int.

Imports numpy (and pyarrow when installed) only.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

try:
    import pyarrow as pa
    import pyarrow.csv as pa_csv
except ImportError:  # pragma: no cover - depends on the installation
    pa = pa_csv = None

__all__ = ["CORES", "Rows", "cell", "header", "parse"]

#: Integers a float64 holds exactly; a column with a larger one keeps Python ints.
_EXACT = 2**53
_FIXED = ["step", "epoch", "time"]


@dataclass
class Rows:
    """What :func:`parse` read: ``arrays[name] = (steps, times, values)`` (numpy arrays;
    the columns without an empty cell share one steps and one times array),
    ``lists[name]``, the same as lists (cells read one by one), and the epoch ends
    (``epoch -> (step, time)`` of its last row)."""

    arrays: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    lists: dict[str, tuple[list[int], list[float], list[Any]]] = field(default_factory=dict)
    epochs: dict[int, tuple[int, float]] = field(default_factory=dict)


def header(line: bytes) -> list[str] | None:
    """The record names of the CSV logger's header line (None: not its file)."""
    names = next(csv.reader(io.StringIO(line.decode("utf-8", errors="replace"))), [])
    return names[3:] if names[:3] == _FIXED else None


def cell(text: str) -> Any:
    """One cell as the CSV logger wrote it: a bool, an int or a float (ValueError: none)."""
    if text == "True":
        return True
    if text == "False":
        return False
    try:
        return int(text)
    except ValueError:
        return float(text)


def parse(lines: bytes | memoryview, names: Sequence[str], wanted: Sequence[str]) -> Rows:
    """The columns ``wanted`` (record names among ``names``, the header's) of ``lines``,
    whole lines of the CSV logger's file after its header (bytes, or a view of them)."""
    index = {name: 3 + i for i, name in reversed(list(enumerate(names)))}
    columns = {name: index[name] for name in dict.fromkeys(wanted) if name in index}
    width = 3 + len(names)
    rows = _arrow(lines, width, columns) if pa_csv is not None else _numpy(lines, width, columns)
    return rows if rows is not None else _by_cell(lines, columns)


def _epochs(steps: np.ndarray, epochs: np.ndarray, times: np.ndarray) -> dict[int, Any]:
    ends = np.flatnonzero(np.r_[epochs[1:] != epochs[:-1], True]) if len(epochs) else []
    return {int(epochs[i]): (int(steps[i]), float(times[i])) for i in ends}


#: The cores this process may run on (the catalog reads as many runs at once).
CORES = max(
    1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
)


def _arrow(lines: bytes | memoryview, width: int, columns: dict[str, int]) -> Rows | None:
    """pyarrow's reader (None when the step, epoch or time column is not whole numbers,
    or a row has another length)."""
    assert pa is not None
    assert pa_csv is not None
    labels = [f"c{i}" for i in range(width)]
    try:
        table = pa_csv.read_csv(
            # The bytes themselves, not a Python file over them: pyarrow then reads them
            # without calling back into Python (and copying) for every block.
            pa.BufferReader(pa.py_buffer(lines)),
            # One block, in this thread: the catalog reads a run per core at once
            # (pyarrow releases the GIL), and a thread pool of pyarrow's own on top of
            # that only costs more (about 15% more CPU time at 200 runs).
            read_options=pa_csv.ReadOptions(
                column_names=labels, use_threads=False, block_size=len(lines) + 1
            ),
            convert_options=pa_csv.ConvertOptions(
                include_columns=[*labels[:3], *(labels[i] for i in set(columns.values()))],
                null_values=[""],
                true_values=["True"],
                false_values=["False"],
                strings_can_be_null=True,
            ),
        )
    except (pa.ArrowInvalid, ValueError):
        return None
    fixed = [table.column(label) for label in labels[:3]]
    if any(c.null_count for c in fixed) or not all(pa.types.is_integer(c.type) for c in fixed[:2]):
        return None
    steps, epochs = (c.to_numpy().astype(np.int64, copy=False) for c in fixed[:2])
    times = fixed[2].to_numpy().astype(np.float64)
    rows = Rows(epochs=_epochs(steps, epochs, times))
    for name, i in columns.items():
        if not _column(rows, name, table.column(labels[i]), steps, times):
            return None
    return rows


def _column(rows: Rows, name: str, column: Any, steps: np.ndarray, times: np.ndarray) -> bool:
    """Add one pyarrow column's points to ``rows`` (False: it holds a number a float64
    would change that pyarrow read as one, to read cell by cell)."""
    kind = column.type
    if pa.types.is_null(kind) or column.null_count == len(column):
        return True
    if column.null_count:
        mask = column.is_valid().to_numpy()
        steps, times, column = steps[mask], times[mask], column.drop_null()
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        found = [
            (i, v) for i, text in enumerate(column.to_pylist()) if (v := _try(text)) is not None
        ]
        keep = [i for i, _ in found]
        rows.lists[name] = (steps[keep].tolist(), times[keep].tolist(), [v for _, v in found])
        return True
    if pa.types.is_boolean(kind):
        values = column.to_numpy().astype(np.float64)
    elif pa.types.is_integer(kind):
        values = column.to_numpy().astype(np.int64, copy=False)
        values = values.astype(object if np.abs(values).max() > _EXACT else np.float64)
    elif pa.types.is_floating(kind):
        values = column.to_numpy().astype(np.float64, copy=False)
        big = np.abs(values) >= _EXACT
        if big.any() and (np.isfinite(values[big]) & (values[big] == np.floor(values[big]))).any():
            return False  # maybe an integer beyond int64 that pyarrow read as a float
    else:
        return False
    rows.arrays[name] = (steps, times, values)
    return True


def _try(text: str) -> Any:
    try:
        return cell(text)
    except ValueError:
        return None


def _numpy(lines: bytes | memoryview, width: int, columns: dict[str, int]) -> Rows | None:
    """numpy's ``loadtxt`` (None when a row has an empty cell, a bool, another length, a
    step that is not whole, or an integer a float64 would change)."""
    try:
        table = np.loadtxt(io.BytesIO(lines), delimiter=",", dtype=np.float64, ndmin=2)
    except ValueError:
        return None
    if table.shape[1] != width or (np.abs(table[:, 3:]) >= _EXACT).any():
        return None
    steps, epochs = table[:, 0].astype(np.int64), table[:, 1].astype(np.int64)
    if not (np.array_equal(steps, table[:, 0]) and np.array_equal(epochs, table[:, 1])):
        return None
    times = table[:, 2].copy()
    rows = Rows(epochs=_epochs(steps, epochs, times))
    for name, i in columns.items():
        rows.arrays[name] = (steps, times, table[:, i].copy())
    return rows


def _by_cell(lines: bytes | memoryview, columns: dict[str, int]) -> Rows:
    """Every row read cell by cell; rows whose step, epoch or time is not a number, and
    cells that are not one, are skipped."""
    rows = Rows()
    for line in bytes(lines).decode("utf-8", errors="replace").splitlines():
        cells = line.split(",")
        try:
            step, epoch, time = int(cells[0]), int(cells[1]), float(cells[2])
        except (ValueError, IndexError):
            continue
        for name, i in columns.items():
            text = cells[i] if i < len(cells) else ""
            value = _try(text) if text else None
            if value is None:
                continue
            found = rows.lists.get(name)
            if found is None:
                found = rows.lists[name] = ([], [], [])
            found[0].append(step)
            found[1].append(time)
            found[2].append(value)
        rows.epochs[epoch] = (step, time)
    return rows
