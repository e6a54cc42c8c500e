"""A run's points, one :class:`Series` per record name, and what the page draws of them.

A series keeps every point as it was logged (step, wall time, value), in columns
(numpy arrays, with the points added since the last read waiting in lists). The page
never gets a sample of them: :func:`lines` reduces the visible range of several series
to the smallest and largest value per pixel column (recomputed on every zoom), and
:func:`scalars` hands out all of them, exact.

Imports numpy and the base layer only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["X_MODES", "Series", "lines", "scalars"]

#: What the x axis can show: the step, seconds since the run's first point, or the wall
#: clock (seconds since the Unix epoch).
X_MODES = ("step", "relative", "wall")
#: Integers a float64 holds exactly; a series with a larger one keeps Python ints.
_EXACT = 2**53
_NONFINITE = {math.inf: "inf", -math.inf: "-inf"}


def _values(values: list[Any]) -> np.ndarray:
    """``values`` as a float64 array, or an object array when a float64 would change
    one (an integer beyond 2**53)."""
    for v in values:
        if type(v) is int and not -_EXACT <= v <= _EXACT:
            return np.array(values, dtype=object)
    return np.array(values, dtype=np.float64)


class Series:
    """Every point of one record name of one run, in the order logged."""

    __slots__ = (
        "_new_steps",
        "_new_times",
        "_new_values",
        "_sort",
        "_steps",
        "_times",
        "_values",
    )

    def __init__(self) -> None:
        self._steps = np.empty(0, np.int64)
        self._times = np.empty(0, np.float64)
        self._values = np.empty(0, np.float64)
        self._new_steps: list[int] = []
        self._new_times: list[float] = []
        self._new_values: list[Any] = []
        self._sort = False

    def __len__(self) -> int:
        return len(self._steps) + len(self._new_steps)

    def __repr__(self) -> str:
        return f"<Series of {len(self)} points>"

    def add(self, step: int, time: float, value: Any) -> None:
        """One point (a bool counts as 0 or 1)."""
        self._new_steps.append(step)
        self._new_times.append(time)
        self._new_values.append(value)

    def extend(self, steps: Sequence[int], times: Sequence[float], values: Sequence[Any]) -> None:
        """Several points, in order (lists, or numpy arrays taken as they are)."""
        if isinstance(values, np.ndarray):
            self.arrays()  # what came before goes first
            if not len(self._values):  # taken as they are (columns of a file share steps)
                self._steps = np.asarray(steps, np.int64)
                self._times = np.asarray(times, np.float64)
                self._values = values
                return
            self._steps = np.concatenate([self._steps, np.asarray(steps, np.int64)])
            self._times = np.concatenate([self._times, np.asarray(times, np.float64)])
            if len(self._values) and values.dtype != self._values.dtype:
                self._values, values = self._values.astype(object), values.astype(object)
            self._values = np.concatenate([self._values, values]) if len(self._values) else values
            return
        self._new_steps.extend(steps)
        self._new_times.extend(times)
        self._new_values.extend(values)

    def insert_early(
        self, steps: Sequence[int], times: Sequence[float], values: Sequence[Any]
    ) -> None:
        """Points logged before some of those already here: put in wall-time order."""
        self.extend(steps, times, values)
        self._sort = True

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(steps, wall times, values)``: every point, as arrays (not to be changed)."""
        if self._new_steps:
            values = _values(self._new_values)
            if values.dtype != self._values.dtype and len(self._values):
                values = values.astype(object)
                self._values = self._values.astype(object)
            self._steps = np.concatenate([self._steps, np.array(self._new_steps, np.int64)])
            self._times = np.concatenate([self._times, np.array(self._new_times, np.float64)])
            self._values = np.concatenate([self._values, values]) if len(self._values) else values
            self._new_steps, self._new_times, self._new_values = [], [], []
        if self._sort:
            order = np.argsort(self._times, kind="stable")
            self._steps, self._times = self._steps[order], self._times[order]
            self._values = self._values[order]
            self._sort = False
        return self._steps, self._times, self._values

    def keep(self, mask: np.ndarray) -> None:
        """Keep only the points where ``mask`` (over :meth:`arrays`) is true."""
        steps, times, values = self.arrays()
        self._steps, self._times, self._values = steps[mask], times[mask], values[mask]

    def first_time(self) -> float | None:
        """The wall time of the first point, if any."""
        if len(self._times):
            return float(self._times[0])
        return self._new_times[0] if self._new_times else None


