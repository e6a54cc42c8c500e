"""A web service that trains on request, built on Starlette and uvicorn.

    pip install -e ".[web,examples]"
    python examples/web_app.py                     # then open http://127.0.0.1:8000/
    uvicorn web_app:app --app-dir examples         # the same app under uvicorn's CLI

The API (JSON in and out):

    POST   /runs               start a run of the digits example; optional body
                               {"epochs": 30, "lr": 0.003, "seed": 0, "executor": "thread"}
    GET    /runs               every run's state
    GET    /runs/{id}          one run's state: running/completed/stopped/cancelled/failed,
                               step, epoch and the latest value of each record
    DELETE /runs/{id}          cancel it (?graceful=1: a stop request instead, which lets
                               the current step finish and fires FitCompleted)
    GET    /runs/{id}/events   its put records as Server-Sent Events, then an "end" event
    GET    /                   the loopbus dashboard page (docs/dashboard.md): a chart per
                               record name, one series per run, with a form above it
                               that starts and cancels runs
    GET    /events, /status    the dashboard's stream and table of runs; /static/...: its files

How it stays responsive: each run is a task in the app's task group awaiting
``trainer.fit``; with ``executor="thread"`` the steps run in a worker thread, so the event
loop that serves the requests only does the short work between steps. A run's records
reach the browsers without ever making the step wait: a queued subscriber (drop policy,
counted in ``dropped``) appends each encoded record to the run's log and hands it to the
run's feed of the app's ``loopbus.dashboard.Hub``, which batches what the runs sent into
one message every 0.1 s for the dashboard page. Every Server-Sent Events client (of
``/runs/{id}/events`` or of the page) reads its log at its own pace from its own
position. A slow browser only falls behind; on reconnecting, ``Last-Event-ID`` resumes
where it stopped.
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Annotated, Any, Literal

import anyio
import anyio.to_thread
import msgspec
import torch
from anyio.abc import TaskGroup
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from loopbus import PutRecord, Trainer
from loopbus.dashboard import Hub, RunFeed, routes
from loopbus.events import EpochCompleted

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # the digits example sits next to this file
    sys.path.insert(0, str(HERE))
from digits import DigitsNet, digits_loaders  # noqa: E402

#: Runs training at the same time; more get 429 Too Many Requests.
MAX_ACTIVE_RUNS = 4
#: Seconds between keep-alive comments on an idle event stream.
KEEPALIVE = 15.0
#: The largest body ``POST /runs`` reads, in bytes (a run configuration is a few dozen):
#: a larger one gets 413 and is not read further.
MAX_BODY = 16 * 1024

_encode = msgspec.json.Encoder().encode


class RunConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The body of ``POST /runs`` (every field optional)."""

    epochs: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 30
    lr: Annotated[float, msgspec.Meta(gt=0, le=1)] = 3e-3
    seed: Annotated[int, msgspec.Meta(ge=0)] = 0
    batch_size: Annotated[int, msgspec.Meta(ge=1, le=4096)] = 64
    executor: Literal["thread", "inline"] = "thread"


