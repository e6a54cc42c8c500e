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
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import numpy as np

__all__ = ["X_MODES", "Series", "lines", "scalars", "smooth"]

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
        "_smoothed",
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
        # (the values it was computed from, weight, the smoothed line), see smoother().
        self._smoothed: tuple[np.ndarray, float, np.ndarray] | None = None

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

    def smoother(self, weight: float) -> Callable[[], np.ndarray]:
        """A function that returns :func:`smooth` of the values the series holds now
        (float64, in the order of :meth:`arrays`), in any thread (it reads nothing the
        series changes); the line is kept until the series changes (a chart asks again on
        every zoom)."""
        values = self.arrays()[2]
        cached = self._smoothed
        if cached is not None and cached[0] is values and cached[1] == weight:
            line = cached[2]
            return lambda: line

        def compute() -> np.ndarray:
            line = smooth(values.astype(np.float64), weight)
            self._smoothed = (values, weight, line)  # one assignment: whole or not at all
            return line

        return compute

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


def smooth(y: np.ndarray, weight: float) -> np.ndarray:
    """The debiased exponential moving average of ``y`` (float64, in the order logged)
    with ``weight`` (``0 <= weight < 1``; what TensorBoard calls smoothing): over its
    finite values, NaN where ``y`` is not finite. Every point counts, not only those a
    chart draws, so a smoothed line does not change with the zoom or the chart's width."""
    out = np.full(len(y), np.nan)
    finite = np.flatnonzero(np.isfinite(y))
    values = y[finite]
    if weight <= 0 or not len(values):
        out[finite] = values
        return out
    # s[j] = w**j * (w * carry + (1 - w) * cumsum(v[i] * w**-i)) within a block short
    # enough that w**-i stays far from overflowing.
    block = max(1, int(200 / -math.log(weight)))
    smoothed = np.empty(len(values))
    carry = 0.0
    for start in range(0, len(values), block):
        part = values[start : start + block]
        k = np.arange(len(part), dtype=np.float64)
        got = weight**k * (weight * carry + (1 - weight) * np.cumsum(part * weight**-k))
        smoothed[start : start + len(part)] = got
        carry = float(got[-1])
    smoothed /= 1 - weight ** np.arange(1, len(values) + 1, dtype=np.float64)
    out[finite] = smoothed
    return out


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


def _in_range(
    data: Sequence[tuple[np.ndarray, np.ndarray]],
    lo: float | None,
    hi: float | None,
    lines: Sequence[np.ndarray] | None,
) -> tuple[list[tuple[np.ndarray, np.ndarray]], list[np.ndarray]]:
    """The finite points of each series in ``[lo, hi]``, and their values on the series'
    smoothed ``lines`` (if any)."""
    kept, smoothed = [], []
    for i, (x, y) in enumerate(data):
        mask = np.isfinite(y)
        if lo is not None:
            mask &= x >= lo
        if hi is not None:
            mask &= x <= hi
        kept.append((x[mask], y[mask]))
        if lines is not None:
            smoothed.append(lines[i][mask])
    return kept, smoothed