def _plain(value: Any) -> Any:
    """A value as JSON carries it exactly: non-finite floats as ``"nan"``, ``"inf"``,
    ``"-inf"`` (as the JSONL logger writes them)."""
    if type(value) is float and not math.isfinite(value):
        return _NONFINITE.get(value, "nan")
    return value


def scalars(series: Series) -> dict[str, list[Any]]:
    """Every point of ``series``: ``{"step": [...], "wall_time": [...], "value": [...]}``."""
    steps, times, values = series.arrays()
    listed = values.tolist()
    if not np.isfinite(values.astype(np.float64)).all():
        listed = [_plain(v) for v in listed]
    return {"step": steps.tolist(), "wall_time": times.tolist(), "value": listed}


def x_of(series: Series, mode: str, origin: float | None) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` of a series in x ``mode`` (see :data:`X_MODES`), y as float64; relative
    time counts from ``origin`` (the run's first wall time)."""
    steps, times, values = series.arrays()
    y = values.astype(np.float64)
    if mode == "step":
        return steps.astype(np.float64), y
    if mode == "relative":
        return times - (origin if origin is not None else 0.0), y
    return times, y


def _extremes(bins: np.ndarray, y: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per bin (``0 <= bins < n``): the first-logged and the second-logged of its smallest
    and largest value (NaN where a bin has none, the second NaN where they are one)."""
    first = np.full(n, np.nan)
    second = np.full(n, np.nan)
    if not len(y):
        return first, second
    order = np.lexsort((y, bins))  # by bin, then by value: a bin's min first, max last
    b = bins[order]
    starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
    ends = np.r_[starts[1:], len(b)] - 1
    lo, hi = order[starts], order[ends]
    where = b[starts]
    lo_first = lo <= hi
    first[where] = np.where(lo_first, y[lo], y[hi])
    second[where] = np.where(lo_first, y[hi], y[lo])
    second[where[lo == hi]] = np.nan
    return first, second


def lines(
    data: Sequence[tuple[np.ndarray, np.ndarray]],
    lo: float | None,
    hi: float | None,
    width: int,
) -> dict[str, Any]:
    """What a chart draws of several series (``(x, y)`` each) over ``[lo, hi]`` (None:
    all), ``width`` pixel columns wide: one shared x column and, per series, its smallest
    and largest value in each column in the order they were logged, so every spike and
    dip of every series stays visible at any zoom. Where the series have no more distinct
    x values in the range than two per column, each distinct x is a column of its own
    (exact positions). Also the points in the range, and their 1st and 99th percentile."""
    kept = []
    for x, y in data:
        mask = np.isfinite(y)
        if lo is not None:
            mask &= x >= lo
        if hi is not None:
            mask &= x <= hi
        kept.append((x[mask], y[mask]))
    points = sum(len(x) for x, _ in kept)
    if points == 0:
        return {"x": [], "y": [[] for _ in data], "points": 0, "p": None}
    every = np.concatenate([x for x, _ in kept])
    distinct = np.unique(every)
    if len(distinct) <= 2 * width:
        edges, xs = distinct, distinct
    else:
        start = float(lo if lo is not None else distinct[0])
        stop = float(hi if hi is not None else distinct[-1])
        edges = np.linspace(start, stop, width + 1)[:-1]
        xs = edges
    n = len(edges)
    firsts, seconds = [], []
    for x, y in kept:
        bins = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, n - 1)
        first, second = _extremes(bins, y, n)
        firsts.append(first)
        seconds.append(second)
    pair = np.column_stack([*seconds]) if seconds else np.empty((n, 0))
    has_second = ~np.isnan(pair).all(axis=1)
    step = (xs[1] - xs[0]) / 2 if n > 1 and not np.array_equal(edges, distinct) else 0.0
    x_out = np.column_stack([xs, xs + step]).ravel()
    keep = np.column_stack([np.ones(n, bool), has_second]).ravel()
    ys = []
    for first, second in zip(firsts, seconds, strict=True):
        column = np.column_stack([first, second]).ravel()[keep]
        ys.append([None if math.isnan(v) else v for v in column.tolist()])
    finite = np.concatenate([y for _, y in kept])
    p1, p99 = np.percentile(finite, [1, 99]).tolist()
    return {"x": x_out[keep].tolist(), "y": ys, "points": points, "p": [p1, p99]}
