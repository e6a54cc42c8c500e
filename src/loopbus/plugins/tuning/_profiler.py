"""Profiler: ``torch.profiler`` traces of chosen training batches, the engine's own
phases marked in them, and a summary table of where the time went."""

from __future__ import annotations

import io
import os
import shutil
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.console import Console
from rich.table import Table
from torch.profiler import ProfilerAction, ProfilerActivity

from loopbus import MisconfigurationError, Plugin, check_int, check_local_path, on
from loopbus import profiling_ranges as _profiling_ranges
from loopbus.events import ExceptionRaised, TrainBatchCompleted

if TYPE_CHECKING:
    from loopbus import TrainerView

__all__ = ["ProfileRow", "ProfileSummary", "Profiler"]

#: The prefix of the engine's ranges (``loopbus.profiling_ranges``).
_PHASE = "loopbus."
#: The markers ``torch.profiler`` puts around each profiled step (``ProfilerStep#N`` in
#: a trace, ``ProfilerStep*`` in its averages).
_STEP = "ProfilerStep"
_RECORDING = (ProfilerAction.RECORD, ProfilerAction.RECORD_AND_SAVE)


@dataclass(frozen=True, slots=True)
class ProfileRow:
    """One name of the summary (an op, or an engine phase) over every profiled batch:
    its calls, and its time in milliseconds: ``self_*`` without what ran inside it
    (nested ops), the others with it; ``device_*`` on CUDA (0 elsewhere)."""

    name: str
    calls: int
    self_cpu_ms: float
    cpu_ms: float
    self_device_ms: float
    device_ms: float


@dataclass(frozen=True, slots=True)
class ProfileSummary:
    """What one rank's profiler recorded in a stage: the profiled batches (indices in
    the ``fit``, from 0; the traces' ``ProfilerStep#N`` markers), their total host time,
    the engine's phases and every op (by self CPU time, largest first), and the files
    written."""

    rank: int
    batches: tuple[int, ...]
    step_ms: float
    phases: tuple[ProfileRow, ...]
    ops: tuple[ProfileRow, ...]
    traces: tuple[Path, ...]


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise MisconfigurationError(f"Profiler({name}={value!r}) must be True or False.")
    return value


def _free(path: Path) -> Path:
    """``path``, or ``name.1.ext``, ``name.2.ext``... when taken: a later run never
    replaces an earlier one's file."""
    if not path.exists():
        return path
    stem, dot, suffix = path.name.partition(".")
    n = 1
    while True:
        candidate = path.with_name(f"{stem}.{n}{dot}{suffix}")
        if not candidate.exists():
            return candidate
        n += 1


