from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch

import loopbus
from loopbus import HandlerError, Module, Plugin, PutRecord, Trainer, on
from loopbus.events import FitCompleted, TrainBatchCompleted, ValidationCompleted
from loopbus.plugins import CSVLogger, JSONLLogger, Logger, TensorBoardLogger, read_csv, read_jsonl
from tests.helpers import ROOT, TinyModule, make_loader

REPO = ROOT


class Captured(Plugin):
    """An inline subscriber in the loggers' role: the records the loggers were sent."""

    delivery = loopbus.Delivery(destination="loggers")

    def __init__(self) -> None:
        self.records: list[PutRecord] = []

    @on(PutRecord)
    def keep(self, record: PutRecord) -> None:
        self.records.append(record)


class MetricsModule(TinyModule):
    """Puts a few kinds of value, a name that appears late, and an epoch-level metric."""

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        loss = super().training_step(batch, ctx)
        self.put("train/flag", bool(self.trainer.global_step % 2))
        self.put("train/count", self.trainer.global_step)
        if self.trainer.current_epoch == 1:
            self.put("train/late", 1.5)
        return loss

    @on(ValidationCompleted)
    def epoch_metric(self, event: ValidationCompleted) -> None:
        self.put("val/score", 0.25 * (event.epoch + 1), destinations=("loggers",))


def expected_rows(records: Sequence[PutRecord]) -> list[dict[str, Any]]:
    """CSVLogger's documented grouping: a row per (step, epoch); a repeated name starts
    another row for the same step."""
    rows: list[dict[str, Any]] = []
    row: dict[str, Any] = {}
    for r in records:
        if row and ((r.step, r.epoch) != (row["step"], row["epoch"]) or r.name in row):
            rows.append(row)
            row = {}
        if not row:
            row = {"step": r.step, "epoch": r.epoch, "time": r.time}
        row[r.name] = r.value
    if row:
        rows.append(row)
    return rows


async def test_csv_and_jsonl_contents_equal_the_put_records(tmp_path: Path) -> None:
    captured = Captured()
    trainer = Trainer(
        max_epochs=2,
        plugins=[captured, CSVLogger(tmp_path, name="", version=""), JSONLLogger(tmp_path, name="", version="")],
        device="cpu",
    )
    await trainer.fit(MetricsModule(), make_loader(n=64), make_loader(n=32))

    records = captured.records
    names = {r.name for r in records}
    assert names == {
        "train/loss",
        "train/flag",
        "train/count",
        "train/late",
        "val/loss",
        "val/score",
    }
    # JSON lines: the same records, field for field, in the same order.
    assert read_jsonl(tmp_path / "records.jsonl") == records
    # CSV: step for step the same values (bools, ints and floats as they were put).
    rows = read_csv(tmp_path / "metrics.csv")
    assert rows == expected_rows(records)
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, 9))
    assert all(
        type(r["train/flag"]) is bool and type(r["train/count"]) is int
        for r in rows
        if "train/flag" in r
    )
    # The header grew when train/late and val/score appeared; old rows kept their values.
    header = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert header[:3] == ["step", "epoch", "time"]
    assert header.index("train/late") > header.index("val/loss")
    first = rows[0]
    assert "train/late" not in first
    assert first["train/count"] == 0


async def test_values_json_cannot_represent_round_trip(tmp_path: Path) -> None:
    class Odd(TinyModule):
        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            self.put("nan", math.nan)
            self.put("inf", math.inf)
            self.put("-inf", -math.inf)
            self.put('name, with "quotes"', 1.0)
            self.put("step", 7)  # collides with a fixed CSV column
            return super().training_step(batch, ctx)

    trainer = Trainer(
        max_steps=2, plugins=[CSVLogger(tmp_path, name="", version=""), JSONLLogger(tmp_path, name="", version="")], device="cpu"
    )
    await trainer.fit(Odd(), make_loader(n=32))
    by_name = {r.name: r.value for r in read_jsonl(tmp_path / "records.jsonl")}
    assert math.isnan(by_name["nan"])
    assert by_name["inf"] == math.inf
    assert by_name["-inf"] == -math.inf
    row = read_csv(tmp_path / "metrics.csv")[0]
    assert math.isnan(row["nan"])
    assert row["inf"] == math.inf
    assert row["-inf"] == -math.inf
    assert row['name, with "quotes"'] == 1.0
    assert row["step"] == 1
    assert row["step (put)"] == 7


