"""A run's points, one :class:`Series` per record name, and what the page draws of them.

A series keeps every point as it was logged (step, wall time, value), in columns
(numpy arrays, with the points added since the last read waiting in lists). The page
never gets a sample of them: :func:`lines` reduces the visible range of several series
to the smallest and largest value per pixel column (recomputed on every zoom), and
:func:`scalars` hands out all of them, exact.

Imports numpy and the base layer only.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, MutableMapping, Sequence
from typing import Any

import numpy as np

__all__ = ["X_MODES", "Part", "Series", "lines", "scalars", "smooth"]

#: What the x axis can show: the step, seconds since the run's first point, or the wall
#: clock (seconds since the Unix epoch).
X_MODES = ("step", "relative", "wall")
#: Integers a float64 holds exactly; a series with a larger one keeps Python ints.
_EXACT = 2**53
_NONFINITE = {math.inf: "inf", -math.inf: "-inf"}
#: Stamps of the series' states, each taken once (see :attr:`Series.stamp`).
_STAMPS = itertools.count()


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
        "stamp",
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
        #: A number no other state of any series has, taken anew at every change of its
        #: points: what a chart keeps of a series is kept under it.
        self.stamp = next(_STAMPS)

    def __len__(self) -> int:
        return len(self._steps) + len(self._new_steps)

    def __repr__(self) -> str:
        return f"<Series of {len(self)} points>"

    def add(self, step: int, time: float, value: Any) -> None:
        """One point (a bool counts as 0 or 1)."""
        self.stamp = next(_STAMPS)
        self._new_steps.append(step)
        self._new_times.append(time)
        self._new_values.append(value)

    def extend(self, steps: Sequence[int], times: Sequence[float], values: Sequence[Any]) -> None:
        """Several points, in order (lists, or numpy arrays taken as they are)."""
        self.stamp = next(_STAMPS)
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
        self.stamp = next(_STAMPS)
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
    time counts from ``origin`` (the run's first wall time). The series' own arrays where
    they are that already (the step, the wall time, float values): not to be changed."""
    steps, times, values = series.arrays()
    y = np.asarray(values, dtype=np.float64)
    if mode == "step":
        return steps, y
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
    and largest value (NaN where a bin has none, the second NaN where they are one); the
    smallest logged first of those equal to it, the largest logged last."""
    first = np.full(n, np.nan)
    second = np.full(n, np.nan)
    if not len(y):
        return first, second
    if (len(bins) > 1 and not (bins[1:] >= bins[:-1]).all()) or np.isnan(y).any():
        lo, hi, where = _by_sorting(bins, y)
    else:  # the points in the order of their bins (x sorted): each bin a run of them
        starts = np.flatnonzero(np.r_[True, bins[1:] != bins[:-1]])
        ends = np.r_[starts[1:], len(bins)] - 1
        counts = ends - starts + 1
        lows = np.flatnonzero(y == np.repeat(np.minimum.reduceat(y, starts), counts))
        highs = np.flatnonzero(y == np.repeat(np.maximum.reduceat(y, starts), counts))
        lo = lows[np.searchsorted(lows, starts)]
        hi = highs[np.searchsorted(highs, ends, side="right") - 1]
        where = bins[starts]
    lo_first = lo <= hi
    first[where] = np.where(lo_first, y[lo], y[hi])
    second[where] = np.where(lo_first, y[hi], y[lo])
    second[where[lo == hi]] = np.nan
    return first, second


def _by_sorting(bins: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For :func:`_extremes` of points in any order: per bin that has points, where its
    smallest and its largest value are (a stable sort by bin, then by value), and the
    bin."""
    order = np.lexsort((y, bins))  # by bin, then by value: a bin's min first, max last
    b = bins[order]
    starts = np.flatnonzero(np.r_[True, b[1:] != b[:-1]])
    ends = np.r_[starts[1:], len(b)] - 1
    return order[starts], order[ends], b[starts]


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


