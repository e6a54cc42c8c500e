"""The ``loopbus`` command (it imports neither torch nor the engine: it starts fast;
``loopbus consolidate`` alone imports them when it runs).

``loopbus watch ADDRESS`` shows a live table of a running run's records (latest value,
step and rate of each name); ``loopbus watch --jsonl ADDRESS`` prints one JSON object
per record instead, for piping into other tools. ``ADDRESS`` is what the run's
``StreamServer`` printed: ``tcp://127.0.0.1:PORT`` or ``unix:///path``.
``loopbus consolidate CHECKPOINT OUT`` writes a sharded checkpoint as one file;
``CHECKPOINT`` may be the Checkpoint plugin's folder (its newest complete sharded
checkpoint is taken, and named on stderr).
``loopbus fit|validate|test|predict --config FILE`` runs a stage from configuration files
and ``--KEY=VALUE`` overrides (``loopbus.cli``, which reads their arguments itself).
"""

from __future__ import annotations

import argparse
import collections
import functools
import math
import os
import posixpath
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING, Any

import anyio
import msgspec

from ._exceptions import StreamError
from .cli import main as cli_main
from .cli._main import COMMANDS, add_commands
from .events import PutRecord
from .stream import EpochEnded, Gap, StageEnded, StageStarted, Stream, connect

if TYPE_CHECKING:
    from rich.table import Table

    from .storage import Storage

__all__ = ["main"]

_RATE_WINDOW = 64
#: The names a checkpoint file has (loopbus writes .ckpt; .pt and .pth are taken too).
_CHECKPOINT_FILES = (".ckpt", ".pt", ".pth")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loopbus",
        description="loopbus: an async, event-driven training-loop engine for PyTorch.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_watch(commands)
    _add_dashboard(commands)
    _add_consolidate(commands)
    add_commands(commands)  # fit, validate, test, predict: listed here, run by loopbus.cli
    return parser


def _add_watch(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    watch = commands.add_parser(
        "watch",
        help="watch the records of a run that serves them (StreamServer)",
        description=(
            "Connect to a run's stream server and show its records live: a table of the "
            "latest value, step and rate of each record name, or with --jsonl one JSON "
            "object per line. Follows the run from stage to stage, and ends when its "
            "server closes (with StreamServer(scope='stage'): when the stage ends)."
        ),
    )
    watch.add_argument(
        "address", help="where the run serves: tcp://HOST:PORT, HOST:PORT, PORT, or unix:///path"
    )
    watch.add_argument(
        "--jsonl",
        action="store_true",
        help='print one JSON object per record ({"seq": ..., "type": "PutRecord", "name": ...})',
    )
    watch.add_argument(
        "--names",
        action="append",
        metavar="GLOB",
        help="only records whose name matches (repeat, or separate with commas); default all",
    )
    watch.add_argument(
        "--events",
        action="store_true",
        help="also show lifecycle events (stage starts and ends, epoch ends)",
    )
    watch.add_argument(
        "--token",
        default=os.environ.get("LOOPBUS_TOKEN"),
        help="the server's token, if it has one (default: $LOOPBUS_TOKEN)",
    )
    watch.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="keep trying to connect for this long while nothing listens yet",
    )
    watch.set_defaults(run=_watch_command)


