"""Embedding the engine in an async application: a responsive host, clean cancellation
and stop requests, concurrent runs in one event loop, and running-loop detection."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from pathlib import Path
from typing import Any

import anyio
import anyio.from_thread
import anyio.to_thread
import pytest
import torch
from anyio.lowlevel import checkpoint
from torch.utils.data import DataLoader, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import loopbus
from loopbus import Module, Plugin, PutRecord, Trainer, on
from loopbus.events import (
    AfterBackward,
    BeforeOptimizerStep,
    EpochCompleted,
    Event,
    ExceptionRaised,
    FitCompleted,
    FitStarted,
    PredictBatchCompleted,
    Teardown,
    TestBatchCompleted,
    TrainBatchCompleted,
    TrainBatchStarted,
    TrainEpochStarted,
    ValidationBatchCompleted,
    ValidationCompleted,
    ValidationStarted,
)
from loopbus.plugins import Checkpoint
from tests.helpers import TinyModule, make_loader

EXECUTORS = ["inline", "thread"]

# Worker-thread pools keep idle threads for a while after a run (anyio: "AnyIO worker
# thread", trio: "Trio thread N"); they belong to the event loop, not to a run.
_POOL_PREFIXES = ("AnyIO worker thread", "Trio thread")


def _own_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if not t.name.startswith(_POOL_PREFIXES)}


def _open_files_under(folder: Path) -> list[str]:
    fd_dir = Path("/proc/self/fd")
    if not fd_dir.is_dir():  # not Linux: nothing to inspect
        return []
    found = []
    for fd in list(fd_dir.iterdir()):
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith(str(folder)):
            found.append(target)
    return found


def _loader(seed: int, n: int = 96, batch_size: int = 8) -> DataLoader[Any]:
    """Shuffled batches drawn from a generator of the run's own (no global RNG)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] > 0).long()
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=True, generator=g)


def _stateful_loader() -> StatefulDataLoader:
    """A loader whose position is checkpointed (resuming mid-epoch is then O(1))."""
    return StatefulDataLoader(make_loader(n=96).dataset, batch_size=8)


def _module(seed: int) -> TinyModule:
    torch.manual_seed(seed)
    return TinyModule()


# ---------------------------------------------------------------- plugins used below
class Witness(Plugin):
    """Records the closing events (inline) and what the plugin lifecycle saw."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.records = 0
        self.stopped = False
        self.torn_down = False

    @on(PutRecord)
    def count(self, record: PutRecord) -> None:
        self.records += 1

    @on(FitStarted)
    @on(FitCompleted)
    @on(ExceptionRaised)
    @on(Teardown)
    def closing(self, event: Any) -> None:
        if isinstance(event, FitCompleted):
            self.events.append(f"FitCompleted(stopped={event.stopped})")
        elif isinstance(event, Teardown):
            self.events.append(f"Teardown({event.reason})")
        else:
            self.events.append(type(event).__name__)

    async def stop(self, trainer: Trainer, stage: str) -> None:
        self.stopped = True

    def teardown(self, trainer: Trainer, stage: str) -> None:
        self.torn_down = True


class SlowFileLogger(Plugin):
    """A queued logger that is slower than the step, so records wait in its queue; it
    owns a file from setup to teardown."""

    delivery = loopbus.Delivery(destination="loggers", mode="queued")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file: Any = None
        self.lines = 0

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.file = self.path.open("a", encoding="utf-8")

    @on(PutRecord)
    async def write(self, record: PutRecord) -> None:
        await checkpoint()
        await checkpoint()
        self.file.write(f"{record.name} {record.step} {record.value}\n")
        self.lines += 1

    @on(Teardown)
    def last(self, event: Teardown) -> None:
        self.file.write(f"teardown {event.reason}\n")

    def teardown(self, trainer: Trainer, stage: str) -> None:
        self.file.close()


class CountingModule(TinyModule):
    """Counts steps in progress (0 once nothing runs in a worker thread any more)."""

    def __init__(self) -> None:
        super().__init__()
        self.in_step = 0

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        self.in_step += 1
        try:
            return super().training_step(batch, ctx)
        finally:
            self.in_step -= 1


# ---------------------------------------------------------------- responsiveness
class Heartbeat:
    """A host application's other task, made countable: it beats every millisecond, and a
    step running in a worker thread can wait until it has beaten a few more times."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = threading.Condition()

    async def run(self, done: anyio.Event) -> None:
        while not done.is_set():
            await anyio.sleep(0.001)
            with self._changed:
                self.count += 1
                self._changed.notify_all()

    def wait_for_beats(self, since: int, beats: int) -> bool:
        """Wait until ``beats`` beats past ``since``; False at a deadline that only turns a
        heartbeat that cannot run into a failure instead of a hang."""
        with self._changed:
            return self._changed.wait_for(lambda: self.count >= since + beats, timeout=30)


