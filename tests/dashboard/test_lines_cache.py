"""A chart's pixel columns kept per series: the same answer as computed afresh, and a
series that grew is reduced again."""

from __future__ import annotations

import numpy as np

from loopbus.dashboard._series import Series, lines, x_of


def _series(n: int, seed: int) -> Series:
    series = Series()
    rng = np.random.default_rng(seed)
    series.extend(np.arange(1, n + 1), np.arange(n) * 0.5, rng.normal(size=n))
    return series


def test_kept_columns_give_the_answer_computed_afresh() -> None:
    runs = [_series(5000, i) for i in range(3)]
    cache: dict[object, tuple[np.ndarray, np.ndarray]] = {}

    def chart(use: bool) -> dict[str, object]:
        data = [x_of(s, "step", None) for s in runs]
        keys = [(s, len(s)) for s in runs]
        return lines(data, None, None, 100, None, keys if use else None, cache if use else None)

    first = chart(True)
    assert len(cache) == 3
    assert chart(True) == first == chart(False)
    runs[0].add(5001, 2500.0, 1e6)  # a spike at the end: reduced again, not taken kept
    grown = chart(True)
    assert grown == chart(False)
    assert max(v for v in grown["y"][0] if v is not None) == 1e6
    assert len(cache) == 6  # the x range grew: every series' columns are new


def test_exact_columns_are_not_kept() -> None:
    runs = [_series(50, 0)]
    cache: dict[object, tuple[np.ndarray, np.ndarray]] = {}
    data = [x_of(s, "step", None) for s in runs]
    answer = lines(data, None, None, 100, None, [(runs[0], 50)], cache)
    assert cache == {}
    assert answer["x"] == list(range(1, 51))