class Run:
    """One training run: its trainer, its state, the log of its encoded records and its
    feed on the dashboard page."""

    def __init__(self, config: RunConfig, feed: RunFeed) -> None:
        self.id = feed.label
        self.feed = feed
        self.config = config
        self.state = "starting"
        self.error: str | None = None
        self.created = time.time()
        self.started: float | None = None
        self.ended: float | None = None
        self.trainer = Trainer(
            max_epochs=config.epochs, executor=config.executor, plugins=[], device="cpu"
        )
        self.latest: dict[str, float | int | bool] = {}
        self.log: list[bytes] = []  # encoded records; a record's event id is its index
        self.dropped = 0
        self._changed = anyio.Event()
        self._scope = anyio.CancelScope()
        self._subscription = self.trainer.subscribe(
            PutRecord,
            self._on_record,
            mode="queued",  # the step never waits for the browsers
            overflow="drop",
            buffer=4096,
            destination="external",
        )
        self._epochs = self.trainer.subscribe(EpochCompleted, self._on_epoch)

    @property
    def finished(self) -> bool:
        return self.ended is not None

    def info(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "state": self.state,
            "config": msgspec.structs.asdict(self.config),
            "step": self.trainer.global_step,
            "epoch": self.trainer.current_epoch,
            "latest": self.latest,
            "records": len(self.log),
            "dropped": self._subscription.dropped,
            "error": self.error,
            "created": self.created,
            "started": self.started,
            "ended": self.ended,
        }

    # -- training, as a task of the app's task group
    async def train(self) -> None:
        try:
            with self._scope:
                self.state = "running"
                self.started = time.time()
                self.feed.started("fit", 0, 0)
                try:
                    module, train, val = await anyio.to_thread.run_sync(self._build)
                    await self.trainer.fit(module, train, val)
                except Exception as exc:  # the run failed; the service goes on
                    self.state = "failed"
                    self.error = f"{type(exc).__name__}: {exc}"
                else:
                    self.state = "stopped" if self.trainer.should_stop else "completed"
            if self._scope.cancelled_caught:
                self.state = "cancelled"
        except BaseException:  # the app itself is shutting down
            self.state = "cancelled"
            raise
        finally:
            self._subscription.unsubscribe()
            self._epochs.unsubscribe()
            self.ended = time.time()
            self.feed.stage_ended("fit", self.state, self.trainer.global_step)
            if self.error is not None:
                self.feed.set_state("failed", self.error)
            else:
                self.feed.set_state("ended", self.state)
            self._notify()

    def _build(self) -> tuple[DigitsNet, Any, Any]:
        config = self.config
        torch.manual_seed(config.seed)
        module = DigitsNet(lr=config.lr, epochs=config.epochs)
        train, val = digits_loaders(batch_size=config.batch_size, seed=config.seed)
        return module, train, val

    def cancel(self, graceful: bool = False) -> None:
        if self.finished:
            return
        if graceful and self.trainer.stage is not None:
            self.trainer.request_stop("stop requested over HTTP")
            self.state = "stopping"
            return
        self._scope.cancel()
        self.state = "cancelling"

    # -- records
    def _on_record(self, record: PutRecord) -> None:
        self.latest[record.name] = record.value
        self.log.append(_encode(record))
        self.feed.record(record.name, record.value, record.step, record.epoch)
        self._notify()

    def _on_epoch(self, event: EpochCompleted) -> None:
        # Inline, once an epoch: a boundary on the page's charts.
        self.feed.epoch_ended(event.epoch, event.step)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def follow(self, start: int) -> AsyncIterator[bytes]:
        """Server-Sent Events from record ``start`` on: the log so far, then new records
        as they come, then an ``end`` event with the final state."""
        sent = start
        while True:
            if sent < len(self.log):
                chunk = [
                    b"id: %d\ndata: %s\n\n" % (i, self.log[i]) for i in range(sent, len(self.log))
                ]
                sent = len(self.log)
                yield b"".join(chunk)
                continue
            if self.finished:
                yield b"event: end\ndata: %s\n\n" % _encode(self.info())
                return
            changed = self._changed
            with anyio.move_on_after(KEEPALIVE) as idle:
                await changed.wait()
            if idle.cancelled_caught:
                yield b": keep-alive\n\n"


class Runs:
    """The app's runs, trained as tasks of its task group, each a series on ``hub``'s
    page."""

    def __init__(self, task_group: TaskGroup, hub: Hub) -> None:
        self._tg = task_group
        self.hub = hub
        self.runs: dict[str, Run] = {}

    def active(self) -> int:
        return sum(not run.finished for run in self.runs.values())

    def start(self, config: RunConfig) -> Run:
        run = Run(config, self.hub.add_run(uuid.uuid4().hex[:8]))
        self.runs[run.id] = run
        self._tg.start_soon(run.train, name=f"training run {run.id}")
        return run


# ---------------------------------------------------------------- HTTP
def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_encode(body), status, headers, media_type="application/json")


def _runs(request: Request) -> Runs:
    runs: Runs = request.app.state.runs
    return runs


def _find(request: Request) -> Run | Response:
    run = _runs(request).runs.get(request.path_params["run_id"])
    if run is None:
        return _json({"error": f"no run {request.path_params['run_id']!r}"}, 404)
    return run


async def list_runs(request: Request) -> Response:
    return _json([run.info() for run in _runs(request).runs.values()])


async def _read_body(request: Request) -> bytes | None:
    """The request's body; None once it is longer than ``MAX_BODY`` (reading stops)."""
    body = bytearray()
    async with aclosing(request.stream()) as chunks:
        async for chunk in chunks:
            body += chunk
            if len(body) > MAX_BODY:
                return None
    return bytes(body)


def _resume_at(last: str | None) -> int | None:
    """The first record a reconnecting client wants: one past its ``Last-Event-ID``, 0
    without one; None if that is not a record number (at most 20 characters, so that
    ``int`` never reads a long string)."""
    if last is None:
        return 0
    if len(last) > 20:
        return None
    try:
        return max(int(last) + 1, 0)
    except ValueError:
        return None