class BusyModule(Module):
    """A step of real CPU work (a few ms) that counts the host's beats during it and, if
    asked, does not end before the host has beaten ``wait_beats`` times."""

    def __init__(self, heartbeat: Heartbeat, wait_beats: int = 0) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(512, 512)
        self.heartbeat = heartbeat
        self.wait_beats = wait_beats
        self.beats_at: list[tuple[int, int]] = []  # the beat count at each step's start, end

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        first = self.heartbeat.count
        h: torch.Tensor = batch
        for _ in range(6):
            h = torch.tanh(self.layer(h))
        loss = h.square().mean()
        self.put("train/loss", loss)
        if self.wait_beats and not self.heartbeat.wait_for_beats(first, self.wait_beats):
            raise AssertionError("the host's heartbeat did not beat while the step ran")
        self.beats_at.append((first, self.heartbeat.count))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


async def _beat_during_run(executor: str, wait_beats: int = 0) -> BusyModule:
    torch.manual_seed(0)
    heartbeat = Heartbeat()
    module = BusyModule(heartbeat, wait_beats)
    batches = [torch.randn(256, 512) for _ in range(8)]
    trainer = Trainer(max_steps=30, plugins=[], executor=executor, device="cpu")  # type: ignore[arg-type]
    done = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat.run, done)
        await trainer.fit(module, batches)
        done.set()
    return module


async def test_thread_executor_keeps_a_heartbeat_ticking() -> None:
    # Each step, in the worker thread, waits for three beats of a task on the event loop:
    # were the step to hold the loop, the heartbeat could not beat and the step would fail.
    # (How late the heartbeat gets is a figure of benchmarks/lag.py, not a test.)
    module = await _beat_during_run("thread", wait_beats=3)
    assert len(module.beats_at) == 30
    assert all(end - start >= 3 for start, end in module.beats_at), module.beats_at


async def test_inline_executor_holds_the_loop_during_a_step() -> None:
    module = await _beat_during_run("inline")
    # No other task can run while an inline step computes: no beat falls inside a step,
    # though the heartbeat beats between steps. This is what executor="thread" is for.
    assert len(module.beats_at) == 30
    assert all(start == end for start, end in module.beats_at), module.beats_at
    assert module.beats_at[-1][1] > module.beats_at[0][0]


# ---------------------------------------------------------------- cancellation
_CANCEL_EVENTS: list[type[Event]] = [
    FitStarted,
    TrainEpochStarted,
    TrainBatchStarted,
    AfterBackward,
    BeforeOptimizerStep,
    TrainBatchCompleted,
    PutRecord,
    ValidationStarted,
    ValidationBatchCompleted,
    ValidationCompleted,
    EpochCompleted,
]


_ONCE_PER_EPOCH = (TrainEpochStarted, EpochCompleted)


def _cancel_plan(seed: int) -> tuple[str, Any, int, bool]:
    """Where to cancel: from a handler of the nth event of a type, at a deadline, or
    from another task after the nth training batch; and whether checkpoints are written
    in the background."""
    rnd = random.Random(seed)
    how = rnd.choice(["event", "event", "deadline", "task"])
    background = rnd.random() < 0.5
    if how == "event":
        event = rnd.choice(_CANCEL_EVENTS)
        nth = 1 if event is FitStarted else rnd.randint(1, 3 if event in _ONCE_PER_EPOCH else 30)
        return how, event, nth, background
    if how == "deadline":
        return how, rnd.uniform(0.0, 0.15), 0, background
    return how, None, rnd.randint(1, 40), background


