"""What a chart keeps between answers: each series' part of the range (the same answer as
computed afresh; a series that grew is reduced again), its values encoded once, and the
whole answer, which the API gives again until a run it shows changes (a followed file
grows) and forgets then."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import numpy as np
from starlette.applications import Starlette

from loopbus.dashboard import Catalog, Hub, routes
from loopbus.dashboard._api import _lines, _Markers, _prune, _Query
from loopbus.dashboard._series import Part, Series, lines, x_of


def _series(n: int, seed: int) -> Series:
    series = Series()
    rng = np.random.default_rng(seed)
    series.extend(np.arange(1, n + 1), np.arange(n) * 0.5, rng.normal(size=n))
    return series


def test_kept_parts_give_the_answer_computed_afresh() -> None:
    runs = [_series(5000, i) for i in range(3)]
    cache: dict[object, Part] = {}

    def chart(use: bool) -> dict[str, object]:
        data = [x_of(s, "step", None) for s in runs]
        keys = [(s, s.stamp) for s in runs]
        return lines(data, None, None, 100, None, keys if use else None, cache if use else None)

    first = chart(True)
    assert len(cache) == 3
    kept = dict(cache)
    columns = {part.reduced[0] for part in kept.values() if part.reduced is not None}
    assert len(columns) == 1  # every series in the same equal columns
    assert chart(True) == first == chart(False)
    assert cache == kept  # the same parts, not made again
    runs[0].add(5001, 2500.0, 1e6)  # a spike at the end: reduced again, not taken kept
    grown = chart(True)
    assert grown == chart(False)
    assert max(v for v in grown["y"][0] if v is not None) == 1e6
    assert len(cache) == 4  # a part for the grown series' new state
    # The x range grew: the other series' parts are kept, reduced to the new columns.
    for key in [(s, s.stamp) for s in runs[1:]]:
        part = cache[(key, None, None)]
        assert part is kept[(key, None, None)]
        assert part.reduced is not None
        assert part.reduced[0] not in columns


def test_a_part_over_the_whole_range_is_the_series_own_arrays() -> None:
    series = _series(1000, 0)
    x, y = x_of(series, "step", None)
    steps, _, values = series.arrays()
    assert x is steps
    assert y is values
    part = Part(x, y, None, None)
    assert part.x is x
    assert part.y is y
    assert part.mask is None
    zoomed = Part(x, y, 100, 200)
    assert zoomed.x.tolist() == list(range(100, 201))
    assert zoomed.mask is not None
    assert (zoomed.start, zoomed.stop) == (100.0, 200.0)
    answer = lines([(x, y)], None, None, 50, None, [(series, series.stamp)], {})
    assert series.arrays()[2] is values  # the percentiles sorted a copy, not the series
    assert answer["points"] == 1000


def test_a_series_stamp_is_new_at_every_change_and_no_other_series_has_it() -> None:
    a, b = Series(), Series()
    stamps = {a.stamp, b.stamp}
    a.add(1, 0.0, 1.0)
    stamps.add(a.stamp)
    b.extend([1, 2], [0.0, 1.0], [1.0, 2.0])
    stamps.add(b.stamp)
    b.extend(np.array([3]), np.array([2.0]), np.array([3.0]))
    stamps.add(b.stamp)
    b.insert_early([0], [-1.0], [0.0])
    stamps.add(b.stamp)
    b.keep(np.array([True, False, True, True]))
    stamps.add(b.stamp)
    assert len(stamps) == 7
    before = b.stamp
    b.arrays()  # reading changes nothing
    assert b.stamp == before


def test_parts_of_series_that_changed_are_forgotten() -> None:
    """A kept part may hold the arrays its series had: once the series changed, the next
    chart computed (of any series) forgets it, and a chart forgets its series' parts of
    other ranges."""
    grows, other = _series(100, 0), _series(100, 1)
    cache: dict[object, Part] = {}

    def chart(series: Series, lo: float | None = None) -> list[object]:
        keys = [(series, series.stamp, "step", None)]
        lines([x_of(series, "step", None)], lo, None, 16, None, keys, cache)
        _prune(cache, keys, lo, None)
        return keys

    old = chart(grows)
    chart(grows, lo=10)  # a zoom: the part of the whole range is forgotten
    assert [key[1] for key in cache] == [10]
    chart(grows)
    grows.add(101, 50.0, 0.0)
    chart(other)  # another chart: the grown series' earlier part goes
    assert all(key[0][0] is not grows for key in cache)
    assert (old[0], None, None) not in cache
    assert len(cache) == 1


def test_exact_columns_are_not_kept() -> None:
    runs = [_series(50, 0)]
    cache: dict[object, Part] = {}
    data = [x_of(s, "step", None) for s in runs]
    answer = lines(data, None, None, 100, None, [(runs[0], 50)], cache)
    assert [part.reduced for part in cache.values()] == [None]
    assert answer["x"] == list(range(1, 51))


def test_values_wrapped_once_give_the_same_encoded_answer() -> None:
    runs = [_series(3000, i) for i in range(2)]
    runs[1].add(3001, 1500.0, float("nan"))  # a break in the line: null
    encode = msgspec.json.Encoder().encode
    calls: list[int] = []

    def wrap(values: list[Any]) -> msgspec.Raw:
        calls.append(len(values))
        return msgspec.Raw(encode(values))

    cache: dict[object, Part] = {}
    data = [x_of(s, "step", None) for s in runs]
    keys = [(s, s.stamp) for s in runs]
    plain = lines(data, None, None, 64, None)
    wrapped = lines(data, None, None, 64, None, keys, cache, wrap)
    assert json.loads(encode(wrapped)) == json.loads(encode(plain))
    assert len(calls) == 2
    lines(data, None, None, 64, None, keys, cache, wrap)
    assert len(calls) == 2  # kept in the parts


def test_an_answer_key_changes_with_the_runs_markers_not_with_other_names() -> None:
    hub = Hub()
    feed = hub.add_run("live")
    for step in range(5):
        feed.record("loss", 1.0 / (step + 1), step, 0, time=1000.0 + step)
    catalog = Catalog(hub=hub)
    query = _Query(runs=[feed.run.id], names=["loss"], width=50)
    parts: dict[object, Part] = {}
    markers = _Markers()

    def key() -> object:
        return _lines(catalog, query, parts, markers)[0]

    first = key()
    assert key() == first
    feed.record("other", 1.0, 5, 0, time=1005.0)  # the run changed, not this chart
    assert key() == first
    feed.stage_ended("fit", "ended", 5)  # a marker on every chart of the run
    marked = key()
    assert marked != first
    answer = _lines(catalog, query, parts, markers)[1]()
    assert [m["kind"] for m in answer["markers"]] == ["stage"]
    feed.record("loss", 0.1, 5, 0, time=1006.0)
    assert key() not in (first, marked)


async def _points_read(catalog: Catalog, points: int) -> None:
    """Until the catalog's only run holds ``points`` points (30 s at most)."""
    for _ in range(1500):
        runs = catalog.runs()
        if runs and runs[0].info()["points"] >= points:
            return
        await anyio.sleep(0.02)
    raise AssertionError(f"{points} points were not read in 30 s")


