"""The dashboard's JSON API over logged runs: every point the loggers wrote, exact; files
that grow followed; a live job's history read in the run folder its stream names; and no
query that reaches a file outside the given paths."""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import numpy as np
import pytest
from starlette.applications import Starlette

from loopbus import PutRecord
from loopbus.dashboard import Catalog, Dashboard, Hub, Series, export_live, routes
from loopbus.dashboard._catalog import ENDED_IDLE
from loopbus.dashboard._series import lines, x_of
from loopbus.plugins.loggers import read_csv, read_jsonl
from loopbus.stream import Server, StageEnded, StageStarted
from tests.dashboard.runs import KINDS, write_run, write_runs


def _client(catalog: Catalog) -> httpx.AsyncClient:
    app = Starlette(routes=routes(catalog.hub or Hub(), catalog=catalog))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dashboard")


def _columns(records: list[PutRecord]) -> dict[str, dict[str, list[Any]]]:
    out: dict[str, dict[str, list[Any]]] = {}
    for r in records:
        series = out.setdefault(r.name, {"step": [], "wall_time": [], "value": []})
        series["step"].append(r.step)
        series["wall_time"].append(r.time)
        series["value"].append(r.value)
    return out


@pytest.fixture(scope="module")
def logged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path], Path]:
    base = tmp_path_factory.mktemp("logged")
    folders = write_runs(base / "runs", reference=base / "reference")
    return base / "runs", folders, base / "reference"


async def test_every_run_is_listed_with_its_names_facts_and_configuration(
    logged: tuple[Path, dict[str, Path], Path],
) -> None:
    root, folders, _ = logged
    catalog = Catalog([root])
    catalog.load()
    async with _client(catalog) as client:
        runs = (await client.get("/api/runs")).json()
    assert [r["id"] for r in runs] == [f"runs/{kind}/version_0" for kind in sorted(KINDS)]
    for run in runs:
        kind = run["id"].split("/")[1]
        assert run["source"] == str(folders[kind])
        assert run["state"] in ("live", "finished")
        assert run["names"] == ["train/loss", "train/size", "val/loss"]
        assert run["run"]["name"] == kind
        assert run["run"]["version"] == 0
        lr, seed = KINDS[kind]
        assert run["config"]["model"]["init_args"] == {"lr": lr, "seed": seed}
        assert run["config"]["trainer"]["max_epochs"] == 2