# torchdata's StatefulDataLoader calls a torch function that torch deprecated.
@pytest.mark.external
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")
@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("seed", range(10))
async def test_cancellation_at_random_points(seed: int, executor: str, tmp_path: Path) -> None:
    how, what, nth, background = _cancel_plan(seed)
    module = CountingModule()
    witness = Witness()
    logger = SlowFileLogger(tmp_path / "log.txt")
    ckpt_dir = tmp_path / "ckpt"
    checkpoint = Checkpoint(ckpt_dir, every_n_steps=2, background=background)
    trainer = Trainer(
        max_epochs=1000,  # runs until the plan cancels it
        val_check_interval=5,
        plugins=[witness, logger, checkpoint],
        executor=executor,  # type: ignore[arg-type]
        device="cpu",
    )
    tasks_before = {t.id for t in anyio.get_running_tasks()}
    threads_before = _own_threads()
    batches_seen = anyio.Event()
    count = 0

    with anyio.fail_after(30), anyio.CancelScope() as scope:

        def cancel_on(event: Any) -> None:
            nonlocal count
            count += 1
            if count == nth:
                scope.cancel()

        def note_batch(event: Any) -> None:
            nonlocal count
            count += 1
            if count == nth:
                batches_seen.set()

        if how == "event":
            trainer.subscribe(what, cancel_on)
        elif how == "task":
            trainer.subscribe(TrainBatchCompleted, note_batch)
        async with anyio.create_task_group() as tg:
            if how == "deadline":
                scope.deadline = anyio.current_time() + what
            elif how == "task":

                async def canceller() -> None:
                    await batches_seen.wait()
                    scope.cancel()

                tg.start_soon(canceller)
            await trainer.fit(module, _stateful_loader(), make_loader(n=32, seed=1))

    assert scope.cancelled_caught
    # Teardown fired exactly once, as "cancelled", and nothing claims the run completed.
    assert witness.events[-1] == "Teardown(cancelled)"
    assert [e for e in witness.events if e.startswith("Teardown")] == ["Teardown(cancelled)"]
    assert not any(e.startswith(("FitCompleted", "ExceptionRaised")) for e in witness.events)
    assert witness.stopped
    assert witness.torn_down
    assert trainer.stage is None
    # The queued logger handled every record the bus accepted, then its file was closed.
    assert logger.lines == witness.records
    assert logger.file.closed
    assert "teardown cancelled" in (tmp_path / "log.txt").read_text().splitlines()
    assert _open_files_under(tmp_path) == []
    # No task, thread or step is left behind.
    assert {t.id for t in anyio.get_running_tasks()} == tasks_before
    assert _own_threads() == threads_before
    assert module.in_step == 0
    # The last checkpoint is complete, loads, and a new run resumes from it.
    last = loopbus.latest_checkpoint(ckpt_dir)
    assert last == checkpoint.last_checkpoint_path
    if ckpt_dir.exists():  # no temporary file left behind
        assert [p.name for p in ckpt_dir.iterdir() if p.name.startswith(".")] == []
    if last is not None:
        state = loopbus.load_checkpoint(last)  # verified against its marker, weights_only
        saved_step = state["loopbus"]["global_step"]
        assert 2 <= saved_step <= trainer.global_step
        assert saved_step % 2 == 0
        resumed = Trainer(
            max_steps=saved_step + 3,
            val_check_interval=5,
            plugins=[Checkpoint(tmp_path / "resumed", every_n_steps=1000)],
            device="cpu",
        )
        await resumed.fit(TinyModule(), _stateful_loader(), ckpt_path=last)
        assert resumed.global_step == saved_step + 3
    # The trainer is usable again.
    await trainer.validate(module, make_loader(n=32, seed=1))
    assert witness.events[-1] == "Teardown(completed)"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("executor", EXECUTORS)