def _add_dashboard(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    dashboard = commands.add_parser(
        "dashboard",
        help="chart runs, finished or live, in a web page",
        description=(
            "Serve a local web page that charts every run found under the given paths (run "
            "folders, folders searched for runs, log files, globs; files still being "
            "written are followed) and every running job at the given stream addresses, "
            "one series per run. Keeps watching until stopped (Ctrl-C)."
        ),
    )
    dashboard.add_argument(
        "sources",
        nargs="+",
        metavar="PATH|GLOB|ADDRESS",
        help="a run folder, a folder of runs, a log file, a glob, or a job's stream "
        "(tcp://HOST:PORT or unix:///path)",
    )
    dashboard.add_argument(
        "--token",
        default=os.environ.get("LOOPBUS_TOKEN"),
        help="the jobs' stream token, if they have one (default: $LOOPBUS_TOKEN)",
    )
    dashboard.add_argument("--host", default="127.0.0.1", help="where to serve the page")
    dashboard.add_argument("--port", type=int, default=0, help="the page's port (0: a free one)")
    dashboard.add_argument(
        "--web-token",
        default=os.environ.get("LOOPBUS_DASHBOARD_TOKEN"),
        help="a token the page asks for; required beyond loopback ('auto' makes one up)",
    )
    dashboard.add_argument("--label", action="append", help="a job's name on the page (repeat)")
    dashboard.add_argument("--open", action="store_true", help="open the page in a browser")
    dashboard.add_argument(
        "--export",
        metavar="FILE",
        help="write one self-contained HTML report of the runs (opens offline) and exit",
    )
    dashboard.set_defaults(run=_dashboard)


def _add_consolidate(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    consolidate = commands.add_parser(
        "consolidate",
        help="write a sharded checkpoint as one checkpoint file",
        description=(
            "Read every shard of a sharded checkpoint (a directory the Checkpoint plugin "
            "wrote with sharded=True) in this process and write it as one checkpoint file, "
            "loadable with torch.load(OUT, weights_only=True). CHECKPOINT is that "
            "directory, or the Checkpoint plugin's folder: then its newest complete "
            "sharded checkpoint is taken (the one its last.json names, if it is one), and "
            "named on stderr. OUT must not exist. Either may be a URL (s3://bucket/run, "
            "gs://..., any fsspec URL), reached with the credentials and endpoint of the "
            "standard places (AWS_* variables, ~/.aws, ...)."
        ),
    )
    consolidate.add_argument(
        "checkpoint",
        help="a sharded checkpoint's directory, or a folder of checkpoints (its newest is taken)",
    )
    consolidate.add_argument("out", help="the checkpoint file to write")
    consolidate.set_defaults(run=_consolidate)


def _consolidate(args: argparse.Namespace) -> int:
    # Imports torch and the engine: only this command needs them.
    from ._exceptions import CheckpointError, MisconfigurationError
    from .checkpoint import consolidate_checkpoint

    try:
        written = consolidate_checkpoint(_sharded_source(args.checkpoint), args.out)
    except (CheckpointError, MisconfigurationError) as exc:
        print(f"loopbus consolidate: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a store that cannot be reached, credentials refused
        print(f"loopbus consolidate: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {written}")
    return 0


def _sharded_source(given: str) -> Any:
    """The sharded checkpoint ``loopbus consolidate GIVEN`` means (a path, or a URL
    reached with the standard credentials): ``given`` itself when it is one (or is no
    directory: consolidating says what is wrong with it); in a folder of checkpoints, the
    one its ``last.json`` names if that is a complete sharded checkpoint, else its newest
    complete sharded checkpoint, said on stderr. Raises :class:`~loopbus.CheckpointError`
    saying what the folder holds when it holds none."""
    from .checkpoint import is_sharded_checkpoint, latest_checkpoint
    from .storage import located, location, store_for

    target = location(given, owner="loopbus consolidate")
    parent, name = located(target)
    if not parent.is_directory(name) or is_sharded_checkpoint(target):
        return target
    folder = store_for(target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        last = latest_checkpoint(target)  # what ckpt_path="last" would load from it
    skipped = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    if last is not None and is_sharded_checkpoint(last):
        chosen: Any = last
    else:
        chosen = _newest_sharded(folder)
    if chosen is None:
        raise _no_sharded_checkpoint(folder)
    if chosen == last:
        for message in skipped:  # checkpoints newer than it that are not complete
            print(f"loopbus consolidate: {message}", file=sys.stderr)
    print(
        f"loopbus consolidate: {folder.shown} is a folder of checkpoints; consolidating its "
        f"newest complete sharded checkpoint, {chosen.name}{_step_of(chosen)}.",
        file=sys.stderr,
    )
    return chosen


def _sharded_in(folder: Storage) -> list[Any]:
    """The sharded checkpoints' directories in the store ``folder``, complete or not."""
    from .checkpoint import is_sharded_checkpoint

    prefixes = folder.contents()[1]
    found = [folder.path(name) for name in sorted(prefixes) if not name.startswith(".")]
    return [path for path in found if is_sharded_checkpoint(path)]


def _newest_sharded(folder: Storage) -> Any:
    """The newest complete sharded checkpoint in the store ``folder`` (the highest step
    its marker records, then the latest), None if there is none."""
    from ._exceptions import CheckpointError
    from .checkpoint._locate import newest
    from .checkpoint._sharded_load import verify_sharded

    complete = []
    for candidate in _sharded_in(folder):
        try:
            verify_sharded(candidate)
        except CheckpointError:
            continue
        complete.append(candidate)
    return newest(complete)


def _step_of(checkpoint: os.PathLike[str]) -> str:
    from ._exceptions import CheckpointError
    from .checkpoint import checkpoint_info

    try:
        info = checkpoint_info(checkpoint) or {}
    except CheckpointError:
        return ""
    step = info.get("global_step")
    return f" (step {step})" if isinstance(step, int) else ""


def _no_sharded_checkpoint(folder: Storage) -> Exception:
    """The error for a folder (the store ``folder``) without a complete sharded
    checkpoint: what it holds, and what to pass instead."""
    from ._exceptions import CheckpointError
    from .checkpoint._sharded_load import verify_sharded

    broken = []
    for candidate in _sharded_in(folder):
        try:
            verify_sharded(candidate)
        except CheckpointError as exc:
            broken.append(f"{candidate.name} ({exc})")
    files = sorted(
        name for name in folder.listing() if posixpath.splitext(name)[1] in _CHECKPOINT_FILES
    )
    held = []
    if files:
        shown = ", ".join(files[:5]) + (", ..." if len(files) > 5 else "")
        held.append(
            f"{len(files)} checkpoint file(s) ({shown}), each one file already: load one "
            "directly, there is nothing to consolidate"
        )
    if broken:
        held.append(f"incomplete sharded checkpoint(s): {'; '.join(broken[:3])}")
    holds = "; ".join(held) if held else "no checkpoint at all"
    return CheckpointError(
        f"{folder.shown} holds no complete sharded checkpoint: it holds {holds}. Pass a "
        "sharded checkpoint's directory (one the Checkpoint plugin wrote with sharded=True), "
        "or the folder such checkpoints were written into."
    )


def _dashboard(args: argparse.Namespace) -> int:
    try:
        from .dashboard import serve  # the web libraries load only for this command

        serve(
            args.sources,
            host=args.host,
            port=args.port,
            token=args.token,
            web_token=args.web_token,
            labels=args.label,
            open_browser=args.open,
            export_to=args.export,
        )
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except (ImportError, ValueError, OSError) as exc:  # web extra missing, bad option, port taken
        print(f"loopbus dashboard: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``loopbus`` console script; returns the exit status. Each
    subcommand's parser sets ``run``, the function that carries it out; the
    configuration commands read their own arguments (``loopbus.cli.main``)."""
    given = list(sys.argv[1:] if argv is None else argv)
    if given and given[0] in COMMANDS:
        return cli_main(given)
    args = _parser().parse_args(given)
    run: Any = args.run
    return int(run(args))


def _watch_command(args: argparse.Namespace) -> int:
    names: list[str] | None = None
    if args.names:
        names = [part for item in args.names for part in item.split(",") if part]
    try:
        return anyio.run(_watch, args, names)
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except StreamError as exc:
        print(f"loopbus watch: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:  # a bad address or filter
        print(f"loopbus watch: {exc}", file=sys.stderr)
        return 2


async def _open(args: argparse.Namespace, names: list[str] | None) -> Stream:
    topics = ["records", "events"] if args.events else ["records"]
    deadline = time.monotonic() + max(0.0, args.wait)
    while True:
        stream = connect(
            args.address, names=names, topics=topics, token=args.token, yield_gaps=True
        )
        try:
            return await stream.__aenter__()
        except StreamError as exc:
            if not isinstance(exc.__cause__, OSError) or time.monotonic() >= deadline:
                raise
        await anyio.sleep(0.2)


async def _watch(args: argparse.Namespace, names: list[str] | None) -> int:
    stream = await _open(args, names)
    try:
        if args.jsonl:
            await _print_jsonl(stream)
        else:
            await _show_table(stream)
    finally:
        await stream.aclose()
    return 0


async def _print_jsonl(stream: Stream, out: IO[bytes] | None = None) -> None:
    """One JSON object per record (and event), with its sequence number first, written
    and flushed as it arrives (a pipe or a file sees each line at once); gap notices go
    to stderr."""
    out = out if out is not None else sys.stdout.buffer
    encode = msgspec.json.Encoder().encode
    try:
        async for item in stream:
            if type(item) is Gap:
                _say_gap(item)
                continue
            value = getattr(item, "value", None)
            if type(value) is float and not math.isfinite(value):
                # JSON has no literal for these: write them as the JSONL logger does.
                text = "nan" if value != value else ("inf" if value > 0 else "-inf")
                item = msgspec.structs.replace(item, value=text)
            if type(item) is PutRecord:
                line = b'{"seq":%d,' % stream.seq + encode(item)[1:]
            else:  # an event: an array on the wire, an object here
                fields = msgspec.structs.asdict(item)
                line = encode({"seq": stream.seq, "type": type(item).__name__, **fields})
            out.write(line + b"\n")
            out.flush()
    except BrokenPipeError:
        _reader_gone()


def _say_gap(gap: Gap) -> None:
    print(
        f"loopbus watch: {gap.count} records dropped (seq {gap.seq} to "
        f"{gap.seq + gap.count - 1}): reading too slowly",
        file=sys.stderr,
        flush=True,
    )


def _reader_gone() -> None:
    """The reader of stdout went away (``| head``): stop quietly, and keep Python from
    complaining about the unflushed stdout at exit."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


class _Row:
    __slots__ = ("count", "epoch", "step", "times", "value")

    def __init__(self) -> None:
        self.value: Any = None
        self.step = 0
        self.epoch = 0
        self.count = 0
        self.times: collections.deque[float] = collections.deque(maxlen=_RATE_WINDOW)

    def rate(self) -> float | None:
        times = self.times
        if len(times) < 2 or times[-1] <= times[0]:
            return None
        return (len(times) - 1) / (times[-1] - times[0])


class _Status:
    """What the table's title and caption say besides the rows."""

    __slots__ = ("last", "records", "stage", "step")

    def __init__(self, stage: str | None) -> None:
        self.stage = stage
        self.last = ""
        self.records = 0
        self.step = 0


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _table(stream: Stream, rows: dict[str, _Row], status: _Status) -> Table:
    """The table as it stands: one row per record name, the run's progress below."""
    from rich.table import Table

    stage = status.stage
    title = f"loopbus · {stream.address}" + (f" · {stage}" if stage else "")
    table = Table(title=title, title_justify="left", expand=False)
    table.add_column("name", style="bold")
    table.add_column("value", justify="right")
    table.add_column("step", justify="right")
    table.add_column("epoch", justify="right")
    table.add_column("records/s", justify="right")
    table.add_column("count", justify="right")
    for name in sorted(rows):
        row = rows[name]
        rate = row.rate()
        table.add_row(
            name,
            _fmt(row.value),
            str(row.step),
            str(row.epoch),
            "" if rate is None else f"{rate:.3g}",
            str(row.count),
        )
    caption = f"{status.records} records · step {status.step}"
    if stream.gaps:
        caption += f" · {stream.gaps} dropped (display too slow)"
    if status.last:
        caption += f" · {status.last}"
    table.caption = caption
    table.caption_justify = "left"
    return table


def _take(item: Any, rows: dict[str, _Row], status: _Status) -> None:
    """Count a record into its row, or say what an event says in the caption."""
    kind = type(item)
    if kind is PutRecord:
        record: PutRecord = item
        row = rows.get(record.name)
        if row is None:
            row = rows[record.name] = _Row()
        row.value = record.value
        row.step = record.step
        row.epoch = record.epoch
        row.count += 1
        row.times.append(record.time)
        status.records += 1
        status.step = max(status.step, record.step)
    elif isinstance(item, EpochEnded):
        status.last = f"epoch {item.epoch} ended"
    elif isinstance(item, StageStarted):
        status.stage = item.stage
        status.last = f"{item.stage} started"
    elif isinstance(item, StageEnded):
        status.last = f"{item.stage} {item.reason}"


async def _show_table(stream: Stream) -> None:
    """A live table on a terminal; on a pipe or a file, a line per record and event as
    it arrives, then the table as it ended."""
    from rich.console import Console
    from rich.live import Live

    rows: dict[str, _Row] = {}
    welcome = stream.welcome
    status = _Status(welcome.stage if welcome is not None else None)
    render = functools.partial(_table, stream, rows, status)
    console = Console(stderr=False)
    if not console.is_terminal:
        try:
            await _print_lines(stream, rows, status, sys.stdout)
            _ended(stream, status)
            console.print(render())
            sys.stdout.flush()
        except BrokenPipeError:
            _reader_gone()
        return
    with Live(get_renderable=render, console=console, refresh_per_second=4, transient=False):
        async for item in stream:
            _take(item, rows, status)
        _ended(stream, status)


async def _print_lines(
    stream: Stream, rows: dict[str, _Row], status: _Status, out: IO[str]
) -> None:
    """A line per record (``name = value (step S, epoch E)``) and per event (what the
    table's caption says of it), each written and flushed as it arrives."""
    async for item in stream:
        if isinstance(item, Gap):
            _say_gap(item)
            continue
        _take(item, rows, status)
        if type(item) is PutRecord:
            line = f"{item.name} = {_fmt(item.value)} (step {item.step}, epoch {item.epoch})"
        else:
            line = f"-- {status.last} (step {item.step}, epoch {item.epoch})"
        out.write(line + "\n")
        out.flush()


def _ended(stream: Stream, status: _Status) -> None:
    if stream.bye is not None:
        status.last = f"ended: {stream.bye.reason or 'the server closed'}"


if __name__ == "__main__":
    sys.exit(main())
