"""The CSV logger's files read by columns: every cell exact with pyarrow and without it
(numpy, then cell by cell), the columns a page asks for read before the others, a
growing file followed from where each column was read, a replaced file read again."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import pytest
from starlette.applications import Starlette

from loopbus.dashboard import Catalog, Hub, routes
from loopbus.dashboard import _columns as columns_module
from loopbus.dashboard._logs import CsvReader

#: Every kind of cell the CSV logger writes: ints (one beyond 2**53), floats to their last
#: digit, non-finite floats, bools, and empty cells (no point for that name).
HEADER = 'step,epoch,time,loss,size,flag,sparse,"val,acc"\n'
ROWS = [
    "1,0,1700000000.1234567,0.30000000000000004,16,True,,0.5\n",
    "2,0,1700000000.2234567,1e-300,9007199254740993,False,nan,\n",
    "3,1,1700000001.5,inf,-3,True,-inf,0.25\n",
    "4,1,1700000002.5,-0.0,7,False,,\n",
]
EXPECTED: dict[str, dict[str, list[Any]]] = {
    "loss": {
        "step": [1, 2, 3, 4],
        "wall_time": [1700000000.1234567, 1700000000.2234567, 1700000001.5, 1700000002.5],
        "value": [0.30000000000000004, 1e-300, math.inf, -0.0],
    },
    "size": {
        "step": [1, 2, 3, 4],
        "wall_time": [1700000000.1234567, 1700000000.2234567, 1700000001.5, 1700000002.5],
        "value": [16, 9007199254740993, -3, 7],
    },
    "flag": {
        "step": [1, 2, 3, 4],
        "wall_time": [1700000000.1234567, 1700000000.2234567, 1700000001.5, 1700000002.5],
        "value": [1.0, 0.0, 1.0, 0.0],
    },
    "sparse": {
        "step": [2, 3],
        "wall_time": [1700000000.2234567, 1700000001.5],
        "value": [math.nan, -math.inf],
    },
    "val,acc": {
        "step": [1, 3],
        "wall_time": [1700000000.1234567, 1700000001.5],
        "value": [0.5, 0.25],
    },
}


@pytest.fixture(params=["pyarrow", "numpy"])
def parser(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test runs with pyarrow's reader and with the reader used without pyarrow."""
    if request.param == "numpy":
        monkeypatch.setattr(columns_module, "pa_csv", None)
    else:
        pytest.importorskip("pyarrow")
    return str(request.param)


def _points(chunks: list[Any]) -> dict[str, dict[str, list[Any]]]:
    out: dict[str, dict[str, list[Any]]] = {}
    for chunk in chunks:
        for source in (chunk.arrays, chunk.points):
            for name, (steps, times, values) in source.items():
                got = out.setdefault(name, {"step": [], "wall_time": [], "value": []})
                got["step"] += list(np.asarray(steps).tolist())
                got["wall_time"] += list(np.asarray(times).tolist())
                got["value"] += [v.item() if hasattr(v, "item") else v for v in values]
    return out


def _same(got: dict[str, list[Any]], want: dict[str, list[Any]]) -> None:
    assert got["step"] == want["step"]
    assert got["wall_time"] == want["wall_time"]
    assert len(got["value"]) == len(want["value"])
    for a, b in zip(got["value"], want["value"], strict=True):
        assert (math.isnan(a) and math.isnan(b)) or (
            a == b and repr(a).startswith("-") == repr(b).startswith("-")
        ), (a, b)


def test_every_cell_is_read_exactly(tmp_path: Path, parser: str) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text(HEADER + "".join(ROWS))
    chunk = CsvReader(path).read()
    got = _points([chunk])
    assert sorted(got) == sorted(EXPECTED)
    for name, want in EXPECTED.items():
        _same(got[name], want)
    assert chunk.epochs == {0: (2, 1700000000.2234567), 1: (4, 1700000002.5)}
    assert chunk.pending == set()


def test_a_column_whose_kind_changes_far_into_a_large_file_is_read_exactly(
    tmp_path: Path, parser: str
) -> None:
    """A large file is parsed in blocks side by side; a column of whole numbers in the
    first block and fractions in a later one (or a cell left empty) is still read
    exactly, every row."""
    n = 60_000
    values = [float(s) if s < n - 10 else s + 0.25 for s in range(n)]
    cells = [str(int(v)) if v.is_integer() else repr(v) for v in values]
    cells[-1] = ""  # an empty cell: no point at that step
    rows = [f"{s},0,{1000.5 + s},{cell}\n" for s, cell in enumerate(cells)]
    path = tmp_path / "metrics.csv"
    path.write_text("step,epoch,time,train/a\n" + "".join(rows))
    reader = CsvReader(path)
    chunks = [reader.read()]
    while reader.more():
        chunks.append(reader.read())
    got = _points(chunks)["train/a"]
    assert got["step"] == list(range(n - 1))
    assert got["value"] == values[: n - 1]
    assert path.stat().st_size > 2 * (1 << 18)  # more than one block


def test_the_columns_asked_for_are_read_first_and_the_others_after(
    tmp_path: Path, parser: str
) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text(HEADER + "".join(ROWS[:2]))
    reader = CsvReader(path)
    header = reader.read(())
    assert not header.arrays
    assert not header.points
    assert header.pending == set(EXPECTED)
    first = reader.read(["size", "no such name"])
    assert set(_points([first])) == {"size"}
    assert first.pending == set(EXPECTED) - {"size"}
    assert not reader.more(["size"])
    assert reader.more()
    # The file grows (its last line still being written) before the other columns are read.
    with path.open("a") as f:
        f.write(ROWS[2] + ROWS[3][:5])
    rest = reader.read()
    assert rest.pending == set()
    got = _points([first, rest])
    for name, want in EXPECTED.items():
        _same(got[name], {k: v[:3] for k, v in want.items()})  # the first three rows
    assert not reader.more()  # only a line being written is left
    with path.open("a") as f:
        f.write(ROWS[3][5:])
    last = _points([reader.read()])
    assert last["size"]["value"] == [7]
    assert last["loss"]["step"] == [4]
    assert not reader.read()