async def test_loggers_flush_when_the_run_fails(tmp_path: Path) -> None:
    class Crash(TinyModule):
        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            if self.trainer.global_step == 4:
                raise RuntimeError("boom at step 4")
            return super().training_step(batch, ctx)

    # A long flush interval: only the end-of-stage flush can have written the records.
    loggers = [CSVLogger(tmp_path, flush_interval=60, name="", version=""), JSONLLogger(tmp_path, flush_interval=60, name="", version="")]
    trainer = Trainer(max_epochs=3, plugins=loggers, device="cpu")
    with pytest.raises(RuntimeError, match="boom at step 4"):
        await trainer.fit(Crash(), make_loader(n=128))
    assert [r.step for r in read_jsonl(tmp_path / "records.jsonl")] == [1, 2, 3, 4]
    assert [r["step"] for r in read_csv(tmp_path / "metrics.csv")] == [1, 2, 3, 4]


async def test_a_later_stage_appends_and_mode_a_resumes(tmp_path: Path) -> None:
    csv_logger, jsonl_logger = CSVLogger(tmp_path, name="", version=""), JSONLLogger(tmp_path, name="", version="")
    trainer = Trainer(max_steps=2, plugins=[csv_logger, jsonl_logger], device="cpu")
    module = TinyModule()
    await trainer.fit(module, make_loader(n=32))
    await trainer.validate(module, make_loader(n=32))
    names = [r.name for r in read_jsonl(tmp_path / "records.jsonl")]
    assert names == ["train/loss", "train/loss", "val/loss", "val/loss"]

    # A killed run left a torn last line; a resumed run with mode="a" cuts it and goes on.
    with (tmp_path / "records.jsonl").open("ab") as f:
        f.write(b'{"type":"PutRecord","name":"tor')
    with (tmp_path / "metrics.csv").open("a") as f:
        f.write("3,0,12.5,0.")
    resumed = Trainer(
        max_steps=1,
        plugins=[CSVLogger(tmp_path, mode="a", name="", version=""), JSONLLogger(tmp_path, mode="a", name="", version="")],
        device="cpu",
    )
    await resumed.fit(TinyModule(), make_loader(n=32))
    records = read_jsonl(tmp_path / "records.jsonl")
    assert [r.name for r in records] == [*names, "train/loss"]
    rows = read_csv(tmp_path / "metrics.csv")
    assert [r["step"] for r in rows] == [1, 2, 2, 2, 1]
    assert set(rows[-1]) == {"step", "epoch", "time", "train/loss"}


def test_bad_options_are_reported(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"mode=.*'w'.*'a'.*got 'x'"):
        CSVLogger(tmp_path, mode="x", name="", version="")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"flush_interval=.*got -1"):
        JSONLLogger(tmp_path, flush_interval=-1, name="", version="")
    with pytest.raises(ValueError, match=r"buffer=.*got 0"):
        JSONLLogger(tmp_path, buffer=0, name="", version="")
    with pytest.raises(ValueError, match=r"overflow=.*got 'later'"):
        JSONLLogger(tmp_path, overflow="later", name="", version="")  # type: ignore[arg-type]


async def test_csv_of_another_program_is_not_appended_to(tmp_path: Path) -> None:
    (tmp_path / "metrics.csv").write_text("a,b\n1,2\n")
    trainer = Trainer(max_steps=1, plugins=[CSVLogger(tmp_path, mode="a", name="", version="")], device="cpu")
    with pytest.raises(ValueError, match="was not written by CSVLogger"):
        await trainer.fit(TinyModule(), make_loader(n=32))
    assert (tmp_path / "metrics.csv").read_text() == "a,b\n1,2\n"


# ---------------------------------------------------------------- a slow sink
class Steps(Plugin):
    """Counts the completed training steps, for a writer thread to wait on."""

    def __init__(self) -> None:
        self.completed = 0
        self.changed = threading.Condition()
        self.dropped = -1

    @on(TrainBatchCompleted)
    def step_done(self, event: TrainBatchCompleted) -> None:
        with self.changed:
            self.completed += 1
            self.changed.notify_all()

    @on(FitCompleted)
    def fit_completed(self, event: FitCompleted) -> None:
        self.dropped = sum(
            s.dropped for s in self.trainer.bus.subscriptions if s.owner.startswith("HeldSink")
        )

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer


class HeldSink(Logger):
    """A destination whose write of a batch is held until the run has completed more steps:
    ``lead`` steps past the batch's newest record, or (``lead=None``) all ``n``. Were the
    steps to wait for the write, they could not complete: the wait has a deadline only so
    that this fails instead of hanging."""

    def __init__(self, steps: Steps, n: int, lead: int | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.steps = steps
        self.n = n
        self.lead = lead
        self.got: list[PutRecord] = []

    def write(self, records: Sequence[PutRecord]) -> None:
        if not records:
            return
        newest = max(r.step for r in records)
        until = self.n if self.lead is None else min(newest + self.lead, self.n)
        with self.steps.changed:
            if not self.steps.changed.wait_for(lambda: self.steps.completed >= until, 60):
                raise AssertionError(
                    f"the steps stopped at {self.steps.completed} while a write of the "
                    f"records up to step {newest} waited for step {until}"
                )
        self.got.extend(records)


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(2, 4), torch.tensor([0, 1]))] * n


async def test_a_slow_sink_overlaps_with_the_steps() -> None:
    # Each write is held until the steps have gone two past its newest record: the steps
    # run while the sink writes. (What that saves: benchmarks/slow_logger.py.)
    n = 12
    steps = Steps()
    sink = HeldSink(steps, n, lead=2, flush_interval=0.005)
    trainer = Trainer(max_steps=n, plugins=[steps, sink], device="cpu")
    await trainer.fit(TinyModule(), batches(n))
    assert [r.step for r in sink.got] == list(range(1, n + 1))  # "block": every record


async def test_a_slow_sink_does_not_slow_the_steps_while_its_buffer_has_room() -> None:
    # The first write is held until every step has completed: the other records wait in
    # the sink's buffer, which has room for them, and the steps never wait.
    n = 8
    steps = Steps()
    sink = HeldSink(steps, n, buffer=8, flush_interval=0)
    trainer = Trainer(max_steps=n, plugins=[steps, sink], device="cpu")
    await trainer.fit(TinyModule(), batches(n))
    assert steps.completed == n
    # fit returned after the sink got everything
    assert [r.step for r in sink.got] == list(range(1, n + 1))
    assert steps.dropped == 0


async def test_stop_between_the_due_checks_wake_up_and_its_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The race CI met: the due check's sleep ended (its task is ready to run) and stop()
    # ran before the task's turn, taking the writer away. The check must see that it was
    # stopped, and every record is still written once, by stop().
    from types import SimpleNamespace

    from loopbus.plugins.loggers import _base as _loggers

    woken = anyio.Event()
    asleep = anyio.Event()

    async def sleep(period: float) -> None:
        asleep.set()
        await woken.wait()  # ready to run once woken is set; runs at its next turn

    fake = SimpleNamespace(**{k: getattr(anyio, k) for k in dir(anyio) if not k.startswith("__")})
    fake.sleep, fake.to_thread = sleep, anyio.to_thread
    monkeypatch.setattr(_loggers, "anyio", fake)

    class Collect(Logger):
        def __init__(self) -> None:
            super().__init__(flush_interval=3600, buffer=100)
            self.got: list[str] = []

        def write(self, records: Sequence[PutRecord]) -> None:
            self.got.extend(r.name for r in records)
            written.set()

    written = threading.Event()
    real_sleep = anyio.sleep
    sink = Collect()
    trainer = SimpleNamespace(module=None)
    async with anyio.create_task_group() as tg:
        await sink.start(trainer, "validate", tg)  # type: ignore[arg-type]
        await asleep.wait()
        for name in ("a", "b"):  # "a" is handed over at once, "b" waits to be due
            await sink.receive(PutRecord(name=name, value=1.0, step=1, time=0.0, source="t"))
        await anyio.to_thread.run_sync(written.wait)
        await real_sleep(0.05)  # the write of "a" is done: a due check would hand "b" over
        woken.set()
        await sink.stop(trainer, "validate")  # type: ignore[arg-type]
    sink.teardown(trainer, "validate")  # type: ignore[arg-type]
    assert sink.got == ["a", "b"]


async def test_a_dropping_sink_never_holds_the_steps() -> None:
    # The first write is held until every step has completed: the buffer of two fills,
    # and what does not fit is dropped, not waited for.
    n = 60
    steps = Steps()
    sink = HeldSink(steps, n, buffer=2, overflow="drop", flush_interval=0)
    trainer = Trainer(max_steps=n, plugins=[steps, sink], device="cpu")
    await trainer.fit(TinyModule(), batches(n))
    assert steps.completed == n
    assert steps.dropped > 0
    assert len(sink.got) + steps.dropped == n