async def test_asyncio_task_cancel_stops_at_a_step_boundary(executor: str) -> None:
    module = CountingModule()
    witness = Witness()
    trainer = Trainer(max_epochs=1000, plugins=[witness], executor=executor, device="cpu")  # type: ignore[arg-type]
    started = asyncio.Event()
    trainer.subscribe(TrainBatchCompleted, lambda e: started.set() if e.step >= 3 else None)
    task = asyncio.ensure_future(trainer.fit(module, make_loader()))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert witness.events[-1] == "Teardown(cancelled)"
    assert witness.stopped
    assert witness.torn_down
    assert module.in_step == 0
    assert trainer.stage is None


# ---------------------------------------------------------------- stop requests
@pytest.mark.parametrize("executor", EXECUTORS)
async def test_request_stop_from_another_task(executor: str, tmp_path: Path) -> None:
    witness = Witness()
    logger = SlowFileLogger(tmp_path / "log.txt")
    trainer = Trainer(max_epochs=1000, plugins=[witness, logger], executor=executor, device="cpu")  # type: ignore[arg-type]
    reached = anyio.Event()
    trainer.subscribe(TrainBatchCompleted, lambda e: reached.set() if e.step >= 5 else None)

    async def stopper() -> None:
        await reached.wait()
        trainer.request_stop("enough from a task")

    async with anyio.create_task_group() as tg:
        tg.start_soon(stopper)
        await trainer.fit(TinyModule(), make_loader())
    assert witness.events[-2:] == ["FitCompleted(stopped=True)", "Teardown(stopped)"]
    assert trainer.stop_reason == "enough from a task"
    assert 5 <= trainer.global_step < 1000
    assert logger.lines == witness.records
    assert logger.file.closed


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_request_stop_from_another_thread(executor: str) -> None:
    witness = Witness()
    trainer = Trainer(max_epochs=1000, plugins=[witness], executor=executor, device="cpu")  # type: ignore[arg-type]
    reached = threading.Event()
    trainer.subscribe(TrainBatchCompleted, lambda e: reached.set() if e.step >= 5 else None)

    def stop_from_thread() -> None:
        if reached.wait(timeout=30):
            trainer.request_stop("enough from a thread")

    thread = threading.Thread(target=stop_from_thread)
    thread.start()
    try:
        with anyio.fail_after(30):
            await trainer.fit(TinyModule(), make_loader())
    finally:
        reached.set()
        await anyio.to_thread.run_sync(thread.join)
    assert witness.events[-2:] == ["FitCompleted(stopped=True)", "Teardown(stopped)"]
    assert trainer.stop_reason == "enough from a thread"


@pytest.mark.parametrize("stage", ["validate", "test", "predict"])
async def test_request_stop_ends_an_evaluation_stage(stage: str) -> None:
    witness = Witness()
    trainer = Trainer(plugins=[witness], device="cpu")
    seen = 0

    def maybe_stop(event: Any) -> None:
        nonlocal seen
        seen += 1
        if seen == 2:
            trainer.request_stop("seen enough")

    batch_event = {
        "validate": ValidationBatchCompleted,
        "test": TestBatchCompleted,
        "predict": PredictBatchCompleted,
    }[stage]
    subscription = trainer.subscribe(batch_event, maybe_stop)
    data = make_loader(n=160, batch_size=16)
    inputs = [x for x, _ in data]
    output = await getattr(trainer, stage)(TinyModule(), inputs if stage == "predict" else data)
    assert seen == 2
    assert witness.events[-1] == "Teardown(stopped)"
    if stage == "predict":
        assert len(output) == 2
    # The next stage starts without the old request and runs to its end.
    subscription.unsubscribe()
    await trainer.validate(TinyModule(), data)
    assert witness.events[-1] == "Teardown(completed)"
    assert trainer.validate_loop.progress.current.completed == 10


# ---------------------------------------------------------------- the control table
class Boom(RuntimeError):
    pass


class FailingModule(TinyModule):
    def __init__(self, fail_at: int) -> None:
        super().__init__()
        self.fail_at = fail_at
        self.calls = 0

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise Boom(f"step {self.calls} failed")
        return super().training_step(batch, ctx)