async def start_run(request: Request) -> Response:
    # Untrusted input: a bounded body, decoded into a typed schema (RunConfig refuses
    # unknown keys, so nothing in the body is skipped or nested deeper than its fields).
    body = await _read_body(request)
    if body is None:
        return _json({"error": f"the body is larger than {MAX_BODY} bytes"}, 413)
    try:
        config = msgspec.json.decode(body, type=RunConfig) if body.strip() else RunConfig()
    except msgspec.ValidationError as exc:
        return _json({"error": f"invalid run configuration: {exc}"}, 422)
    except msgspec.DecodeError as exc:
        return _json({"error": f"the body is not JSON: {exc}"}, 400)
    runs = _runs(request)
    if runs.active() >= MAX_ACTIVE_RUNS:
        return _json(
            {"error": f"{MAX_ACTIVE_RUNS} runs are training already; wait or cancel one."}, 429
        )
    run = runs.start(config)
    return _json(run.info(), 201, {"Location": f"/runs/{run.id}"})


async def get_run(request: Request) -> Response:
    run = _find(request)
    return run if isinstance(run, Response) else _json(run.info())


async def cancel_run(request: Request) -> Response:
    run = _find(request)
    if isinstance(run, Response):
        return run
    graceful = request.query_params.get("graceful", "").lower() in ("1", "true", "yes")
    finished = run.finished
    run.cancel(graceful)
    return _json(run.info(), 200 if finished else 202)


async def run_events(request: Request) -> Response:
    run = _find(request)
    if isinstance(run, Response):
        return run
    last = request.headers.get("last-event-id") or request.query_params.get("after")
    start = _resume_at(last)
    if start is None:
        shown = (last or "")[:40]
        return _json({"error": f"Last-Event-ID must be a record number, got {shown!r}"}, 400)
    return StreamingResponse(
        run.follow(start),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


#: Placed above the dashboard's charts: a form that starts a run (POST /runs) and a
#: cancel button for each run that trains (DELETE /runs/{id}), kept up to date from the
#: page's "loopbus:status" event (the runs' labels are their ids).
CONTROLS = """
<form id="start" class="controls">
  <label>epochs <input name="epochs" type="number" min="1" max="10000" value="100"></label>
  <label>learning rate <input name="lr" type="number" step="any" min="0" value="0.003"></label>
  <label>executor
    <select name="executor"><option>thread</option><option>inline</option></select></label>
  <button type="submit">Start a run</button>
  <output id="start-result"></output>
  <span id="cancel"></span>
</form>
<script>
(() => {
  const form = document.getElementById("start");
  const result = document.getElementById("start-result");
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    const body = {
      epochs: Number(form.epochs.value),
      lr: Number(form.lr.value),
      executor: form.executor.value,
    };
    const response = await fetch("runs", { method: "POST", body: JSON.stringify(body) });
    const answer = await response.json();
    result.textContent = response.ok ? `started ${answer.id}` : answer.error;
    result.dataset.run = response.ok ? answer.id : "";
  });
  document.addEventListener("loopbus:status", (e) => {
    const training = e.detail.filter((run) => run.state === "connected");
    const box = document.getElementById("cancel");
    if (box.dataset.runs === training.map((run) => run.label).join()) return;
    box.dataset.runs = training.map((run) => run.label).join();
    box.replaceChildren(...training.map((run) => {
      const button = document.createElement("button");
      button.type = "button";
      button.textContent = `cancel ${run.label}`;
      button.onclick = () => fetch(`runs/${run.label}`, { method: "DELETE" });
      return button;
    }));
  });
})();
</script>
"""
TITLE = "loopbus: live training of the digits example"


def create_app() -> Starlette:
    hub = Hub()

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(hub.run, name="dashboard flush")
            app.state.runs = Runs(tg, hub)
            yield
            # Shutting down: cancel what still trains (its teardown events still fire).
            tg.cancel_scope.cancel()

    return Starlette(
        routes=[
            Route("/runs", list_runs, methods=["GET"]),
            Route("/runs", start_run, methods=["POST"]),
            Route("/runs/{run_id}", get_run, methods=["GET"]),
            Route("/runs/{run_id}", cancel_run, methods=["DELETE"]),
            Route("/runs/{run_id}/events", run_events, methods=["GET"]),
            # The dashboard's page (with the form above), /events, /status and /static.
            *routes(hub, title=TITLE, controls=CONTROLS),
        ],
        lifespan=lifespan,
    )


app = create_app()


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="Serve the training web app.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