async def test_a_kept_answer_is_given_again_until_a_followed_file_grows(tmp_path: Path) -> None:
    folder = tmp_path / "runs" / "a"
    folder.mkdir(parents=True)
    path = folder / "records.jsonl"

    def append(steps: range) -> None:
        with path.open("a") as f:
            for s in steps:
                f.write(json.dumps({"name": "loss", "value": 1.0 / s, "step": s, "time": s}) + "\n")

    append(range(1, 3001))
    catalog = Catalog([tmp_path / "runs"], poll=0.02)
    app = Starlette(routes=routes(Hub(), catalog=catalog))
    async with (
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d") as client,
        anyio.create_task_group() as tg,
    ):
        tg.start_soon(catalog.run)
        await _points_read(catalog, 3000)
        run_id = catalog.runs()[0].id
        body = {"runs": [run_id], "names": ["loss"], "width": 100}
        first = (await client.post("/api/lines", json=body)).content
        assert json.loads(first)["points"] == 3000
        assert (await client.post("/api/lines", json=body)).content == first
        zoomed = (await client.post("/api/lines", json={**body, "lo": 10, "hi": 20})).json()
        assert zoomed["points"] == 11
        append(range(3001, 3011))
        await _points_read(catalog, 3010)
        grown = (await client.post("/api/lines", json=body)).json()
        assert grown["points"] == grown["total"] == 3010
        assert grown["x"][-1] > json.loads(first)["x"][-1]
        again = (await client.post("/api/lines", json=body)).json()
        assert again == grown
        tg.cancel_scope.cancel()
