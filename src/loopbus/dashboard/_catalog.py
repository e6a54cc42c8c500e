"""The runs a dashboard shows: found under the given paths, followed while their files
grow, and the live runs of a :class:`~loopbus.dashboard.Hub` beside them.

A given path is a run folder, a folder searched (recursively) for run folders, a log
file, or a glob of any of these (expanded again at every scan, so that runs started later
appear). A run folder is one that holds ``records.jsonl``, ``metrics.csv`` or TensorBoard
event files. Nothing outside the given paths is read: folders are walked without
following symbolic links, and a file whose real path leaves its given path is skipped.
Queries name runs by id, never by path.

Imports the base layer only.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import anyio.to_thread

from .._validate import check_number
from ._columns import CORES
from ._logs import (
    CSV,
    JSONL,
    TB_PREFIX,
    Chunk,
    EventsReader,
    LogReader,
    have_tensorboard,
    reader_for,
    reader_for_file,
)
from ._runs import Run, read_facts

if TYPE_CHECKING:
    from ._hub import Hub

__all__ = ["Catalog"]

_OWNER = "Dashboard"
_SKIP = frozenset({"checkpoints", "__pycache__", "node_modules"})
_NO_TB = (
    "TensorBoard event files: reading them needs the tensorboard package "
    "(pip install 'loopbus[tensorboard]')"
)

Reader = LogReader | EventsReader
#: Seconds after its last write that a run whose ``run.json`` records its end counts as
#: finished (``idle`` for the others: a run killed before it could say so).
ENDED_IDLE = 2.0
#: The record names read before the others, at most (a page's first screen of charts).
FIRST = 6
#: The record names pages asked for that are remembered (the latest first).
_WANTED = 32
#: The page's groups of charts, in its order (``dashboard.js``'s ``GROUP_ORDER``).
GROUP_ORDER = ("train", "val", "validate", "test", "predict")
#: Runs read at once, each in a thread of its own (two cores or more read in parallel).
READERS = min(4, CORES)


def _is_log(name: str) -> bool:
    return name in (JSONL, CSV) or name.startswith(TB_PREFIX)


def _inside(path: str, root: str) -> bool:
    """Whether ``path``'s real path is ``root`` or under it (``root`` a real path)."""
    real = os.path.realpath(path)
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def _signature(paths: Sequence[Path]) -> tuple[tuple[int, int, int], ...]:
    out = []
    for path in paths:
        try:
            s = path.stat()
        except OSError:
            out.append((0, 0, 0))
            continue
        out.append((s.st_ino, s.st_size, s.st_mtime_ns))
    return tuple(out)


class _Followed:
    """A run read from files: its reader, the files it reads, and their last state."""

    def __init__(self, run: Run, reader: Reader | None, root: str, folder: Path | None) -> None:
        self.run = run
        self.reader = reader
        self.root = root
        self.folder = folder
        self.seen: tuple[tuple[int, int, int], ...] = ()
        self.facts_seen: tuple[tuple[int, int, int], ...] = ()
        self.started = False  # whether its files were read at all yet

    def files(self) -> list[Path]:
        reader = self.reader
        if reader is None:
            return []
        return list(reader.files) if isinstance(reader, EventsReader) else [reader.path]