def _ends(bins: np.ndarray, y: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Per bin: the first and the last value of a smoothed line in it (NaN where a bin
    has none, the second NaN where it has one point, as :func:`_extremes`); a smoothed
    line barely moves within a pixel column, and this needs no sort when the points are
    in the order of their x."""
    if len(bins) > 1 and not (bins[1:] >= bins[:-1]).all():
        return _extremes(bins, y, n)
    first = np.full(n, np.nan)
    second = np.full(n, np.nan)
    if not len(y):
        return first, second
    starts = np.flatnonzero(np.r_[True, bins[1:] != bins[:-1]])
    ends = np.r_[starts[1:], len(bins)] - 1
    where = bins[starts]
    first[where] = y[starts]
    second[where] = np.where(ends > starts, y[ends], np.nan)
    return first, second


def _distinct(xs: list[np.ndarray], most: int) -> np.ndarray | None:
    """The distinct values of the arrays ``xs``, sorted; None when there are more than
    ``most`` (one sorted array with that many is enough to tell, without sorting them
    all together)."""
    for x in xs:
        if len(x) > most and bool((x[1:] >= x[:-1]).all()):
            if np.count_nonzero(x[1:] != x[:-1]) + 1 > most:
                return None
    distinct = np.unique(np.concatenate(xs))
    return distinct if len(distinct) <= most else None


def _column(first: np.ndarray, second: np.ndarray, keep: np.ndarray) -> list[float | None]:
    """A series' values of the shared x column: per bin its first value and, where
    ``keep`` says, its second; NaN as None."""
    both = np.column_stack([first, second]).ravel()[keep]
    listed: list[float | None] = both.tolist()
    for i in np.flatnonzero(np.isnan(both)).tolist():
        listed[i] = None
    return listed


def _edges(
    kept: list[tuple[np.ndarray, np.ndarray]], lo: float | None, hi: float | None, width: int
) -> tuple[np.ndarray, tuple[float, float] | None]:
    """The pixel columns' left edges: each distinct x where there are no more than two
    per column (then None), else ``width`` equal columns over the range (then its start
    and stop)."""
    distinct = _distinct([x for x, _ in kept], 2 * width)
    if distinct is not None:
        return distinct, None
    start = float(lo if lo is not None else min(x.min() for x, _ in kept if len(x)))
    stop = float(hi if hi is not None else max(x.max() for x, _ in kept if len(x)))
    return np.linspace(start, stop, width + 1)[:-1], (start, stop)


def _reduce(
    kept: list[tuple[np.ndarray, np.ndarray]],
    edges: np.ndarray,
    on_line: Sequence[np.ndarray] | None,
    keys: Sequence[Any] | None,
    cache: MutableMapping[Any, tuple[np.ndarray, np.ndarray]] | None,
    span: tuple[float, float] | None,
) -> tuple[list[np.ndarray], list[np.ndarray], list[tuple[np.ndarray, np.ndarray]]]:
    """Per series, its first and second value of each column (:func:`_extremes`), and
    those of its smoothed line (``on_line``) when given. Equal columns (``span``) of a
    series whose key is in ``cache`` are taken from there, computed once."""
    n = len(edges)
    firsts, seconds, smooth_pairs = [], [], []
    for i, (x, y) in enumerate(kept):
        key = None if keys is None or span is None else (keys[i], *span, n)
        found = cache.get(key) if cache is not None and key is not None else None
        if found is None or on_line is not None:
            bins = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, n - 1)
            found = _extremes(bins, y, n)
            if cache is not None and key is not None:
                cache[key] = found
            if on_line is not None:  # a bin has a second value of both or of neither
                smooth_pairs.append(_ends(bins, on_line[i], n))
        firsts.append(found[0])
        seconds.append(found[1])
    return firsts, seconds, smooth_pairs


def lines(
    data: Sequence[tuple[np.ndarray, np.ndarray]],
    lo: float | None,
    hi: float | None,
    width: int,
    smoothed: Sequence[np.ndarray] | None = None,
    keys: Sequence[Any] | None = None,
    cache: MutableMapping[Any, tuple[np.ndarray, np.ndarray]] | None = None,
) -> dict[str, Any]:
    """What a chart draws of several series (``(x, y)`` each) over ``[lo, hi]`` (None:
    all), ``width`` pixel columns wide: one shared x column and, per series, its smallest
    and largest value in each column in the order they were logged, so every spike and
    dip of every series stays visible at any zoom. Where the series have no more distinct
    x values in the range than two per column, each distinct x is a column of its own
    (exact positions). Also the points in the range, and their 1st and 99th percentile.
    With ``smoothed`` (per series, its :func:`smooth` line over every point, the range
    aside: :meth:`Series.smoother`), also ``s``: those lines reduced to the same
    columns. ``keys`` (per series, a key that changes when its points change) and
    ``cache`` keep each series' reduction to pixel columns for the next chart with the
    same columns."""
    kept, on_line = _in_range(data, lo, hi, smoothed)
    points = sum(len(x) for x, _ in kept)
    if points == 0:
        empty: dict[str, Any] = {"x": [], "y": [[] for _ in data], "points": 0, "p": None}
        if smoothed is not None:
            empty["s"] = [[] for _ in data]
        return empty
    xs, span = _edges(kept, lo, hi, width)
    n = len(xs)
    firsts, seconds, smooth_pairs = _reduce(
        kept, xs, on_line if smoothed is not None else None, keys, cache, span
    )
    pair = np.column_stack([*seconds]) if seconds else np.empty((n, 0))
    has_second = ~np.isnan(pair).all(axis=1)
    step = (xs[1] - xs[0]) / 2 if n > 1 and span is not None else 0.0
    x_out = np.column_stack([xs, xs + step]).ravel()
    keep = np.column_stack([np.ones(n, bool), has_second]).ravel()
    finite = np.concatenate([y for _, y in kept])  # a copy of its own: sorted in place
    p1, p99 = np.percentile(finite, [1, 99], overwrite_input=True).tolist()
    out = {
        "x": x_out[keep].tolist(),
        "y": [_column(f, s, keep) for f, s in zip(firsts, seconds, strict=True)],
        "points": points,
        "p": [p1, p99],
    }
    if smoothed is not None:
        out["s"] = [_column(f, s, keep) for f, s in smooth_pairs]
    return out