@pytest.mark.parametrize("executor", EXECUTORS)
@pytest.mark.parametrize("ending", ["completed", "stopped", "cancelled", "failed"])
async def test_closing_events_per_ending(ending: str, executor: str) -> None:
    """The table in docs/async.md: which closing events fire for each way a run ends."""
    witness = Witness()
    epochs = 2 if ending == "completed" else 1000
    trainer = Trainer(max_epochs=epochs, plugins=[witness], executor=executor, device="cpu")  # type: ignore[arg-type]
    module: TinyModule = FailingModule(fail_at=3) if ending == "failed" else TinyModule()
    with anyio.CancelScope() as scope:
        if ending == "stopped":
            trainer.subscribe(TrainBatchCompleted, lambda e: trainer.request_stop("test"), once=3)
        if ending == "cancelled":
            trainer.subscribe(TrainBatchCompleted, lambda e: scope.cancel(), once=3)
        if ending == "failed":
            with pytest.raises(Boom, match="step 3 failed"):
                await trainer.fit(module, make_loader())
        else:
            await trainer.fit(module, make_loader())
    expected = {
        "completed": ["FitStarted", "FitCompleted(stopped=False)", "Teardown(completed)"],
        "stopped": ["FitStarted", "FitCompleted(stopped=True)", "Teardown(stopped)"],
        "cancelled": ["FitStarted", "Teardown(cancelled)"],
        "failed": ["FitStarted", "ExceptionRaised", "Teardown(failed)"],
    }[ending]
    assert witness.events == expected
    assert witness.stopped
    assert witness.torn_down
    assert scope.cancelled_caught == (ending == "cancelled")
    if ending == "stopped" or (ending == "cancelled" and executor == "thread"):
        # Checked before the next step starts.
        assert trainer.global_step == 3
    elif ending == "cancelled":
        # Inline steps notice a cancellation when they next yield to the event loop
        # (at most `yield_interval_s` later).
        assert 3 <= trainer.global_step < 1000 * 4


# ---------------------------------------------------------------- concurrent runs
def _new_run(
    seed: int,
    executor: str,
    order: list[str],
    fail_at: int | None = None,
    plugins: tuple[Plugin, ...] = (),
) -> tuple[Trainer, Module, list[PutRecord]]:
    """A trainer, its module (built from ``seed`` now, before any run starts) and the
    list its records go to; each training batch appends the run's name to ``order``."""
    module: TinyModule = _module(seed)
    if fail_at is not None:
        failing = FailingModule(fail_at)
        failing.load_state_dict(module.state_dict())
        module = failing
    trainer = Trainer(
        max_epochs=3,
        plugins=list(plugins),
        executor=executor,  # type: ignore[arg-type]
        yield_interval_s=0,
    )
    records: list[PutRecord] = []
    trainer.subscribe(PutRecord, records.append)
    trainer.subscribe(TrainBatchCompleted, lambda e: order.append(f"run{seed}"))
    return trainer, module, records


@pytest.mark.parametrize(
    "executors", [("inline", "inline"), ("thread", "thread"), ("inline", "thread")]
)
async def test_concurrent_runs_match_sequential_runs(executors: tuple[str, str]) -> None:
    seeds = (1, 2)
    order: list[str] = []
    # One after the other.
    sequential = []
    for seed, executor in zip(seeds, executors, strict=True):
        trainer, module, records = _new_run(seed, executor, order)
        await trainer.fit(module, _loader(seed))
        sequential.append((trainer, module, records))
    order.clear()
    # Both at once, in one task group.
    concurrent = [_new_run(seed, ex, order) for seed, ex in zip(seeds, executors, strict=True)]
    async with anyio.create_task_group() as tg:
        for seed, (trainer, module, _) in zip(seeds, concurrent, strict=True):
            tg.start_soon(trainer.fit, module, _loader(seed))

    # They did run interleaved ...
    first_b = order.index("run2")
    assert "run1" in order[first_b:], "the two runs did not overlap"
    for (t_seq, m_seq, log_seq), (t_con, m_con, log_con) in zip(
        sequential, concurrent, strict=True
    ):
        # ... and each ended exactly as it does alone: weights, progress and records.
        for (name, a), b in zip(
            m_seq.state_dict().items(), m_con.state_dict().values(), strict=True
        ):
            assert torch.equal(a, b), name
        assert t_con.global_step == t_seq.global_step == 36
        assert t_con.current_epoch == t_seq.current_epoch
        seq = [(r.name, r.step, r.value, r.source) for r in log_seq]
        con = [(r.name, r.step, r.value, r.source) for r in log_con]
        assert con == seq
    assert concurrent[0][0].bus is not concurrent[1][0].bus