async def test_tensorboard_runs_are_listed_with_the_reason_without_the_extra(
    logged: tuple[Path, dict[str, Path], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the ``tensorboard`` package a run of event files is still listed, with no
    names and the reason (what to install); the other runs read as before."""
    root, folders, _ = logged
    # (None in sys.modules makes an import of that name raise, imported before or not.)
    for name in ("tensorboard", "tensorboard.backend.event_processing"):
        monkeypatch.setitem(sys.modules, name, None)
    catalog = Catalog([root])
    catalog.load()
    async with _client(catalog) as client:
        runs = {r["id"]: r for r in (await client.get("/api/runs")).json()}
        tb = runs["runs/tb/version_0"]
        assert tb["source"] == str(folders["tb"])
        assert tb["names"] == []
        assert "pip install 'loopbus[tensorboard]'" in tb["reason"]
        others = [r for run_id, r in runs.items() if run_id != "runs/tb/version_0"]
        assert others
        assert all(r["reason"] == "" for r in others)
        assert all(r["names"] == ["train/loss", "train/size", "val/loss"] for r in others)
        answer = await client.get(
            "/api/scalars", params={"run": "runs/tb/version_0", "name": "train/loss"}
        )
        assert answer.status_code == 404


@pytest.fixture
def two_runs(tmp_path: Path) -> dict[str, Path]:
    """A CSV and a JSONL run folder under ``tmp_path/runs``, each of one epoch."""
    return {kind: write_run(tmp_path / "runs", kind, epochs=1) for kind in ("csv", "jsonl")}


async def test_a_run_whose_run_json_records_its_end_is_finished_once_its_files_rest(
    tmp_path: Path, two_runs: dict[str, Path]
) -> None:
    """A run folder's ``run.json`` that says its stage ended makes the run finished a
    moment after its last write (``ENDED_IDLE``), not after the whole ``idle`` time; a
    run without that record (a process killed before it could say so) waits for it."""
    folders = two_runs
    for folder in folders.values():
        assert msgspec.json.decode((folder / "run.json").read_bytes())["outcome"] == "completed"
    unended = folders["jsonl"] / "run.json"
    facts = msgspec.json.decode(unended.read_bytes())
    del facts["ended"]
    unended.write_bytes(msgspec.json.encode(facts))
    rested = time.time() - 2 * ENDED_IDLE
    for folder in folders.values():
        for path in folder.iterdir():
            os.utime(path, (rested, rested))
    catalog = Catalog([tmp_path / "runs"], idle=120.0)
    catalog.load()
    catalog.apply([])  # one look at the runs' states with nothing new read
    async with _client(catalog) as client:
        states = {r["id"]: r["state"] for r in (await client.get("/api/runs")).json()}
    assert states == {"runs/csv/version_0": "finished", "runs/jsonl/version_0": "live"}


async def test_series_are_every_point_the_loggers_wrote_exactly(
    logged: tuple[Path, dict[str, Path], Path],
) -> None:
    root, folders, reference = logged
    catalog = Catalog([root])
    catalog.load()
    expected = {
        "jsonl": _columns(read_jsonl(folders["jsonl"] / "records.jsonl")),
        "tb": _columns(read_jsonl(reference / "records.jsonl")),
        "csv": {},
    }
    for row in read_csv(folders["csv"] / "metrics.csv"):
        for name, value in row.items():
            if name in ("step", "epoch", "time"):
                continue
            series = expected["csv"].setdefault(name, {"step": [], "wall_time": [], "value": []})
            series["step"].append(row["step"])
            series["wall_time"].append(row["time"])
            series["value"].append(value)
    async with _client(catalog) as client:
        for kind, names in expected.items():
            assert set(names) == {"train/loss", "train/size", "val/loss"}
            for name, want in names.items():
                answer = await client.get(
                    "/api/scalars", params={"run": f"runs/{kind}/version_0", "name": name}
                )
                assert answer.status_code == 200, answer.text
                got = answer.json()
                assert got["step"] == want["step"], (kind, name)
                assert got["wall_time"] == want["wall_time"], (kind, name)
                if kind == "tb":  # TensorBoard keeps 32-bit floats
                    want_values = np.float32(want["value"]).astype(float).tolist()
                else:
                    want_values = want["value"]
                assert got["value"] == want_values, (kind, name)
        # The CSV of a chart is the same points, as text that reads back exactly.
        text = (
            await client.get(
                "/api/csv", params={"run": "runs/jsonl/version_0", "name": "train/loss"}
            )
        ).text
    lines = text.splitlines()
    assert lines[0] == "run,name,step,wall_time,value"
    want = expected["jsonl"]["train/loss"]
    assert [float(line.split(",")[4]) for line in lines[1:]] == want["value"]
    assert [int(line.split(",")[2]) for line in lines[1:]] == want["step"]


async def test_lines_keep_every_spike_and_count_every_point(tmp_path: Path) -> None:
    folder = tmp_path / "runs" / "spiky"
    folder.mkdir(parents=True)
    values = [0.0] * 10_000
    values[1234] = 50.0  # one spike, one dip, among 10,000 points
    values[8765] = -7.0
    _write_jsonl(
        folder / "records.jsonl", [("loss", i, 1000.0 + i, v) for i, v in enumerate(values)]
    )
    catalog = Catalog([tmp_path / "runs"])
    catalog.load()
    async with _client(catalog) as client:
        body = {"runs": ["runs/spiky"], "names": ["loss"], "width": 100}
        whole = (await client.post("/api/lines", json=body)).json()
        zoomed = (await client.post("/api/lines", json={**body, "lo": 1200, "hi": 1260})).json()
        wall = (await client.post("/api/lines", json={**body, "x": "wall"})).json()
        relative = (await client.post("/api/lines", json={**body, "x": "relative"})).json()
        bad = await client.post("/api/lines", json={**body, "x": "epochs"})
    assert whole["points"] == whole["total"] == 10_000
    assert len(whole["x"]) <= 200
    [ys] = whole["y"]
    assert max(v for v in ys if v is not None) == 50.0
    assert min(v for v in ys if v is not None) == -7.0
    # Zoomed in: fewer points than columns, each at its own x.
    assert zoomed["points"] == 61
    assert zoomed["x"] == [float(s) for s in range(1200, 1261)]
    assert 50.0 in zoomed["y"][0]
    assert wall["x"][0] == 1000.0
    assert relative["x"][0] == 0.0
    assert bad.status_code == 400
    assert "x must be one of step, relative, wall" in bad.text


async def test_smoothed_lines_average_every_point_not_the_drawn_ones(tmp_path: Path) -> None:
    """The smoothed line of a zoomed chart is the same as of the whole chart: the moving
    average runs over every logged point, then is reduced to the chart's columns."""
    folder = tmp_path / "runs" / "noisy"
    folder.mkdir(parents=True)
    values = [float((i * 7919) % 101) for i in range(5000)]
    values[10] = math.nan  # not a point of the average: it carries on past it
    _write_jsonl(
        folder / "records.jsonl", [("loss", i, 1000.0 + i, v) for i, v in enumerate(values)]
    )
    expected, last, n = [], 0.0, 0
    for v in values:
        if math.isfinite(v):
            last, n = last * 0.9 + 0.1 * v, n + 1
        expected.append(last / (1 - 0.9**n))
    catalog = Catalog([tmp_path / "runs"])
    catalog.load()
    async with _client(catalog) as client:
        body = {"runs": ["runs/noisy"], "names": ["loss"], "width": 50, "smoothing": 0.9}
        whole = (await client.post("/api/lines", json=body)).json()
        zoomed = (await client.post("/api/lines", json={**body, "lo": 4000, "hi": 4020})).json()
        got = (
            await client.get(
                "/api/lines",
                params={
                    "run": "runs/noisy",
                    "name": "loss",
                    "lo": 4000,
                    "hi": 4020,
                    "smoothing": 0.9,
                },
            )
        ).json()
        plain = (await client.post("/api/lines", json={**body, "smoothing": 0})).json()
        bad = await client.post("/api/lines", json={**body, "smoothing": 1.0})
    assert whole["smoothing"] == 0.9
    assert len(whole["s"][0]) == len(whole["y"][0]) == len(whole["x"])
    assert zoomed["x"] == [float(s) for s in range(4000, 4021)]
    assert zoomed["s"][0] == pytest.approx(expected[4000:4021], rel=1e-12)
    assert got["s"] == zoomed["s"]
    # Each column's smoothed values lie on the smoothed line of every point.
    line = np.array(expected)
    assert max(np.abs(line - v).min() for v in whole["s"][0]) < 1e-9
    assert "s" not in plain
    assert bad.status_code == 400
    assert "smoothing must be at least 0 and below 1" in bad.text


def _write_jsonl(path: Path, records: list[tuple[str, int, float, Any]], mode: str = "wb") -> None:
    encode = msgspec.json.Encoder().encode
    with path.open(mode) as f:
        for name, step, t, value in records:
            if isinstance(value, float) and not math.isfinite(value):
                value = {math.inf: "inf", -math.inf: "-inf"}.get(value, "nan")
            record = {"type": "PutRecord", "name": name, "value": value, "step": step}
            f.write(encode({**record, "epoch": step // 10, "time": t}) + b"\n")


async def _scalars(catalog: Catalog, run: str, name: str) -> dict[str, list[Any]]:
    async with _client(catalog) as client:
        answer = await client.get("/api/scalars", params={"run": run, "name": name})
    assert answer.status_code == 200, answer.text
    return answer.json()  # type: ignore[no-any-return]


async def test_a_growing_jsonl_file_is_followed_line_by_line(tmp_path: Path) -> None:
    folder = tmp_path / "runs" / "job" / "version_0"
    folder.mkdir(parents=True)
    path = folder / "records.jsonl"
    _write_jsonl(path, [("loss", s, 100.0 + s, 1.0 / (s + 1)) for s in range(5)])
    catalog = Catalog([tmp_path / "runs"])
    catalog.load()
    [run] = catalog.runs()
    assert run.state == "live"  # written just now
    assert (await _scalars(catalog, run.id, "loss"))["step"] == [0, 1, 2, 3, 4]
    # More lines, and a torn one that is still being written.
    _write_jsonl(path, [("loss", 5, 105.0, math.nan), ("acc", 5, 105.0, 1)], mode="ab")
    with path.open("ab") as f:
        f.write(b'{"type":"PutRecord","name":"loss","value":0.1,"st')
    catalog.load()
    got = await _scalars(catalog, run.id, "loss")
    assert got["step"] == [0, 1, 2, 3, 4, 5]
    assert got["value"][-1] == "nan"
    assert (await _scalars(catalog, run.id, "acc"))["value"] == [1]
    with path.open("ab") as f:
        f.write(b'ep":6,"epoch":0,"time":106.0}\n')
    catalog.load()
    assert (await _scalars(catalog, run.id, "loss"))["step"] == [0, 1, 2, 3, 4, 5, 6]
    # Cut and written again (a resumed run drops the lines after its checkpoint).
    _write_jsonl(path.with_suffix(".new"), [("loss", s, 100.0 + s, 2.0) for s in range(3)])
    os.replace(path.with_suffix(".new"), path)
    catalog.load()
    got = await _scalars(catalog, run.id, "loss")
    assert got["step"] == [0, 1, 2]
    assert got["value"] == [2.0, 2.0, 2.0]
    # A run folder that appears later is found.
    (tmp_path / "runs" / "job" / "version_1").mkdir()
    _write_jsonl(tmp_path / "runs" / "job" / "version_1" / "records.jsonl", [("loss", 1, 1.0, 1.0)])
    catalog.scan()
    assert [r.id for r in catalog.runs()] == ["runs/job/version_0", "runs/job/version_1"]


async def test_a_csv_file_that_grows_a_column_is_read_again(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    path.write_text("step,epoch,time,loss\n1,0,10.5,0.5\n2,0,11.5,0.25\n")
    catalog = Catalog([path])
    catalog.load()
    [run] = catalog.runs()
    assert run.id == "metrics.csv"
    assert (await _scalars(catalog, run.id, "loss"))["value"] == [0.5, 0.25]
    with path.open("a") as f:
        f.write("3,1,12.5,0.125\n")
    catalog.load()
    assert (await _scalars(catalog, run.id, "loss"))["step"] == [1, 2, 3]
    # The CSV logger rewrites the file (a new inode) when a record name appears.
    new = tmp_path / "metrics.tmp"
    new.write_text(
        'step,epoch,time,loss,"val,acc"\n1,0,10.5,0.5,\n2,0,11.5,0.25,\n3,1,12.5,0.125,\n'
        "4,1,13.5,,True\n"
    )
    os.replace(new, path)
    catalog.load()
    assert (await _scalars(catalog, run.id, "loss"))["step"] == [1, 2, 3]
    assert (await _scalars(catalog, run.id, "val,acc")) == {
        "step": [4],
        "wall_time": [13.5],
        "value": [1.0],
    }
    assert [m["label"] for m in run.markers() if m["kind"] == "epoch"] == ["epoch 0", "epoch 1"]


@pytest.mark.parametrize(
    "run",
    [
        "..",
        "../outside",
        "/etc/passwd",
        "runs/../outside",
        "runs/escape",
        "runs/job/../../outside",
        "%2e%2e/outside",
    ],
)
async def test_no_query_reaches_a_file_outside_the_given_paths(tmp_path: Path, run: str) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    _write_jsonl(outside / "records.jsonl", [("secret", 1, 1.0, 42.0)])
    (outside / "run.json").write_text('{"secret": true}')
    runs = tmp_path / "runs"
    (runs / "job").mkdir(parents=True)
    _write_jsonl(runs / "job" / "records.jsonl", [("loss", 1, 1.0, 0.5)])
    (runs / "escape").symlink_to(outside, target_is_directory=True)  # a folder link out
    (runs / "linked").mkdir()
    (runs / "linked" / "records.jsonl").symlink_to(outside / "records.jsonl")  # a file link
    (runs / "job" / "run.json").symlink_to(outside / "run.json")
    catalog = Catalog([runs])
    catalog.load()
    assert [r.id for r in catalog.runs()] == ["runs/job"]
    async with _client(catalog) as client:
        listed = (await client.get("/api/runs")).json()
        assert listed[0]["run"] is None  # its run.json leads out: not read
        for name in ("secret", "loss"):
            answer = await client.get("/api/scalars", params={"run": run, "name": name})
            assert answer.status_code == 404
            assert "GET /api/runs lists them" in answer.text
        answer = await client.get(f"/api/scalars?run={run}&name=secret")
        assert answer.status_code == 404
        answer = await client.post("/api/csv", json={"runs": [run]})
        assert answer.status_code == 404
        assert "42" not in (await client.get("/api/csv")).text
        answer = await client.get(f"/static/{run}/records.jsonl")
        assert answer.status_code == 404


async def test_a_live_runs_history_before_the_page_opened_is_there(tmp_path: Path) -> None:
    """A job whose stream names its run folder: what it logged before the dashboard
    connected comes from the folder's log, the rest from the stream, each point once."""
    folder = tmp_path / "job" / "version_0"
    folder.mkdir(parents=True)
    log = folder / "records.jsonl"
    start = time.time() - 100
    _write_jsonl(log, [("train/loss", s, start + s, 1.0 / s) for s in range(1, 51)])
    socket = tmp_path / "job.sock"
    async with Server(host=None, path=socket, flush_interval=0) as server:
        server.run_dir = str(folder)
        server.publish_event(StageStarted(stage="fit", step=50, epoch=5, time=time.time()))
        dashboard = Dashboard([f"unix://{socket}"], labels=["job"], poll=0.05)
        async with anyio.create_task_group() as tg:
            tg.start_soon(dashboard.run)
            [feed] = dashboard.feeds
            with anyio.fail_after(30):
                while feed.state != "connected" or server.subscribers < 1:  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            for s in range(51, 101):  # put from now on: streamed, and logged as before
                record = PutRecord(name="train/loss", value=1.0 / s, step=s, time=time.time())
                server.publish_record(record)
                _write_jsonl(log, [(record.name, s, record.time, record.value)], mode="ab")
            with anyio.fail_after(30):
                while len(feed.run.series.get("train/loss") or ()) < 100:  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            await anyio.sleep(0.3)  # the log read once more: nothing is added twice
            got = await _scalars(dashboard.catalog, "job", "train/loss")
            tg.cancel_scope.cancel()
    assert got["step"] == list(range(1, 101))
    assert got["value"] == [1.0 / s for s in range(1, 101)]
    listed = feed.run.info()
    assert listed["source"] == f"unix://{socket}"
    assert listed["state"] == "live"


async def test_an_export_holds_what_live_jobs_put_until_then(tmp_path: Path) -> None:
    """``--export`` with a job's address: the report holds the job's history from its run
    folder and what it streamed until the export, beside the runs read from files."""
    folder = tmp_path / "job" / "version_0"
    folder.mkdir(parents=True)
    log = folder / "records.jsonl"
    start = time.time() - 100
    _write_jsonl(log, [("train/loss", s, start + s, 1.0 / s) for s in range(1, 21)])
    (tmp_path / "runs" / "old").mkdir(parents=True)
    _write_jsonl(tmp_path / "runs" / "old" / "records.jsonl", [("train/loss", 1, start, 9.0)])
    socket = tmp_path / "job.sock"
    report = tmp_path / "report.html"
    async with Server(host=None, path=socket, flush_interval=0) as server:
        server.run_dir = str(folder)
        server.publish_event(StageStarted(stage="fit", step=20, epoch=2, time=time.time()))
        async with anyio.create_task_group() as tg:
            done: list[Any] = []

            async def export() -> None:
                done.append(
                    await export_live(
                        [tmp_path / "runs"],
                        [f"unix://{socket}"],
                        report,
                        labels=["job"],
                        settle_s=60,  # left at once: the job's stage ends
                    )
                )

            tg.start_soon(export)
            with anyio.fail_after(30):
                while server.subscribers < 1:  # noqa: ASYNC110
                    await anyio.sleep(0.02)
            for s in range(21, 41):  # streamed only: the log does not have them
                server.publish_record(
                    PutRecord(name="train/loss", value=1.0 / s, step=s, time=time.time())
                )
            server.publish_event(
                StageEnded(stage="fit", reason="completed", step=40, epoch=4, time=time.time())
            )
    [(written, silent)] = done
    assert written == report
    assert silent == []
    html = report.read_text()
    data = msgspec.json.decode(html.split('type="application/json">')[1].split("</script>")[0])
    assert [r["id"] for r in data["runs"]] == ["runs/old", "job"]
    assert data["scalars"]["job"]["train/loss"]["step"] == list(range(1, 41))
    assert data["scalars"]["runs/old"]["train/loss"]["value"] == [9.0]


def test_a_smoothed_line_is_kept_until_its_series_changes_and_fits_any_x_order() -> None:
    series = Series()
    series.extend([1, 2, 3, 2, 3, 4], [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [1.0, 2.0, 3.0, 4.0, 5, 6])
    line = series.smoother(0.5)()
    assert series.smoother(0.5)() is line
    assert series.smoother(0.25)() is not line
    # A resumed run's steps go back: the columns are still the same as the raw line's.
    got = lines([x_of(series, "step", None)], None, None, 16, [series.smoother(0.5)()])
    assert len(got["s"][0]) == len(got["y"][0]) == len(got["x"])
    later = series.smoother(0.5)
    series.add(5, 7.0, 7.0)  # after the call: not in the line it returns
    assert len(later()) == 6
    assert len(series.smoother(0.5)()) == 7
