"""The progress bar: rich bars in a terminal, one plain line per epoch anywhere else.

It costs nothing per step: it subscribes to no per-step event. Run-level events only note
which loops are running (no drawing happens in a handler); a task of its own reads their
progress counters and the latest put records a few times a second and redraws.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import deque
from typing import IO, TYPE_CHECKING, Any

import anyio
from rich.console import Console
from rich.errors import LiveError
from rich.progress import BarColumn, Progress, TaskID, TextColumn
from rich.table import Table

from loopbus import Delivery, Loop, MisconfigurationError, Plugin, check_number, on
from loopbus.events import EpochCompleted, FitCompleted, RunCompleted, RunStarted, Teardown

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from loopbus import TrainerView

__all__ = ["ProgressBar"]

_LABELS = {
    "fit": "Epochs",
    "train": "Train",
    "validate": "Validate",
    "test": "Test",
    "predict": "Predict",
}
_RATE_WINDOW = 30.0  # seconds of history behind the rate and the ETA


def _fmt(value: float | int | bool) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _fmt_time(seconds: float) -> str:
    if seconds < 0.095:  # would read "0.0s": milliseconds instead
        return f"{seconds * 1000:.0f}ms" if seconds >= 0.0005 else "0s"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def epoch_text(epoch: int, max_epochs: float) -> str:
    """``"Epoch 9/19"``: epochs are shown as ``trainer.current_epoch`` counts them, from 0
    (as in records, events and checkpoint file names), over the last epoch's number."""
    return f"Epoch {epoch}" + ("" if max_epochs == math.inf else f"/{int(max_epochs) - 1}")


class _Run:
    """One run of a loop: when it started, when its count of completed iterations
    changed, and the time it was paused (validation inside a training epoch), which its
    rate leaves out."""

    __slots__ = ("excluded", "loop", "marks", "paused_at", "start")

    def __init__(self, loop: Loop[Any], completed: int, now: float) -> None:
        self.loop = loop
        self.start = now
        self.excluded = 0.0
        self.paused_at: float | None = None
        # (active time, completed) where the count changed; the first is the run's start.
        self.marks: deque[tuple[float, int]] = deque([(0.0, completed)], maxlen=256)

    def active(self, now: float) -> float:
        """Seconds since the start, less the time spent paused."""
        paused = now - self.paused_at if self.paused_at is not None else 0.0
        return now - self.start - self.excluded - paused

    def pause(self, now: float) -> None:
        if self.paused_at is None:
            self.paused_at = now

    def resume(self, now: float) -> None:
        if self.paused_at is not None:
            self.excluded += now - self.paused_at
            self.paused_at = None

    def mark(self, completed: int, now: float) -> None:
        """Note ``completed`` iterations at ``now`` (kept only when the count changed)."""
        marks = self.marks
        if completed != marks[-1][1]:
            marks.append((self.active(now), completed))

    def rate(self) -> float:
        """Iterations per second between count changes (0.0 before the first change).

        From the first change on when there are two or more (the time before it is
        start-up: workers, the first batch, compilation), else from the start; over the
        last half minute of active time at most. A count that changes once per long
        iteration (an epoch) is measured from change to change, never to ``now``, so a
        half-done iteration does not count as a slow one."""
        marks = self.marks
        t1, c1 = marks[-1]
        while len(marks) > 3 and t1 - marks[1][0] > _RATE_WINDOW:
            marks.popleft()
        t0, c0 = marks[1] if len(marks) > 2 else marks[0]
        return (c1 - c0) / (t1 - t0) if t1 > t0 and c1 > c0 else 0.0

    def info(self, completed: int, total: float | None, now: float) -> str:
        """``"n/total  rate  elapsed  eta"``."""
        self.mark(completed, now)
        rate = self.rate()
        parts = [f"{completed}/{'?' if total is None else int(total)}"]
        if rate > 0:
            parts.append(f"{rate:.1f} it/s" if rate >= 1 else f"{1 / rate:.1f} s/it")
        parts.append(_fmt_time(now - self.start))
        if total is not None and rate > 0:
            # The time already spent on the iteration under way counts as done.
            spent = self.active(now) - self.marks[-1][0]
            left = max(max(total - completed, 0) / rate - spent, 0.0)
            parts.append(f"eta {_fmt_time(left)}")
        return "  ".join(parts)