class Catalog:
    """Every run the dashboard shows: those found under ``paths`` (see the module's
    docstring) and those of ``hub`` (live jobs). ``poll``: seconds between looks at the
    files of the runs; ``rescan``: seconds between walks of the paths for new runs;
    ``idle``: seconds after its last write that a run read from files counts as
    finished (:data:`ENDED_IDLE` when its ``run.json`` records that its stage ended)."""

    def __init__(
        self,
        paths: Sequence[str | os.PathLike[str]] = (),
        *,
        hub: Hub | None = None,
        poll: float = 0.2,
        rescan: float = 2.0,
        idle: float = 120.0,
    ) -> None:
        self.patterns = [os.fspath(p) for p in paths]
        self.hub = hub
        self.poll = check_number("poll", poll, exclusive_minimum=0, owner=_OWNER)
        self.rescan = check_number("rescan", rescan, exclusive_minimum=0, owner=_OWNER)
        self.idle = check_number("idle", idle, exclusive_minimum=0, owner=_OWNER)
        self._followed: dict[str, _Followed] = {}  # by run id
        self._by_path: dict[str, str] = {}  # real path of a run's folder or file -> id
        self._attached: dict[int, _Followed] = {}  # id(live run) -> its folder's reading
        self._last_scan = -1.0
        self._wanted: dict[str, None] = {}  # names pages asked for, the latest last
        self._known: set[str] = set()  # the record names the runs' files have
        self._waiting: list[anyio.Event] = []  # requests waiting for columns to be read

    # ------------------------------------------------------------ the runs
    def runs(self) -> list[Run]:
        """Every run shown: those read from files (but those a live run shows), then the
        live ones, in the order found."""
        live = [feed.run for feed in self.hub.runs] if self.hub is not None else []
        shown = {str(r.folder.resolve()) for r in live if r.folder is not None}
        files = [
            f.run
            for f in list(self._followed.values())
            if f.folder is None or str(f.folder) not in shown
        ]
        return files + live

    def get(self, run_id: str) -> Run | None:
        """The run with that id, or None."""
        for run in self.runs():
            if run.id == run_id:
                return run
        return None

    # ------------------------------------------------------------ finding runs
    def roots(self) -> list[str]:
        """The real paths the given paths name now (globs expanded)."""
        found: list[str] = []
        for pattern in self.patterns:
            expanded = os.path.expanduser(pattern)
            matches = (
                glob.glob(expanded, recursive=True) if glob.has_magic(expanded) else [expanded]
            )
            for match in sorted(matches):
                if os.path.exists(match):
                    real = os.path.realpath(match)
                    if real not in found:
                        found.append(real)
        return found

    def scan(self) -> list[Run]:
        """Walk the given paths; returns the runs found that were not known yet."""
        new: list[Run] = []
        for root in self.roots():
            for folder, names in _run_places(root):
                key = str(folder)
                if key in self._by_path:
                    self._refresh_files(self._followed[self._by_path[key]], names)
                    continue
                run = self._add(root, folder, names)
                new.append(run)
        self._last_scan = time.monotonic()
        return new

    def _add(self, root: str, place: Path, names: set[str]) -> Run:
        is_file = place.is_file()
        base = os.path.basename(root) or root
        rel = os.path.relpath(place, root)
        if is_file:
            name = f"{base}/{rel}" if rel != "." else place.name
        else:
            name = f"{base}/{rel}" if rel != "." else "/".join(place.parts[-2:])
        run_id = name
        n = 2
        while run_id in self._followed:
            run_id = f"{name} ({n})"
            n += 1
        run = Run(run_id, name, str(place), kind="file" if is_file else "folder")
        reader: Reader | None
        if is_file:
            reader = reader_for_file(place)
        else:
            reader = reader_for(place, names)
        if reader is None:
            run.reason = _NO_TB if not have_tensorboard() else "no log loopbus can read"
            run.loaded = True
        followed = _Followed(run, reader, root, None if is_file else place)
        run.files = [str(p) for p in followed.files()]
        self._followed[run_id] = followed
        self._by_path[str(place)] = run_id
        if not is_file:
            self._read_facts(followed)
        return run

    def _refresh_files(self, followed: _Followed, names: set[str]) -> None:
        """New event files of a TensorBoard run (a resumed run writes another)."""
        reader = followed.reader
        if isinstance(reader, EventsReader) and followed.folder is not None:
            files = sorted(followed.folder / n for n in names if n.startswith(TB_PREFIX))
            if files != sorted(reader.files):
                reader.files = files
                followed.run.files = [str(p) for p in files]

    def _read_facts(self, followed: _Followed) -> None:
        folder = followed.folder
        if folder is None:
            return
        paths = [folder / n for n in ("run.json", "config.yaml", "hparams.yaml", "hparams.json")]
        seen = _signature(paths)
        if seen == followed.facts_seen:
            return
        followed.facts_seen = seen
        root = followed.root
        facts, config = read_facts(folder, lambda p: _inside(str(p), root))
        followed.run.set_facts(facts, config)

    # ------------------------------------------------------------ reading them
    def _due(self) -> Iterator[_Followed]:
        """The followed runs not read yet, and those whose files changed since they were
        last read or hold more than was read of them."""
        for followed in [*self._followed.values(), *self._attached.values()]:
            if followed.reader is None:
                continue
            seen = _signature(followed.files())
            reader = followed.reader
            if (
                seen != followed.seen
                or not followed.started
                or (isinstance(reader, LogReader) and reader.more())
            ):
                followed.seen = seen
                yield followed

    def _attach_live(self) -> None:
        """Start reading the folder a live run's stream named (its history)."""
        if self.hub is None:
            return
        for feed in self.hub.runs:
            run = feed.run
            if run.folder is None or id(run) in self._attached:
                continue
            folder = run.folder
            try:
                names = {n for n in os.listdir(folder) if _is_log(n)}
            except OSError:
                names = set()
            self._attached[id(run)] = _Followed(
                run, reader_for(folder, names), str(folder.resolve()), folder
            )

    def look(self) -> list[_Followed]:
        """New runs (when a scan is due) and the runs whose files changed since the last
        look, or hold more than was read of them (to :meth:`read`, one at a time)."""
        if self._last_scan < 0 or time.monotonic() - self._last_scan >= self.rescan:
            self.scan()
            for followed in list(self._followed.values()):
                self._read_facts(followed)
        self._attach_live()
        return list(self._due())

    # ------------------------------------------------------------ what is read first
    def want(self, *names: str) -> None:
        """A page asked for the record ``names``: the runs' columns of them are read
        before the others (the latest asked first)."""
        for name in names:
            self._wanted.pop(name, None)
            self._wanted[name] = None
        while len(self._wanted) > _WANTED:
            del self._wanted[next(iter(self._wanted))]

    def first(self) -> list[str]:
        """The record names read before the others: those pages asked for, the latest
        first, then the page's first charts (the runs' first names in the page's order,
        :func:`page_order`); at most :data:`FIRST` of them."""
        asked = list(reversed(self._wanted))
        if len(asked) < FIRST:
            guess = sorted(self._known.difference(asked), key=page_order)
            asked += guess[: FIRST - len(asked)]
        return asked[:FIRST]

    async def read_first(self, runs: Sequence[Run], names: Collection[str] | None) -> None:
        """Have the record ``names`` (all: None) of ``runs`` read first, and wait until
        they are read."""
        wanted = set(names) if names is not None else None
        if wanted is not None:
            self.want(*wanted)
        while any(
            not r.loaded or (r.pending if wanted is None else r.pending & wanted) for r in runs
        ):
            event = anyio.Event()
            self._waiting.append(event)
            await event.wait()

    def _next(self, queue: list[_Followed], first: list[str]) -> tuple[_Followed, list[str] | None]:
        """The run to read next and the names to read (None: every name): a run not read
        yet, or one without the first of the ``first`` names, before the others (every
        run's first chart fills in first), then one without some of the other ``first``
        names."""
        for group in (first[:1], first[1:]):
            for followed in queue:
                run = followed.run
                if group and (not run.loaded or run.pending.intersection(group)):
                    return followed, group
        for followed in queue:
            if not followed.run.loaded:
                return followed, first
        return queue[0], None

    @staticmethod
    def read(followed: _Followed, names: list[str] | None = None) -> list[Chunk]:
        """What one run's files hold since the last read (to :meth:`apply`): of the
        record ``names`` where its reader can read some names first, else of every
        name."""
        reader = followed.reader
        assert reader is not None
        followed.started = True
        chunks = [reader.read(names)]
        while chunks[-1] and isinstance(reader, LogReader) and reader.more(names):
            chunks.append(reader.read(names))
        return chunks

    def refresh(self) -> list[tuple[_Followed, Chunk]]:
        """One look at every run and one read of those that changed, in this thread."""
        return [(f, chunk) for f in self.look() for chunk in self.read(f)]

    def apply(self, found: list[tuple[_Followed, Chunk]]) -> None:
        """Add what :meth:`refresh` read to the runs."""
        now = time.time()
        for followed, chunk in found:
            run = followed.run
            run.apply(chunk)
            self._known.update(chunk.pending or (), chunk.points, chunk.arrays)
            if not run.loaded:
                run.loaded = True
                run.version += 1
        if found:
            waiting, self._waiting = self._waiting, []
            for event in waiting:
                event.set()
        # The runs just read; every run when nothing was (once a look, at most: a run
        # goes from live to finished without a read).
        checked = {id(f): f for f, _ in found} if found else self._followed
        for followed in checked.values():
            if self._followed.get(followed.run.id) is not followed:
                continue  # a live run's folder: its state is its feed's
            newest = max((mtime for mtime in _mtimes(followed.files())), default=0.0)
            # A run whose run.json says its stage ended is finished once its files rest
            # for a moment (its loggers' last lines come after the record).
            idle = min(ENDED_IDLE, self.idle) if "ended" in followed.run.facts else self.idle
            state = "live" if now - newest < idle else "finished"
            if state != followed.run.state:
                followed.run.state = state
                followed.run.version += 1

    def load(self) -> None:
        """Find and read every run once, now (what :meth:`run` does at every look)."""
        self.apply(self.refresh())
        self.apply([])

    async def run(self) -> None:
        """Follow the runs (and find new ones), until cancelled: each run's new points
        are added as soon as they are read, the names of :meth:`first` before the
        others, by :data:`READERS` threads at once (parsing releases the GIL); the files
        are looked at again every ``poll`` seconds meanwhile."""
        while True:
            queue = await anyio.to_thread.run_sync(self.look)
            looked = time.monotonic()
            busy: set[int] = set()
            async with anyio.create_task_group() as tg:
                for _ in range(min(READERS, len(queue))):
                    tg.start_soon(self._work, queue, busy, looked)
            self.apply([])
            if not queue:
                await anyio.sleep(self.poll)

    async def _work(self, queue: list[_Followed], busy: set[int], looked: float) -> None:
        """Read runs of ``queue`` that no other worker reads, until it is empty or
        ``poll`` seconds after ``looked`` (one run at least)."""
        while True:
            free = [f for f in queue if id(f) not in busy]
            if not free:
                return
            followed, names = self._next(free, self.first())
            busy.add(id(followed))
            try:
                chunks = await anyio.to_thread.run_sync(self.read, followed, names)
            finally:
                busy.discard(id(followed))
            self.apply([(followed, chunk) for chunk in chunks])
            reader = followed.reader
            if not (isinstance(reader, LogReader) and reader.more()) or (
                names is None and not any(chunks)
            ):
                queue.remove(followed)
            if time.monotonic() - looked >= self.poll:
                return


def page_order(name: str) -> tuple[str, str]:
    """Where the page puts the chart of record ``name``: grouped by the part before the
    first ``/`` (:data:`GROUP_ORDER` first, then the other groups, then names without a
    group), by name in a group (``dashboard.js`` orders its charts the same way)."""
    cut = name.find("/")
    group = name[:cut] if cut > 0 else None
    if group is None:
        return "~", name
    rank = GROUP_ORDER.index(group) if group in GROUP_ORDER else None
    return (str(rank) if rank is not None else "5" + group), name


def _mtimes(paths: list[Path]) -> Iterator[float]:
    for path in paths:
        try:
            yield path.stat().st_mtime
        except OSError:
            continue


def _run_places(root: str) -> Iterator[tuple[Path, set[str]]]:
    """The run folders (or the log file) under ``root``, with their log files' names;
    symbolic links that lead out of ``root`` are not followed."""
    if os.path.isfile(root):
        yield Path(root), {os.path.basename(root)}
        return
    for folder, dirs, files in os.walk(root, followlinks=False):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP and not d.startswith("."))
        logs = {f for f in files if _is_log(f) and _inside(os.path.join(folder, f), root)}
        if logs:
            yield Path(folder), logs
