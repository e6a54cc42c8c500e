"""The ``loopbus`` command (it imports neither torch nor the engine: it starts fast;
``loopbus consolidate`` alone imports them when it runs).

``loopbus watch ADDRESS`` shows a live table of a running run's records (latest value,
step and rate of each name); ``loopbus watch --jsonl ADDRESS`` prints one JSON object
per record instead, for piping into other tools. ``ADDRESS`` is what the run's
``StreamServer`` printed: ``tcp://127.0.0.1:PORT`` or ``unix:///path``.
``loopbus consolidate CHECKPOINT OUT`` writes a sharded checkpoint as one file.
"""

from __future__ import annotations

import argparse
import collections
import functools
import math
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING, Any

import anyio
import msgspec

from ._exceptions import StreamError
from .events import PutRecord
from .stream import EpochEnded, Gap, StageEnded, StageStarted, Stream, connect

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["main"]

_RATE_WINDOW = 64


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="loopbus",
        description="loopbus: an async, event-driven training-loop engine for PyTorch.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_watch(commands)
    _add_dashboard(commands)
    _add_consolidate(commands)
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
        help="chart the records of running jobs live in a web page",
        description=(
            "Connect to the stream server of one or more running jobs and serve a local web "
            "page that charts every record name live (x = step), one series per job. Keeps "
            "watching across stages and until stopped (Ctrl-C)."
        ),
    )
    dashboard.add_argument(
        "addresses", nargs="+", metavar="ADDRESS", help="tcp://HOST:PORT or unix:///path, per job"
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
    dashboard.set_defaults(run=_dashboard)


def _add_consolidate(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    consolidate = commands.add_parser(
        "consolidate",
        help="write a sharded checkpoint as one checkpoint file",
        description=(
            "Read every shard of a sharded checkpoint (a directory the Checkpoint plugin "
            "wrote with sharded=True) in this process and write it as one checkpoint file, "
            "loadable with torch.load(OUT, weights_only=True). OUT must not exist."
        ),
    )
    consolidate.add_argument("checkpoint", help="the sharded checkpoint's directory")
    consolidate.add_argument("out", help="the checkpoint file to write")
    consolidate.set_defaults(run=_consolidate)


def _consolidate(args: argparse.Namespace) -> int:
    # Imports torch and the engine: only this command needs them.
    from ._exceptions import CheckpointError
    from .checkpoint import consolidate_checkpoint

    try:
        written = consolidate_checkpoint(args.checkpoint, args.out)
    except CheckpointError as exc:
        print(f"loopbus consolidate: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {written}")
    return 0


def _dashboard(args: argparse.Namespace) -> int:
    try:
        from .dashboard import serve  # the web libraries load only for this command

        serve(
            args.addresses,
            host=args.host,
            port=args.port,
            token=args.token,
            web_token=args.web_token,
            labels=args.label,
            open_browser=args.open,
        )
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except (ImportError, ValueError, OSError) as exc:  # web extra missing, bad option, port taken
        print(f"loopbus dashboard: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``loopbus`` console script; returns the exit status. Each
    subcommand's parser sets ``run``, the function that carries it out."""
    args = _parser().parse_args(argv)
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
    """One JSON object per record (and event), with its sequence number first; gap
    notices go to stderr. Flushed whenever the stream has nothing more buffered."""
    out = out if out is not None else sys.stdout.buffer
    encode = msgspec.json.Encoder().encode
    try:
        async for item in stream:
            if type(item) is Gap:
                print(
                    f"loopbus watch: {item.count} records dropped (seq {item.seq} to "
                    f"{item.seq + item.count - 1}): reading too slowly",
                    file=sys.stderr,
                    flush=True,
                )
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
            if not stream.buffered:
                out.flush()
        out.flush()
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python from complaining
        # about the unflushed stdout at exit.
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
    from rich.console import Console
    from rich.live import Live

    rows: dict[str, _Row] = {}
    welcome = stream.welcome
    status = _Status(welcome.stage if welcome is not None else None)
    render = functools.partial(_table, stream, rows, status)
    console = Console(stderr=False)
    with Live(get_renderable=render, console=console, refresh_per_second=4, transient=False):
        async for item in stream:
            _take(item, rows, status)
        if stream.bye is not None:
            status.last = f"ended: {stream.bye.reason or 'the server closed'}"


if __name__ == "__main__":
    sys.exit(main())