def _wrap(parts: list[str], width: int, sep: str = " | ") -> list[str]:
    """``parts`` joined by ``sep`` in lines of at most ``width`` characters, broken only
    between parts (continuation lines indented by two spaces); a part longer than a line
    is left whole for the terminal to fold."""
    lines: list[str] = []
    line = ""
    for part in parts:
        if not line:
            line = part if not lines else "  " + part
        elif len(line) + len(sep) + len(part) <= width:
            line += sep + part
        else:
            lines.append(line)
            line = "  " + part
    if line:
        lines.append(line)
    return lines


class ProgressBar(Plugin):
    """Progress of the running loops and the latest records addressed to
    ``"progress_bar"``.

    In a terminal (or Jupyter) it draws one rich bar per running loop (the epochs, the
    training batches of the epoch, the validation batches while validation runs) with
    rate, elapsed time and ETA, and the latest value of each record put with the
    ``"progress_bar"`` destination. It redraws ``refresh_rate`` times a second from a task
    of its own, never per step or per epoch. It also writes one line per epoch (above the
    bars), and that line is all it writes when the output is not a terminal (a CI log, a
    file, a pipe, ``TERM=dumb``): plain text, no control codes. When ``fit`` ends early
    the stop request's reason (early stopping, a time budget) is written too.

    It is the default plugin set: ``Trainer()`` has one, ``Trainer(plugins=[])`` has
    none, and a list of plugins replaces the default, so add it back when you pass some::

        trainer = Trainer(max_epochs=10, plugins=[ProgressBar(refresh_rate=2), CSVLogger("runs")])

    ``file`` writes to that file instead of standard error (bars if it is a terminal);
    ``console`` uses a rich ``Console`` as it is configured (``force_terminal=True``
    forces bars).
    """

    #: Acts on rank 0 only in a distributed run.
    delivery = Delivery(ranks="zero")

    def __init__(
        self,
        *,
        refresh_rate: float = 4.0,
        file: IO[str] | None = None,
        console: Console | None = None,
        results_table: bool = True,
    ) -> None:
        self.refresh_rate = check_number(
            "refresh_rate",
            refresh_rate,
            exclusive_minimum=0,
            maximum=60,
            owner="ProgressBar",
            what="a number of redraws per second",
        )
        if file is not None and console is not None:
            raise MisconfigurationError(
                "ProgressBar takes file= or console=, not both; configure the console to "
                "write to the file instead: console=Console(file=...)."
            )
        if not isinstance(results_table, bool):
            raise MisconfigurationError(
                f"ProgressBar(results_table=...) must be True or False, got {results_table!r}."
            )
        self.results_table = results_table
        self._file = file
        self._console = console
        self._trainer: TrainerView | None = None
        self._stage = ""
        self._loops: dict[str, Loop[Any]] = {}
        self._running: dict[str, _Run] = {}
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._lines: list[str] = []
        self._refresher: anyio.CancelScope | None = None
        self._epoch_start = 0.0
        self._val_time = 0.0
        self._starting: TaskID | None = None
        self._stage_start = 0.0
        self._ended = ""

    # ------------------------------------------------------------ output
    @property
    def console(self) -> Console:
        """The rich console the bar draws on."""
        if self._console is None:
            if self._file is not None:
                self._console = Console(file=self._file, force_terminal=_isatty(self._file))
            else:
                self._console = Console(stderr=True, force_terminal=_isatty(sys.stderr))
        return self._console

    @property
    def is_interactive(self) -> bool:
        """Whether bars are drawn (a terminal or Jupyter) rather than plain lines only."""
        console = self.console
        return console.is_jupyter or (console.is_terminal and not console.is_dumb_terminal)

    def write_line(self, line: str) -> None:
        """Write a line of text: above the bars (at the next redraw) when they are drawn,
        else straight to the output."""
        if self._progress is not None:
            self._lines.append(line)
            return
        out = self.console.file
        out.write(line + "\n")
        out.flush()

    # ------------------------------------------------------------ stage
    def setup(self, trainer: TrainerView, stage: str) -> None:
        self._trainer = trainer
        self._stage = stage
        self._loops = {}
        self._running = {}
        self._lines = []
        self._epoch_start = self._stage_start = time.monotonic()
        self._val_time = 0.0
        self._ended = ""

        def walk(loop: Loop[Any]) -> None:
            self._loops.setdefault(loop.name, loop)
            for child in loop.children.values():
                walk(child)

        walk(trainer.loops[stage])

    async def start(self, trainer: TrainerView, stage: str, task_group: TaskGroup) -> None:
        if not self.is_interactive:
            return
        progress = Progress(
            TextColumn("{task.description:<8}"),
            BarColumn(bar_width=30),
            # One text column filled by refresh(): rich's rate and time columns would
            # cost about a millisecond per redraw between them.
            TextColumn("{task.fields[info]}", markup=False),
            console=self.console,
            auto_refresh=False,
        )
        try:
            progress.start()
        except LiveError:  # another live display owns this console: lines only
            return
        self._progress = progress
        self._tasks = {}
        # Shown at once and until the first batch is done: the start-up (worker
        # processes, the first batch, compilation) can take seconds.
        self._starting = progress.add_task(
            f"Starting {stage}…", total=None, info=""
        )
        progress.refresh()
        scope = self._refresher = anyio.CancelScope()
        task_group.start_soon(self._refresh_loop, scope, name="ProgressBar refresh")

    async def _refresh_loop(self, scope: anyio.CancelScope) -> None:
        interval = 1.0 / self.refresh_rate
        with scope:
            while True:
                await anyio.sleep(interval)
                self.refresh()

    async def stop(self, trainer: TrainerView, stage: str) -> None:
        self._close_live()
        if self.results_table and stage in ("validate", "test") and self._ended:
            table = self.results(trainer, stage)
            if table is not None:
                self.console.print(table)

    def results(self, trainer: TrainerView, stage: str) -> Table | None:
        """The results table of a ``validate`` or ``test`` stage: the last value of each
        record it put, by name (None if it put none). Printed when the stage ends, unless
        ``results_table=False``."""
        records = trainer.stage_latest
        if not records:
            return None
        label = _LABELS.get(stage, stage)
        table = Table(title=f"{label} results", title_justify="left")
        table.add_column(f"{label} metric", style="cyan", no_wrap=True)
        table.add_column("Value", justify="right", style="magenta", no_wrap=True)
        for name in sorted(records):
            value = records[name].value
            table.add_row(name, f"{value:.6g}" if isinstance(value, float) else str(value))
        return table

    def teardown(self, trainer: TrainerView, stage: str) -> None:
        self._close_live()
        self._trainer = None
        self._loops = {}
        self._running = {}

    def _close_live(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            self._refresher = None
        progress = self._progress
        if progress is not None:
            self.refresh()
            self._progress = None
            self._tasks = {}
            self._starting = None
            progress.stop()

    # ------------------------------------------------------------ drawing
    def metrics(self) -> dict[str, float | int | bool]:
        """The latest value of each record put with the ``"progress_bar"`` destination
        during the running stage."""
        trainer = self._trainer
        if trainer is None:
            return {}
        return {
            name: record.value
            for name, record in trainer.stage_latest.items()
            if "progress_bar" in record.destinations
        }

    def _metric_parts(self) -> list[str]:
        """``"name value"`` per record for the bar; during ``fit`` a record put in an
        earlier epoch than the current one (a validation metric between validations)
        says which epoch it is from."""
        trainer = self._trainer
        if trainer is None:
            return []
        epoch = trainer.current_epoch if self._stage == "fit" else None
        parts = []
        for name, record in trainer.stage_latest.items():
            if "progress_bar" not in record.destinations:
                continue
            text = f"{name} {_fmt(record.value)}"
            if epoch is not None and record.epoch < epoch:
                text += f" (epoch {record.epoch})"  # 0-based, as "Epoch N/M" is
            parts.append(text)
        return parts

    def _metrics_text(self) -> str:
        return "  ".join(self._metric_parts())

    def _counts(self, loop: Loop[Any]) -> tuple[int, float | None]:
        """(completed, total) iterations of ``loop`` for its bar."""
        if hasattr(loop, "total_batches"):  # a batch loop: this run's batches
            total: float | None = loop.total_batches
            return loop.progress.current.completed, total
        max_epochs = self._trainer.max_epochs if self._trainer is not None else math.inf
        total = max_epochs if loop.name == "fit" and max_epochs != math.inf else None
        return loop.progress.total.completed, total

    def refresh(self) -> None:
        """Redraw the bars now (the refresh task calls it; a no-op without bars)."""
        progress = self._progress
        if progress is None:
            return
        now = time.monotonic()
        tasks = self._tasks
        running = self._running
        for name, shown in tasks.items():
            if name not in running:
                progress.update(shown, visible=False)
        starting = self._starting
        if starting is not None:
            if any(
                run.loop.progress.current.completed and name != "fit"
                for name, run in running.items()
            ):
                progress.update(starting, visible=False)
                self._starting = None
            else:
                progress.update(starting, info=_fmt_time(now - self._stage_start))
        metrics = self._metrics_text() if running else ""
        metrics_on = "train" if "train" in running else next(iter(running), None)
        for name, run in running.items():
            completed, total = self._counts(run.loop)
            info = run.info(completed, total, now)
            if name == metrics_on and metrics:
                info = f"{info}  {metrics}"
            task = tasks.get(name)
            if task is None:
                # One task per loop for the whole stage (adding one redraws at once).
                tasks[name] = progress.add_task(
                    _LABELS.get(name, name), total=total, completed=completed, info=info
                )
            else:
                progress.update(task, completed=completed, total=total, info=info, visible=True)
        lines = self._lines
        if lines:
            self._lines = []
            # Printing above a live display redraws it too: one redraw for both.
            # Word-wrapped at the console's width (a summary line comes wrapped at its
            # " | " separators already).
            progress.console.print(
                "\n".join(lines), markup=False, highlight=False, overflow="fold"
            )
        else:
            progress.refresh()

    # ------------------------------------------------------------ events
    @on(RunStarted)
    def _run_started(self, event: RunStarted) -> None:
        loop = self._loops.get(event.loop)
        if loop is None:
            return
        now = time.monotonic()
        if event.loop == "train":
            self._epoch_start = now
            self._val_time = 0.0
        elif event.loop == "validate" and "train" in self._running:
            # Validation inside an epoch: not part of the training bar's rate.
            self._running["train"].pause(now)
        self._running[event.loop] = _Run(loop, self._counts(loop)[0], now)

    @on(RunCompleted)
    def _run_completed(self, event: RunCompleted) -> None:
        run = self._running.pop(event.loop, None)
        if run is None:
            return
        now = time.monotonic()
        elapsed = now - run.start
        if event.loop == "validate" and self._stage == "fit":
            self._val_time += elapsed
            train = self._running.get("train")
            if train is not None:
                train.resume(now)
        elif event.loop == self._stage and self._stage != "fit":
            n = run.loop.progress.current.completed
            line = f"{_LABELS.get(event.loop, event.loop)}: {n} batches in {_fmt_time(elapsed)}"
            metrics = self._metrics_text()
            self.write_line(f"{line} | {metrics}" if metrics else line)

    @on(EpochCompleted)
    def _epoch_completed(self, event: EpochCompleted) -> None:
        trainer = self._trainer
        if trainer is None:
            return
        parts = [epoch_text(event.epoch, trainer.max_epochs)]
        train = self._loops.get("train")
        if train is not None:
            n = train.progress.current.completed
            train_time = max(time.monotonic() - self._epoch_start - self._val_time, 1e-9)
            text = f"{n} batches in {_fmt_time(train_time)} ({n / train_time:.1f} it/s)"
            if self._val_time:
                text += f", validation {_fmt_time(self._val_time)}"
            parts.append(text)
        parts.append(f"step {event.step}")
        fit = self._running.get("fit")
        if fit is not None:  # the epoch count changes now: its rate is exact
            fit.mark(fit.loop.progress.total.completed, time.monotonic())
        metrics = self._metric_parts()
        if self._progress is None:  # plain output: one line per epoch
            if metrics:
                parts.append("  ".join(metrics))
            self.write_line(" | ".join(parts))
            return
        # In a terminal: broken between parts, never inside one, at the console's width.
        self.write_line("\n".join(_wrap(parts + metrics, self.console.width)))

    @on(FitCompleted)
    def _fit_completed(self, event: FitCompleted) -> None:
        if event.stopped:
            reason = event.reason or "stop requested"
            self.write_line(f"Stopped at epoch {event.epoch}, step {event.step}: {reason}")

    @on(Teardown)
    def _teardown(self, event: Teardown) -> None:
        self._ended = event.reason if event.reason in ("completed", "stopped") else ""
        if event.reason in ("failed", "cancelled"):
            self.write_line(
                f"{event.stage} {event.reason} at epoch {event.epoch}, step {event.step}"
            )


def _isatty(file: Any) -> bool:
    isatty = getattr(file, "isatty", None)
    try:
        tty = bool(isatty()) if isatty is not None else False
    except (ValueError, OSError):
        return False
    return tty and os.environ.get("TERM", "").lower() not in ("dumb", "unknown")
