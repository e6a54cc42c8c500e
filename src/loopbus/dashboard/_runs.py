"""A run as the dashboard shows it: its points per record name, its boundaries, and what
its folder says about it (``run.json``, the configuration, the hyperparameters).

A :class:`Run` is filled from a log file (a finished run, or one still being written),
from a job's stream (a live run), or both: a live job that names its run folder is read
from the folder's log for what it put before the dashboard connected, and from the
stream for the rest (a record name's points from the file stop where its first
streamed point starts).

Imports the base layer only.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from ._logs import Chunk
from ._series import Series

__all__ = ["Run", "read_facts"]

#: A run's ``state`` in the API: still being written, or not.
STATES = ("live", "finished")
#: The most bytes of ``run.json``, a configuration or a hyperparameters file read.
_MAX_FACTS = 4 * 1024 * 1024


class Run:
    """One run: ``id`` (stable, for the API), ``name`` (shown), ``source`` (its folder,
    file or address), ``state`` (``"live"`` or ``"finished"``), its :class:`Series` by
    record name, its boundaries, and what its folder says about it.

    :attr:`version` counts its changes (the page refreshes what changed)."""

    def __init__(self, run_id: str, name: str, source: str, *, kind: str) -> None:
        self.id = run_id
        self.name = name
        self.source = source
        self.kind = kind  # "folder", "file" or "stream"
        self.state = "finished"
        self.reason = ""  # why nothing could be read, if so
        self.series: dict[str, Series] = {}
        #: Record names its log has whose points are not read yet (they are read by
        #: columns, those pages ask for first).
        self.pending: set[str] = set()
        #: epoch -> (step, wall time) of its last point.
        self.epochs: dict[int, tuple[int, float]] = {}
        #: Other boundaries: {"kind": "stage" | "resume" | "gap", "step", "time", "label"}.
        self.marks: list[dict[str, Any]] = []
        self.facts: dict[str, Any] = {}
        self.config: dict[str, Any] | None = None
        self.files: list[str] = []
        self.version = 0
        self.loaded = False
        #: The run folder a live run's stream named (its history is read there).
        self.folder: Path | None = None
        # A live run: name -> wall time of its first streamed point (file points of that
        # name from then on are the stream's, and are skipped).
        self._streamed: dict[str, float] = {}
        self._since: float | None = None
        self._held: dict[str, tuple[list[int], list[float], list[Any]]] = {}
        #: A live run's own table row (its feed's state, step, records, ...), if any.
        self.live: Callable[[], dict[str, Any]] | None = None

    def __repr__(self) -> str:
        return f"<Run {self.id!r} {self.state} {len(self.series)} names>"

    # ------------------------------------------------------------ filling it
    def point(self, name: str, step: int, time: float, value: Any) -> None:
        """A point that arrived on the run's stream."""
        series = self.series.get(name)
        if series is None:
            series = self.series[name] = Series()
        if name not in self._streamed:
            self._streamed[name] = time
            held = self._held.pop(name, None)
            if held is not None:  # logged before this first streamed point: not streamed
                early = [i for i, t in enumerate(held[1]) if t < time]
                series.extend(*([column[i] for i in early] for column in held))
        series.add(step, time, value)
        self.version += 1

    def streaming_since(self, folder: Path, time: float) -> None:
        """The run's stream (which names ``folder``) delivers what was put from wall
        ``time`` on: the folder's log gives what came before."""
        if self.folder is None:
            self.folder = folder
            self._since = time
            self.version += 1

    def release(self) -> None:
        """The stream ended: what the log holds and the stream did not deliver is the
        run's too."""
        held, self._held = self._held, {}
        for name, columns in held.items():
            self.series.setdefault(name, Series()).insert_early(*columns)
        if held:
            self.version += 1

    def apply(self, chunk: Chunk) -> None:
        """What a read of the run's log found."""
        if chunk.reset:  # the file was replaced: what it gave is read again
            kept = {}
            for name, since in self._streamed.items():
                series = self.series[name]
                series.keep(series.arrays()[1] >= since)
                kept[name] = series
            self.series, self._held = kept, {}
            self.epochs = {}
            self.marks = [m for m in self.marks if m["kind"] != "resume" or m.get("file")]
        for step, time in chunk.purges:
            for series in self.series.values():
                steps, _, _ = series.arrays()
                series.keep(steps < step)
            self.marks.append(_mark("resume", step, time, f"resumed at step {step}", file=True))
        for name, (steps, times, values) in chunk.points.items():
            self._add_logged(name, steps, times, values)
        for name, (steps, times, values) in chunk.arrays.items():
            if self._since is None and name not in self._streamed:
                self.series.setdefault(name, Series()).extend(steps, times, values)
            else:
                self._add_logged(name, steps.tolist(), times.tolist(), values.tolist())
        self.epochs.update(chunk.epochs)
        if chunk.pending is not None and chunk.pending != self.pending:
            self.pending = chunk.pending
            self.version += 1
        if chunk:
            self.version += 1

    def _add_logged(
        self, name: str, steps: list[int], times: list[float], values: list[Any]
    ) -> None:
        series = self.series.get(name)
        if series is None:
            series = self.series[name] = Series()
        since = self._streamed.get(name)
        if since is not None:
            # Only what was logged before the stream's first point of the name; it goes
            # before the streamed points.
            early = [i for i, t in enumerate(times) if t < since]
            if early:
                series.insert_early(*([c[i] for i in early] for c in (steps, times, values)))
            return
        if self._since is None:
            series.extend(steps, times, values)
            return
        # Logged since the stream started: the stream may still bring it. Held until the
        # stream's first point of the name says what it did not (or the stream ends).
        cut = next((i for i, t in enumerate(times) if t >= self._since), len(times))
        series.extend(steps[:cut], times[:cut], values[:cut])
        if cut < len(times):
            held = self._held.setdefault(name, ([], [], []))
            for column, given in zip(held, (steps, times, values), strict=True):
                column.extend(given[cut:])

    def mark(self, kind: str, step: int, time: float, label: str) -> None:
        """A boundary (a stage's end, records dropped) drawn on every chart."""
        self.marks.append(_mark(kind, step, time, label))
        self.version += 1

    def set_facts(self, facts: dict[str, Any], config: dict[str, Any] | None) -> None:
        """What the run's folder says: ``run.json`` and the configuration."""
        if facts != self.facts or config != self.config:
            self.facts, self.config = facts, config
            self.marks = [m for m in self.marks if m["kind"] != "resume" or m.get("file")]
            for start in [*facts.get("earlier", []), facts]:
                step = start.get("resumed_from_step") if isinstance(start, dict) else None
                if isinstance(step, int) and not isinstance(step, bool):
                    when = _timestamp(start.get("started"))
                    self.marks.append(_mark("resume", step, when, f"resumed from step {step}"))
            self.version += 1

    # ------------------------------------------------------------ reading it
    def origin(self) -> float | None:
        """The wall time of the run's first point (relative time counts from it)."""
        times = [t for s in self.series.values() if (t := s.first_time()) is not None]
        return min(times) if times else None

    def markers(self) -> list[dict[str, Any]]:
        """Every boundary, epoch ends first: ``{"kind", "step", "time", "label"}``."""
        epochs = [
            _mark("epoch", step, time, f"epoch {epoch}")
            for epoch, (step, time) in sorted(self.epochs.items())
        ]
        return epochs + [{k: v for k, v in m.items() if k != "file"} for m in self.marks]

    def info(self) -> dict[str, Any]:
        """The run as ``GET /api/runs`` lists it."""
        return {
            "id": self.id,
            "name": self.name,
            "source": self.source,
            "state": self.state,
            "names": sorted(self.pending.union(self.series)),
            "pending": sorted(self.pending),
            "run": self.facts or None,
            "config": self.config,
            "points": sum(len(s) for s in self.series.values()),
            "origin": self.origin(),
            "files": self.files,
            "loaded": self.loaded,
            "reason": self.reason,
            "version": self.version,
            "live": self.live() if self.live is not None else None,
        }


