"""What a chart computes without sorting every point is exactly what sorting them gives:
the 1st and 99th percentile of several series (numpy's ``percentile``, bit for bit), and
each pixel column's first and second extreme of points in the order of their x."""

from __future__ import annotations

import numpy as np
import pytest

from loopbus.dashboard._series import Part, _by_sorting, _extremes, _percentiles, _ranked


def _values(rng: np.random.Generator, n: int, kind: int) -> np.ndarray:
    if kind == 0:
        return rng.normal(size=n)
    if kind == 1:
        return rng.integers(-3, 3, size=n).astype(np.float64)  # many ties
    if kind == 2:
        return np.sort(rng.normal(size=n))[:: int(rng.choice([1, -1]))]
    return np.full(n, rng.normal())


@pytest.mark.parametrize("seed", range(4))
def test_percentiles_of_parts_are_numpys(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(300):
        ys = [
            _values(rng, int(rng.choice([0, 1, 2, 7, 100, 2000])), int(rng.integers(0, 4)))
            for _ in range(int(rng.integers(1, 10)))
        ]
        total = sum(len(y) for y in ys)
        if not total:
            continue
        parts = [Part(np.arange(len(y)), y, None, None) for y in ys]
        assert _percentiles(parts, total) == np.percentile(np.concatenate(ys), [1, 99]).tolist()


def test_every_rank_is_found_among_many_parts() -> None:
    rng = np.random.default_rng(7)
    ys = [rng.normal(size=int(rng.integers(1, 3000))) for _ in range(50)]
    parts = [Part(np.arange(len(y)), y, None, None) for y in ys]
    everything = np.sort(np.concatenate(ys))
    for rank in [0, 1, 17, len(everything) // 2, len(everything) - 2, len(everything) - 1]:
        assert _ranked(parts, [rank]) == [everything[rank]]
    assert _ranked(parts, [5, 6]) == everything[5:7].tolist()


def test_extremes_of_points_in_order_are_those_of_sorting() -> None:
    rng = np.random.default_rng(3)
    for _ in range(2000):
        m, n = int(rng.integers(0, 200)), int(rng.integers(1, 30))
        bins = np.sort(rng.integers(0, n, size=m))
        kind = int(rng.integers(0, 3))
        if kind == 2:
            y = rng.choice([0.0, -0.0, 1.0], size=m)  # ties, and zeros of both signs
        else:
            y = _values(rng, m, kind)
        got = _extremes(bins, y, n)
        want = _sorted_extremes(bins, y, n)
        for a, b in zip(got, want, strict=True):
            assert np.array_equal(a, b, equal_nan=True)
            assert np.array_equal(np.signbit(a), np.signbit(b))


def _sorted_extremes(bins: np.ndarray, y: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    first, second = np.full(n, np.nan), np.full(n, np.nan)
    if len(y):
        lo, hi, where = _by_sorting(bins, y)
        lo_first = lo <= hi
        first[where] = np.where(lo_first, y[lo], y[hi])
        second[where] = np.where(lo_first, y[hi], y[lo])
        second[where[lo == hi]] = np.nan
    return first, second