def _column(first: np.ndarray, second: np.ndarray, keep: np.ndarray) -> list[float | None]:
    """A series' values of the shared x column: per bin its first value and, where
    ``keep`` says, its second; NaN as None."""
    both = np.column_stack([first, second]).ravel()[keep]
    listed: list[float | None] = both.tolist()
    for i in np.flatnonzero(np.isnan(both)).tolist():
        listed[i] = None
    return listed


class Part:
    """One series' share of a chart over one range: its finite points in the range (the
    series' own arrays when that is all of them) and their extent; and, for the latest
    pixel columns it was reduced to, its values per column and those as the answer lists
    them. Kept between charts under the caller's key (:func:`lines`), so that a chart
    asked again (on every refresh, while other runs are read or points arrive) computes
    only what changed."""

    __slots__ = ("_ordered", "distinct", "listed", "mask", "reduced", "start", "stop", "x", "y")

    def __init__(self, x: np.ndarray, y: np.ndarray, lo: float | None, hi: float | None) -> None:
        mask = np.isfinite(y)
        if lo is not None:
            mask &= x >= lo
        if hi is not None:
            mask &= x <= hi
        if mask.all():
            self.x, self.y, self.mask = x, y, None  # read only: never changed in place
        else:
            self.x, self.y, self.mask = x[mask], y[mask], mask
        self.start = float(self.x.min()) if len(self.x) else math.inf
        self.stop = float(self.x.max()) if len(self.x) else -math.inf
        #: How many distinct x values the part has when they are sorted (else None).
        x = self.x
        self.distinct: int | None = None
        if len(x) < 2 or bool((x[1:] >= x[:-1]).all()):
            self.distinct = int(np.count_nonzero(x[1:] != x[:-1])) + min(len(x), 1)
        #: (columns, first, second): :func:`_extremes` in the latest equal columns.
        self.reduced: tuple[Any, np.ndarray, np.ndarray] | None = None
        #: (columns and the bins kept, the part's values as the answer lists them).
        self.listed: tuple[Any, Any] | None = None
        self._ordered: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None

    def ordered(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The part's values sorted, and samples of them for :func:`_ranked`: every
        ``m``-th (``m`` about the square root of their count), what each adds to a lower
        bound of how many values are at most a value it is at most (1 for the first
        sample, ``m`` for the others), and what each adds to an upper bound of how many
        are below a value it is below (``m``, or what is left after it)."""
        if self._ordered is None:
            values = np.sort(self.y)
            n = len(values)
            m = max(16, math.isqrt(n))
            at = np.arange(0, n, m)
            lows = np.full(len(at), m)
            lows[:1] = 1
            self._ordered = (values, values[at], lows, np.minimum(m, n - at))
        return self._ordered


def _parts(
    data: Sequence[tuple[np.ndarray, np.ndarray]],
    lo: float | None,
    hi: float | None,
    keys: Sequence[Any] | None,
    cache: MutableMapping[Any, Part] | None,
) -> list[Part]:
    """Each series' :class:`Part` over ``[lo, hi]``: the one kept under its key, or a new
    one (kept)."""
    parts = []
    for i, (x, y) in enumerate(data):
        key = (keys[i], lo, hi) if keys is not None and cache is not None else None
        part = cache.get(key) if cache is not None and key is not None else None
        if part is None:
            part = Part(x, y, lo, hi)
            if cache is not None and key is not None:
                cache[key] = part
        parts.append(part)
    return parts


def _distinct(parts: list[Part], most: int) -> np.ndarray | None:
    """The distinct x values of ``parts``, sorted; None when there are more than ``most``
    (one part with that many is enough to tell, without sorting them all together)."""
    if any(p.distinct is not None and p.distinct > most for p in parts):
        return None
    distinct = np.unique(np.concatenate([p.x for p in parts]))
    return distinct if len(distinct) <= most else None


def _edges(
    parts: list[Part], lo: float | None, hi: float | None, width: int
) -> tuple[np.ndarray, tuple[float, float] | None]:
    """The pixel columns' left edges: each distinct x where there are no more than two
    per column (then None), else ``width`` equal columns over the range (then its start
    and stop)."""
    distinct = _distinct(parts, 2 * width)
    if distinct is not None:
        return distinct, None
    start = float(lo if lo is not None else min(p.start for p in parts if len(p.x)))
    stop = float(hi if hi is not None else max(p.stop for p in parts if len(p.x)))
    return np.linspace(start, stop, width + 1)[:-1], (start, stop)


def _reduce(
    parts: list[Part],
    edges: np.ndarray,
    on_line: Sequence[np.ndarray] | None,
    span: tuple[float, float] | None,
) -> tuple[list[np.ndarray], list[np.ndarray], list[tuple[np.ndarray, np.ndarray]]]:
    """Per series, its first and second value of each column (:func:`_extremes`), and
    those of its smoothed line (``on_line``) when given. Equal columns (``span``) are
    kept in each part, computed once."""
    n = len(edges)
    columns = (*span, n) if span is not None else None
    firsts, seconds, smooth_pairs = [], [], []
    for i, part in enumerate(parts):
        bins = None
        kept = part.reduced
        if columns is not None and kept is not None and kept[0] == columns:
            first, second = kept[1], kept[2]
        else:
            bins = np.clip(np.searchsorted(edges, part.x, side="right") - 1, 0, n - 1)
            first, second = _extremes(bins, part.y, n)
            if columns is not None:
                part.reduced = (columns, first, second)
        if on_line is not None:  # a bin has a second value of both or of neither
            if bins is None:
                bins = np.clip(np.searchsorted(edges, part.x, side="right") - 1, 0, n - 1)
            smooth_pairs.append(_ends(bins, on_line[i], n))
        firsts.append(first)
        seconds.append(second)
    return firsts, seconds, smooth_pairs


def _ranked(parts: list[Part], ranks: Sequence[int]) -> list[float]:
    """The values of ``ranks`` (0: the smallest) among the values of every part, exact.
    Each is looked for only among the values between two bounds that the parts' samples
    (:meth:`Part.ordered`) give, not among all of them: ``L``, the largest sample that
    at most ``rank`` values can be below, and ``U``, the smallest sample that at least
    ``rank + 1`` values are at most."""
    ordered = [p.ordered() for p in parts if len(p.y)]
    samples = np.concatenate([o[1] for o in ordered])
    order = np.argsort(samples, kind="stable")
    samples = samples[order]
    low = np.cumsum(np.concatenate([o[2] for o in ordered])[order])
    high = np.cumsum(np.concatenate([o[3] for o in ordered])[order])
    below_sample = np.r_[0, high[:-1]]  # at most this many values below sample t
    lo_at = int(np.searchsorted(below_sample, min(ranks), side="right")) - 1
    hi_at = int(np.searchsorted(low, max(ranks) + 1, side="left"))
    lower = samples[lo_at]
    upper = samples[hi_at] if hi_at < len(samples) else None
    below = 0
    found = []
    for values, *_ in ordered:
        start = int(np.searchsorted(values, lower, side="left"))
        stop = len(values) if upper is None else int(np.searchsorted(values, upper, "right"))
        below += start
        found.append(values[start:stop])
    candidates = np.concatenate(found)
    at = [rank - below for rank in ranks]
    candidates.partition(at)
    return candidates[at].tolist()


def _percentiles(parts: list[Part], total: int) -> list[float]:
    """The 1st and 99th percentile of the values of every part (``total`` of them), as
    numpy's ``percentile`` (its linear method) computes them, from the values of four
    ranks (:func:`_ranked`): no copy of every value is made and sorted for them."""
    quantiles = np.true_divide(np.array([1, 99]), 100)
    virtual = (total - 1) * quantiles
    previous = np.floor(virtual)
    above = virtual >= total - 1
    gamma = virtual - np.where(above, -1, previous)
    ranks = np.where(above, total - 1, previous).astype(np.int64)
    following = np.where(above, total - 1, previous + 1).astype(np.int64)
    out = []
    for i in range(2):
        a, b = _ranked(parts, [int(ranks[i]), int(following[i])])
        diff = b - a
        t = float(gamma[i])
        out.append(b - diff * (1 - t) if t >= 0.5 else a + diff * t)
    return out


def _listed(
    part: Part,
    columns: Any,
    pair: tuple[np.ndarray, np.ndarray],
    keep: np.ndarray,
    wrap: Callable[[list[Any]], Any] | None,
) -> Any:
    """:func:`_column` of a part's ``pair`` (as ``wrap`` makes it), kept in the part
    under ``columns`` (None: not kept)."""
    kept = part.listed
    if columns is not None and kept is not None and kept[0] == columns:
        return kept[1]
    listed = _column(pair[0], pair[1], keep)
    made = wrap(listed) if wrap is not None else listed
    if columns is not None:
        part.listed = (columns, made)
    return made


def lines(
    data: Sequence[tuple[np.ndarray, np.ndarray]],
    lo: float | None,
    hi: float | None,
    width: int,
    smoothed: Sequence[np.ndarray] | None = None,
    keys: Sequence[Any] | None = None,
    cache: MutableMapping[Any, Part] | None = None,
    wrap: Callable[[list[Any]], Any] | None = None,
) -> dict[str, Any]:
    """What a chart draws of several series (``(x, y)`` each) over ``[lo, hi]`` (None:
    all), ``width`` pixel columns wide: one shared x column and, per series, its smallest
    and largest value in each column in the order they were logged, so every spike and
    dip of every series stays visible at any zoom. Where the series have no more distinct
    x values in the range than two per column, each distinct x is a column of its own
    (exact positions). Also the points in the range, and their 1st and 99th percentile.
    With ``smoothed`` (per series, its :func:`smooth` line over every point, the range
    aside: :meth:`Series.smoother`), also ``s``: those lines reduced to the same
    columns. ``keys`` (per series, a key that changes when its points or its x change)
    and ``cache`` keep each series' :class:`Part` of the range for the next chart;
    ``wrap`` turns each series' list of values into what the answer holds (the caller's
    encoding, kept in the part too)."""
    parts = _parts(data, lo, hi, keys, cache)
    points = sum(len(p.x) for p in parts)
    if points == 0:
        empty: dict[str, Any] = {"x": [], "y": [[] for _ in data], "points": 0, "p": None}
        if smoothed is not None:
            empty["s"] = [[] for _ in data]
        return empty
    on_line = None
    if smoothed is not None:
        on_line = [s if p.mask is None else s[p.mask] for p, s in zip(parts, smoothed, strict=True)]
    xs, span = _edges(parts, lo, hi, width)
    n = len(xs)
    firsts, seconds, smooth_pairs = _reduce(parts, xs, on_line, span)
    pair = np.column_stack([*seconds]) if seconds else np.empty((n, 0))
    has_second = ~np.isnan(pair).all(axis=1)
    step = (xs[1] - xs[0]) / 2 if n > 1 and span is not None else 0.0
    x_out = np.column_stack([xs, xs + step]).ravel()
    keep = np.column_stack([np.ones(n, bool), has_second]).ravel()
    p1, p99 = _percentiles(parts, points)
    columns = (*span, n, keep.tobytes()) if span is not None else None
    out = {
        "x": x_out[keep].tolist(),
        "y": [
            _listed(p, columns, pair, keep, wrap)
            for p, pair in zip(parts, zip(firsts, seconds, strict=True), strict=True)
        ],
        "points": points,
        "p": [p1, p99],
    }
    if smoothed is not None:
        out["s"] = [
            wrap(_column(f, s, keep)) if wrap is not None else _column(f, s, keep)
            for f, s in smooth_pairs
        ]
    return out