def _mark(kind: str, step: int, time: float | None, label: str, **extra: Any) -> dict[str, Any]:
    return {"kind": kind, "step": step, "time": time, "label": label, **extra}


def _timestamp(text: Any) -> float | None:
    """Seconds since the Unix epoch of an ISO 8601 time (``run.json``'s ``started``)."""
    if not isinstance(text, str):
        return None
    try:
        return datetime.datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def _load(path: Path, inside: Callable[[Path], bool]) -> Any:
    """A JSON or YAML file's content (None when missing, too large, unreadable or, by
    ``inside``, not to be read)."""
    try:
        if not path.is_file() or not inside(path):
            return None
        if path.stat().st_size > _MAX_FACTS:
            return None
        data = path.read_bytes()
        if path.suffix == ".json":
            return msgspec.json.decode(data)
        return msgspec.yaml.decode(data)
    except (OSError, msgspec.DecodeError, ValueError):
        return None


def read_facts(
    folder: Path, inside: Callable[[Path], bool]
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """``run.json`` of a run folder and its configuration: the resolved configuration
    (the file ``run.json`` names, ``config.yaml`` by default) merged with the
    hyperparameters (``hparams.yaml`` or ``hparams.json``) the loggers wrote. Only files
    that ``inside`` accepts are read."""
    facts = _load(folder / "run.json", inside)
    facts = facts if isinstance(facts, dict) else {}
    config: dict[str, Any] = {}
    named = facts.get("config")
    name = named if isinstance(named, str) and "/" not in named and "\\" not in named else None
    for candidate in (name, "config.yaml", "hparams.yaml", "hparams.json"):
        if candidate is None or candidate.startswith("."):
            continue
        loaded = _load(folder / candidate, inside)
        if isinstance(loaded, dict):
            for key, value in loaded.items():
                config.setdefault(str(key), value)
    return facts, (_finite(config) if config else None)


def _finite(value: Any) -> Any:
    """A configuration JSON can carry: non-finite floats as their names."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value