@pytest.mark.parametrize("executor", EXECUTORS)
async def test_a_failing_run_does_not_disturb_a_concurrent_one(executor: str) -> None:
    order: list[str] = []
    trainer_alone, module_alone, records_alone = _new_run(2, executor, order)
    await trainer_alone.fit(module_alone, _loader(2))

    witness_ok, witness_bad = Witness(), Witness()
    trainer_ok, module_ok, records_ok = _new_run(2, executor, order, plugins=(witness_ok,))
    trainer_bad, module_bad, _ = _new_run(1, executor, order, fail_at=5, plugins=(witness_bad,))
    failures: list[BaseException] = []

    async def guarded(trainer: Trainer, module: Module, data: Any) -> None:
        try:
            await trainer.fit(module, data)
        except Boom as exc:
            failures.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(guarded, trainer_bad, module_bad, _loader(1))
        tg.start_soon(guarded, trainer_ok, module_ok, _loader(2))

    assert [str(f) for f in failures] == ["step 5 failed"]
    assert witness_bad.events[-2:] == ["ExceptionRaised", "Teardown(failed)"]
    assert witness_ok.events[-2:] == ["FitCompleted(stopped=False)", "Teardown(completed)"]
    assert not any("ExceptionRaised" in e for e in witness_ok.events)
    for name, value in module_alone.state_dict().items():
        assert torch.equal(module_ok.state_dict()[name], value), name
    assert [(r.name, r.value) for r in records_ok] == [(r.name, r.value) for r in records_alone]
    assert trainer_ok.global_step == 36


# ---------------------------------------------------------------- running loops
async def test_await_fit_in_a_running_loop_and_run_refuses() -> None:
    trainer = Trainer(max_epochs=1, plugins=[], device="cpu")
    module = TinyModule()
    with pytest.raises(RuntimeError, match=r"already running.*`await trainer\.fit\(\.\.\.\)`"):
        loopbus.run(trainer.fit, module, make_loader())
    await trainer.fit(module, make_loader())
    assert trainer.global_step == 4


def test_run_refuses_inside_a_notebook_style_loop() -> None:
    """A notebook kernel runs cells from its asyncio loop's callbacks: ``loopbus.run``
    must say to ``await``, and a top-level ``await trainer.fit(...)`` works."""
    trainer = Trainer(max_epochs=1, plugins=[], device="cpu")
    module = TinyModule()
    errors: list[BaseException] = []

    def cell() -> None:  # run as a plain loop callback, as a kernel does
        try:
            loopbus.run(trainer.fit, module, make_loader())
        except RuntimeError as exc:
            errors.append(exc)

    async def kernel() -> None:
        loop = asyncio.get_running_loop()
        loop.call_soon(cell)
        await asyncio.sleep(0.01)
        await trainer.fit(module, make_loader())  # a cell with top-level await

    asyncio.run(kernel())
    assert len(errors) == 1
    assert "asyncio event loop is already running" in str(errors[0])
    assert "`await trainer.fit(...)`" in str(errors[0])
    assert trainer.global_step == 4
    # From plain synchronous code it runs.
    loopbus.run(Trainer(max_epochs=1, plugins=[], device="cpu").fit, module, make_loader())


async def test_anyio_from_thread_can_run_a_stage_in_the_host_loop() -> None:
    """A synchronous host thread (a GUI, a worker) drives a stage on the running loop."""
    trainer = Trainer(max_epochs=1, plugins=[], device="cpu")
    module = TinyModule()

    def host_thread() -> None:
        anyio.from_thread.run(trainer.fit, module, make_loader())

    await anyio.to_thread.run_sync(host_thread)
    assert trainer.global_step == 4