async def test_a_failing_sink_fails_the_run_naming_the_logger() -> None:
    class Broken(Logger):
        def write(self, records: Sequence[PutRecord]) -> None:
            raise OSError("disk full")

    trainer = Trainer(max_steps=200, plugins=[Broken(flush_interval=0, buffer=2)], device="cpu")
    with pytest.raises(
        HandlerError,
        match=r"Broken\.receive raised RuntimeError.*Broken could not write: disk full",
    ):
        await trainer.fit(TinyModule(), make_loader(n=16 * 200, batch_size=16))


# ---------------------------------------------------------------- killed mid-run
_KILLED_SCRIPT = textwrap.dedent(
    """
    import sys, time
    import torch
    import loopbus
    from loopbus import Module, Trainer
    from loopbus.plugins import CSVLogger, JSONLLogger

    class Net(Module):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(4, 2)

        def training_step(self, batch, ctx):
            x, y = batch
            loss = torch.nn.functional.cross_entropy(self.layer(x), y)
            self.put("train/loss", loss)
            step = self.trainer.global_step + 1  # the step this record will carry
            self.put("train/step", step)
            if step % 7 == 0:
                self.put(f"train/new_{step}", 1.0)
            time.sleep(0.002)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    out = sys.argv[1]
    batches = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))] * 50
    trainer = Trainer(
        max_epochs=100000,
        plugins=[CSVLogger(out, flush_interval=0.01, name="", version=""), JSONLLogger(out, flush_interval=0.01, name="", version="")],
        device="cpu",
    )
    loopbus.run(trainer.fit, Net(), batches)
    """
)


@pytest.mark.external
def test_a_killed_run_leaves_files_readable_up_to_the_last_complete_line(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_KILLED_SCRIPT)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen([sys.executable, str(script), str(out)], env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        jsonl = out / "records.jsonl"
        while time.monotonic() < deadline:
            if jsonl.exists() and jsonl.stat().st_size > 40_000:
                break
            assert proc.poll() is None, "the training script ended on its own"
            time.sleep(0.02)
        else:
            pytest.fail("the training script wrote too little in 60 s")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    records = read_jsonl(out / "records.jsonl")
    assert len(records) > 100
    raw = (out / "records.jsonl").read_bytes()
    assert raw.count(b"\n") == len(records)  # every complete line decoded
    steps = [r.value for r in records if r.name == "train/step"]
    assert steps == list(range(1, len(steps) + 1))

    rows = read_csv(out / "metrics.csv")
    assert len(rows) > 10
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    assert all(r["train/step"] == r["step"] for r in rows)
    header = (out / "metrics.csv").read_text().splitlines()[0].split(",")
    for row in rows:  # a column added after a row was written is empty in that row
        for name in row:
            assert name in header
        for name in (h for h in header if h.startswith("train/new_")):
            assert (name in row) == (int(name.rsplit("_", 1)[1]) == row["step"])


# ---------------------------------------------------------------- TensorBoard
async def test_tensorboard_logger_writes_scalars_by_step(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    captured = Captured()
    trainer = Trainer(
        max_steps=5, plugins=[captured, TensorBoardLogger(tmp_path / "tb", name="", version="")], device="cpu"
    )
    await trainer.fit(TinyModule(), make_loader(n=16 * 5))
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    scalars = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    expected = [(r.step, r.value) for r in captured.records if r.name == "train/loss"]
    assert [s for s, _ in scalars] == [s for s, _ in expected] == [1, 2, 3, 4, 5]
    assert [v for _, v in scalars] == pytest.approx([v for _, v in expected], rel=1e-6)


async def test_csv_names_that_collide_after_renaming_get_columns_of_their_own(
    tmp_path: Path,
) -> None:
    """'step' is renamed 'step (put)' (the fixed column is taken): a record that is
    itself named 'step (put)' gets another column instead of crashing the logger."""
    class Clash(Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Linear(1, 1)

        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            self.put("step", 1.0)
            self.put("step (put)", 2.0)
            return self.w(batch).sum()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    logger = CSVLogger(tmp_path, name="", version="")
    trainer = Trainer(max_steps=3, plugins=[logger], device="cpu")
    await trainer.fit(Clash(), [torch.ones(2, 1)] * 3)
    text = (tmp_path / "metrics.csv").read_text()
    header = text.splitlines()[0]
    assert "step (put)" in header
    assert "step (put) (2)" in header
    assert len(text.splitlines()) == 4