def _all_threads() -> Any:
    """torch's option to record the ops of every thread (the step's worker thread with
    ``executor="thread"``, the batch source's prefetch thread), where torch has it."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # an older torch: the profiling thread only
        return None


def _is_oom(error: BaseException | None) -> bool:
    seen = 0
    while error is not None and seen < 16:
        if isinstance(error, torch.OutOfMemoryError):
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


class Profiler(Plugin):
    """Profiles chosen training batches of ``fit`` with ``torch.profiler``, on every rank.

    The schedule counts training batches of the ``fit`` from 0: ``skip_first`` batches,
    then ``repeat`` cycles (0: until the run ends) of ``wait`` batches not profiled,
    ``warmup`` batches profiled and thrown away, and ``active`` batches recorded. Each
    recorded window is written to ``dirpath`` as a Chrome trace
    (``rank{R}.batches{A}-{B}.trace.json``: ``chrome://tracing``, Perfetto) and in
    TensorBoard's profiler layout (``dirpath/tensorboard/rank{R}.{ns}.pt.trace.json``:
    ``tensorboard --logdir dirpath``). While a window records, the engine marks its
    phases (``loopbus.data_fetch``, ``loopbus.step``, ``loopbus.put_flush``,
    ``loopbus.boundary``, ``loopbus.validation``, ``loopbus.checkpoint``) as ranges in
    the trace, through :func:`loopbus.profiling_ranges`; outside the window they cost
    nothing. When the stage ends, a table of the engine's phases and the top
    ``row_limit`` ops by self CPU time (and by CUDA time on a GPU) is written to
    ``dirpath/summary.rank{R}.txt`` and printed by rank 0 (standard error, or
    ``console``)::

        trainer = Trainer(plugins=[ProgressBar(), Profiler("runs/profile", active=3)])

    On CUDA, ``profile_memory=True`` records allocations in the trace, and with
    ``oom_snapshot=True`` the CUDA allocator's history is kept while the stage runs and
    dumped to ``dirpath/rank{R}.oom_snapshot.pickle`` when it fails with
    ``torch.OutOfMemoryError`` (open it at https://pytorch.org/memory_viz).
    """

    writes_files = True

    def __init__(
        self,
        dirpath: str | os.PathLike[str],
        *,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        skip_first: int = 0,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        row_limit: int = 15,
        oom_snapshot: bool = False,
        console: Console | None = None,
    ) -> None:
        if not isinstance(dirpath, (str, os.PathLike)) or not os.fspath(dirpath):
            raise MisconfigurationError(
                f"Profiler(dirpath={dirpath!r}) must be the folder to write the traces and "
                "the summary to, as a str or a path: Profiler('runs/profile')."
            )
        check_local_path("dirpath", dirpath, owner="Profiler")
        self.dirpath = Path(os.fspath(dirpath))
        hint = "the schedule counts training batches"
        self.wait = check_int("wait", wait, minimum=0, owner="Profiler", hint=hint)
        self.warmup = check_int("warmup", warmup, minimum=0, owner="Profiler", hint=hint)
        self.active = check_int("active", active, minimum=1, owner="Profiler", hint=hint)
        self.repeat = check_int(
            "repeat", repeat, minimum=0, owner="Profiler", hint="0 repeats until the run ends"
        )
        self.skip_first = check_int("skip_first", skip_first, minimum=0, owner="Profiler")
        self.row_limit = check_int("row_limit", row_limit, minimum=1, owner="Profiler")
        self.record_shapes = _flag("record_shapes", record_shapes)
        self.profile_memory = _flag("profile_memory", profile_memory)
        self.with_stack = _flag("with_stack", with_stack)
        self.oom_snapshot = _flag("oom_snapshot", oom_snapshot)
        if console is not None and not isinstance(console, Console):
            raise MisconfigurationError(
                f"Profiler(console={console!r}) must be a rich.console.Console (or None: "
                "standard error)."
            )
        self._console = console
        #: What the last stage recorded (None before a ``fit`` ends).
        self.summary: ProfileSummary | None = None
        #: The CUDA memory snapshot written when a stage ran out of memory, or None.
        self.oom_snapshot_path: Path | None = None
        self._prof: torch.profiler.profile | None = None
        self._reset(rank=0, show=False)

    def __repr__(self) -> str:
        return (
            f"Profiler({str(self.dirpath)!r}, wait={self.wait}, warmup={self.warmup}, "
            f"active={self.active}, repeat={self.repeat}, skip_first={self.skip_first})"
        )

    def _reset(self, rank: int, show: bool) -> None:
        self._rank = rank
        self._show = show
        self._batch = 0  # the batch in flight (counted from 0 in the fit)
        self._cycle = 0  # the schedule's cycle under way or next
        self._next = self._cycle_start(0)  # the batch at which it starts
        self._first = 0  # the first recorded batch of the profiler's window
        self._last = -1  # the last batch of the window being saved
        self._activities = [ProfilerActivity.CPU]
        self._ranges: bool | None = None  # the switch's setting before we turned it on
        self._history = False
        self._failed: Exception | None = None
        self._totals: dict[str, list[float]] = {}
        self._batches: list[int] = []
        self._traces: list[Path] = []

    # ------------------------------------------------------------ stage
    def setup(self, trainer: TrainerView, stage: str) -> None:
        if stage != "fit":
            return
        self._reset(rank=trainer.global_rank, show=trainer.is_global_zero)
        self.oom_snapshot_path = None
        self.dirpath.mkdir(parents=True, exist_ok=True)
        if torch.cuda.is_available():
            self._activities.append(ProfilerActivity.CUDA)
            if self.oom_snapshot:  # untested here: needs a CUDA device
                torch.cuda.memory._record_memory_history(max_entries=100_000)
                self._history = True
        if self._next == 0:
            self._open()

    def _cycle_start(self, cycle: int) -> int | None:
        """The batch at which the warmup of ``cycle`` (from 0) starts; None: no such cycle."""
        if self.repeat and cycle >= self.repeat:
            return None
        return self.skip_first + cycle * (self.wait + self.warmup + self.active) + self.wait

    def _open(self) -> None:
        """Start torch's profiler for one cycle's warmup and active batches, from the
        batch about to run. Until then nothing runs but a count per batch."""
        prof = torch.profiler.profile(
            activities=self._activities,
            schedule=torch.profiler.schedule(
                wait=0, warmup=self.warmup, active=self.active, repeat=1
            ),
            on_trace_ready=self._trace_ready,
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            experimental_config=_all_threads(),
        )
        self._prof = prof
        self._first = self._batch + self.warmup
        prof.start()
        self._follow(prof)

    @on(TrainBatchCompleted, priority=-1000)  # after the batch's other handlers
    def _batch_completed(self, event: TrainBatchCompleted) -> None:
        self._batch += 1  # the batch about to run
        prof = self._prof
        if prof is None:
            if self._batch == self._next:
                self._open()
            return
        self._last = self._batch - 1
        prof.step()  # saves the window when it ends here (_trace_ready)
        if prof.current_action is ProfilerAction.NONE:  # the cycle is over
            self._close()
            self._cycle += 1
            self._next = self._cycle_start(self._cycle)
            if self._batch == self._next:
                self._open()
        else:
            self._follow(prof)
        self._raise_failed_save()

    def _follow(self, prof: torch.profiler.profile) -> None:
        """The engine's ranges on while the profiler records, off (as they were) else."""
        recording = prof.current_action in _RECORDING
        if recording and self._ranges is None:
            self._ranges = _profiling_ranges(True)
        elif not recording and self._ranges is not None:
            _profiling_ranges(self._ranges)
            self._ranges = None

    def _close(self) -> None:
        """Stop the profiler (which saves a window cut short) and restore the ranges."""
        prof, self._prof = self._prof, None
        if prof is None:
            return
        try:
            prof.stop()
        finally:
            if self._ranges is not None:
                _profiling_ranges(self._ranges)
                self._ranges = None

    def _trace_ready(self, prof: torch.profiler.profile) -> None:
        # Called inside torch's profiler, between two of its states: an exception here
        # would leave it broken, so it is kept and raised once the profiler is done.
        try:
            self._save(prof)
        except Exception as exc:
            self._failed = exc

    def _raise_failed_save(self) -> None:
        failed, self._failed = self._failed, None
        if failed is not None:
            raise RuntimeError(
                f"Profiler could not save its trace in {self.dirpath}: {failed}"
            ) from failed

    def _save(self, prof: torch.profiler.profile) -> None:
        first = self._first
        last = max(self._last, first)  # a window cut short in its first batch: that one
        rank = self._rank
        chrome = _free(self.dirpath / f"rank{rank}.batches{first}-{last}.trace.json")
        prof.export_chrome_trace(str(chrome))
        # TensorBoard's profiler plugin reads <logdir>/<run>/<worker>.<span>.pt.trace.json,
        # the names torch.profiler.tensorboard_trace_handler writes.
        board = self.dirpath / "tensorboard"
        board.mkdir(exist_ok=True)
        shutil.copyfile(chrome, board / f"rank{rank}.{time.time_ns()}.pt.trace.json")
        self._traces.append(chrome)
        self._batches.extend(range(first, self._last + 1))
        for avg in prof.key_averages():
            row = self._totals.setdefault(avg.key, [0, 0.0, 0.0, 0.0, 0.0])
            row[0] += avg.count
            row[1] += avg.self_cpu_time_total / 1e3
            row[2] += avg.cpu_time_total / 1e3
            row[3] += avg.self_device_time_total / 1e3
            row[4] += avg.device_time_total / 1e3

    @on(ExceptionRaised)
    def _exception(self, event: ExceptionRaised) -> None:
        if self._history and _is_oom(event.error):  # untested here: needs a CUDA device
            path = _free(self.dirpath / f"rank{self._rank}.oom_snapshot.pickle")
            torch.cuda.memory._dump_snapshot(str(path))  # type: ignore[no-untyped-call]
            self.oom_snapshot_path = path

    def teardown(self, trainer: TrainerView, stage: str) -> None:
        if stage != "fit":
            return
        self._last = self._batch - 1  # the last batch completed
        try:
            self._close()
            self._raise_failed_save()
        finally:
            if self._history:
                self._history = False
                torch.cuda.memory._record_memory_history(enabled=None)
        self.summary = self._summarize()
        self._report(self.summary)

    # ------------------------------------------------------------ summary
    def _summarize(self) -> ProfileSummary:
        rows = [ProfileRow(name, int(v[0]), *v[1:]) for name, v in self._totals.items()]
        steps = [row for row in rows if row.name.startswith(_STEP)]
        return ProfileSummary(
            rank=self._rank,
            batches=tuple(sorted(self._batches)),
            step_ms=sum(row.cpu_ms for row in steps),
            phases=tuple(
                sorted(
                    (row for row in rows if row.name.startswith(_PHASE)),
                    key=lambda row: -row.cpu_ms,
                )
            ),
            ops=tuple(
                sorted(
                    (row for row in rows if not row.name.startswith((_PHASE, _STEP))),
                    key=lambda row: -row.self_cpu_ms,
                )
            ),
            traces=tuple(self._traces),
        )

    def tables(self, summary: ProfileSummary) -> list[Table]:
        """The summary as rich tables: the engine's phases, the top ops by self CPU time
        and, when the device did work, by self device (CUDA) time."""
        total = summary.step_ms or 1.0
        phases = Table(title=f"Engine phases (rank {summary.rank})")
        for column in ("Phase", "Calls", "Total ms", "Mean ms", "Self ms", "% of steps"):
            phases.add_column(column, justify="left" if column == "Phase" else "right")
        for row in summary.phases:
            phases.add_row(
                row.name,
                str(row.calls),
                f"{row.cpu_ms:.3f}",
                f"{row.cpu_ms / max(row.calls, 1):.3f}",
                f"{row.self_cpu_ms:.3f}",
                f"{100 * row.cpu_ms / total:.1f}",
            )
        tables = [phases, self._ops_table(summary.ops, "self CPU", lambda r: r.self_cpu_ms)]
        on_device = [row for row in summary.ops if row.self_device_ms > 0]
        if on_device:
            on_device.sort(key=lambda row: -row.self_device_ms)
            tables.append(self._ops_table(on_device, "self CUDA", lambda r: r.self_device_ms))
        return tables

    def _ops_table(self, rows: Iterable[ProfileRow], what: str, key: Any) -> Table:
        rows = list(rows)
        total = sum(key(row) for row in rows) or 1.0
        table = Table(title=f"Top ops by {what} time")
        for column in ("Op", "Calls", f"{what} ms", "%", "CPU total ms"):
            table.add_column(column, justify="left" if column == "Op" else "right")
        for row in rows[: self.row_limit]:
            table.add_row(
                row.name,
                str(row.calls),
                f"{key(row):.3f}",
                f"{100 * key(row) / total:.1f}",
                f"{row.cpu_ms:.3f}",
            )
        return table

    def _report(self, summary: ProfileSummary) -> None:
        if summary.batches:
            head = (
                f"Profiled batches {', '.join(map(str, summary.batches))} of fit on rank "
                f"{summary.rank}: {summary.step_ms:.1f} ms in all. Traces: "
                + ", ".join(str(p) for p in summary.traces)
            )
            parts: list[Any] = [head, *self.tables(summary)]
        else:
            parts = [
                f"Profiler: no batch was profiled on rank {summary.rank}: fit ended after "
                f"{self._batch} batches, before the schedule's first active one "
                f"({self.skip_first + self.wait + self.warmup})."
            ]
        text = io.StringIO()
        plain = Console(file=text, width=120, color_system=None, force_terminal=False)
        for part in parts:
            plain.print(part)
        _free(self.dirpath / f"summary.rank{summary.rank}.txt").write_text(
            text.getvalue(), encoding="utf-8"
        )
        if self._show:
            console = self._console if self._console is not None else Console(file=sys.stderr)
            for part in parts:
                console.print(part)