def test_a_replaced_file_is_read_again_from_its_start(tmp_path: Path, parser: str) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text("step,epoch,time,loss\n1,0,1.5,0.5\n2,0,2.5,0.25\n")
    reader = CsvReader(path)
    assert _points([reader.read()])["loss"]["value"] == [0.5, 0.25]
    new = tmp_path / "metrics.tmp"
    new.write_text("step,epoch,time,loss,acc\n1,0,1.5,0.5,\n2,0,2.5,0.25,0.75\n")
    os.replace(new, path)
    again = reader.read(["acc"])
    assert again.reset
    assert _points([again]) == {"acc": {"step": [2], "wall_time": [2.5], "value": [0.75]}}
    assert again.pending == {"loss"}


def test_a_file_of_another_kind_gives_no_points(tmp_path: Path, parser: str) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text("a,b,c\n1,2,3\n")
    chunk = CsvReader(path).read()
    assert not chunk
    assert chunk.pending == set()
    odd = tmp_path / "odd.csv"
    odd.write_text("step,epoch,time,loss\n1,0,1.5,0.5\nnot,a,row\n2,0,2.5,oops\n3,0,3.5,0.125,9\n")
    got = _points([CsvReader(odd).read()])
    assert got == {"loss": {"step": [1, 3], "wall_time": [1.5, 3.5], "value": [0.5, 0.125]}}


def _write(folder: Path, names: list[str], steps: int, seed: int) -> None:
    folder.mkdir(parents=True)
    rows = [
        f"{s},{s // 10},{1000.0 + s},"
        + ",".join(repr(math.sin(s * (j + 1) + seed)) for j in range(len(names)))
        for s in range(steps)
    ]
    (folder / "metrics.csv").write_text(
        "step,epoch,time," + ",".join(names) + "\n" + "\n".join(rows) + "\n"
    )


async def test_a_page_gets_the_chart_it_asks_for_first_and_every_point_after(
    tmp_path: Path, parser: str
) -> None:
    names = ["train/a", "train/b", "val/c", "zeta"]
    for i in range(4):
        _write(tmp_path / "runs" / f"run{i}", names, 50, i)
    catalog = Catalog([tmp_path / "runs"], poll=0.05)
    app = Starlette(routes=routes(Hub(), catalog=catalog))
    async with (
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://d") as client,
        anyio.create_task_group() as tg,
    ):
        catalog.scan()
        runs = catalog.runs()
        assert [sorted(r.info()["names"]) for r in runs] == [[]] * 4  # nothing read yet
        body = {"runs": [r.id for r in runs], "names": ["zeta"], "width": 100}
        answer = (await client.post("/api/lines", json=body)).json()
        assert answer["runs"] == []
        assert answer["points"] == 0
        tg.start_soon(catalog.run)
        with anyio.fail_after(30):
            await catalog.read_first(runs, ["zeta"])
        answer = (await client.post("/api/lines", json=body)).json()
        assert answer["runs"] == body["runs"]
        assert answer["pending"] == []
        assert answer["points"] == answer["total"] == 200
        for run in runs:
            assert run.info()["names"] == names
        # Every point of every name, exact, once all is read (/api/scalars waits for it).
        got = (await client.get("/api/scalars", params={"run": runs[3].id, "name": "val/c"})).json()
        assert got["step"] == list(range(50))
        assert got["value"] == [math.sin(s * 3 + 3) for s in range(50)]
        with anyio.fail_after(30):
            await catalog.read_first(runs, None)
        assert sum(r.info()["points"] for r in runs) == 4 * 4 * 50
        tg.cancel_scope.cancel()


async def test_runs_not_read_within_one_look_are_read_at_the_next(tmp_path: Path) -> None:
    """A look finds every run due; when reading them takes longer than ``poll``, the
    catalog looks again before it has read them all, and those left are still read (a
    look yields a run once per change of its files, so dropping them lost them)."""
    for i in range(8):
        _write(tmp_path / "runs" / f"run{i}", ["train/a", "train/b"], 2000, i)
    catalog = Catalog([tmp_path / "runs"], poll=1e-4)  # a look after every read
    catalog.scan()
    runs = catalog.runs()
    async with anyio.create_task_group() as tg:
        tg.start_soon(catalog.run)
        with anyio.fail_after(60):
            await catalog.read_first(runs, None)
        tg.cancel_scope.cancel()
    assert [r.info()["points"] for r in runs] == [2 * 2000] * 8


def test_the_first_names_follow_the_pages_order_and_what_pages_asked_for() -> None:
    catalog = Catalog([])
    assert catalog.first() == []
    from loopbus.dashboard._catalog import GROUP_ORDER, page_order

    names = ["zeta", "val/b", "train/z", "custom/x", "train/a", "test/q"]
    assert sorted(names, key=page_order) == [
        "train/a",
        "train/z",
        "val/b",
        "test/q",
        "custom/x",
        "zeta",
    ]
    script = (Path(columns_module.__file__).parent / "static" / "dashboard.js").read_text()
    assert "const GROUP_ORDER = [" + ", ".join(f'"{g}"' for g in GROUP_ORDER) + "];" in script
    catalog.want("val/b")
    catalog.want("zeta")
    assert catalog.first()[:2] == ["zeta", "val/b"]
