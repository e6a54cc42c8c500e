"""``loopbus fit|validate|test|predict``: the command line read, the configuration put
together and checked (:mod:`._sources`, :mod:`._sections`), then printed
(``--print-config``, ``--explain``) or run: the module, the data, the plugins and the
``Trainer`` built from it, and the stage.

Help, reading and the first checks (every key, the type of each value) import neither
torch nor the engine; the engine is imported when the trainer's values are checked, the
user's code when its class paths are.
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import IO, Any

from ._config_sources import DEFAULT, CommandLine, Config, assemble, read_command_line
from ._errors import ConfigError, Problem
from ._resume import changes, saved_config
from ._sections import Resolved, check_classes, check_shape, check_values
from ._sweep import sweep_main

__all__ = ["COMMANDS", "add_commands", "main", "resolve"]

#: The configuration commands, with what each does.
COMMANDS = {
    "fit": "train a module on data, from configuration files and --KEY=VALUE overrides",
    "validate": "run the validation step over data once, from configuration files",
    "test": "run the test step over data once, from configuration files",
    "predict": "run the predict step over data, from configuration files",
    "sweep": "run (or print) a grid of fit runs, each in its own version folder",
    "lighthouse": "start a torchft Lighthouse for fault-tolerant replica groups (strategy='ft')",
}

_EPILOG = """\
configuration (LightningCLI's shape; see docs/cli.md):
  seed_everything: 0
  trainer:                    # every Trainer option, and plugins:
    max_epochs: 3
    plugins:
      - class_path: Checkpoint              # a loopbus plugin by its name, or a class path
        init_args: {dirpath: checkpoints}
  model:
    class_path: package.module.MyModule     # imported from here, as python -m does
    init_args: {lr: 3.0e-4}
  data:                                     # a DataModule, or a class/function that
    class_path: package.module.make_loaders #   returns the loaders
    init_args: {batch_size: 64}
  ckpt_path: null

overrides (applied in the order given, after or between --config files):
  --trainer.max_epochs=3  --model.init_args.lr=3e-4  --data.init_args.batch_size=64
  --model=package.module.OtherModule  --seed_everything=1  --ckpt_path=last
A value is read as YAML (3, 3.0e-4, true, null, [a, b]). `loopbus {command} --config
FILE --print-config` lists every key with its value, every option's default included.
"""


def _describe(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    if command == "lighthouse":
        return _lighthouse_arguments(parser)
    parser.add_argument(
        "--config",
        action="append",
        metavar="FILE",
        help="a configuration file (.yaml, .yml, .toml or .json); several are merged, the "
        "later winning",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the resolved configuration (every default included) as YAML and exit",
    )
    if command == "sweep":
        parser.add_argument(
            "--grid", action="append", metavar="KEY=V1,V2", help="a key and its values"
        )
        parser.add_argument("--seeds", metavar="S1,S2", help="seed_everything's values")
        parser.add_argument(
            "--dry-run", action="store_true", help="print one loopbus fit line per point"
        )
    if command == "fit":
        parser.add_argument(
            "--resume",
            metavar="RUN_DIR",
            help="continue the run in RUN_DIR (root_dir/name/version_N): its saved "
            "configuration, its newest complete checkpoint, the same folder; overrides "
            "given too are applied and printed as changes",
        )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="print each key's value and where it came from (a default, a file, the "
        "command line) and exit",
    )
    parser.epilog = _EPILOG.replace("{command}", command)
    return parser


def _parser(command: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"loopbus {command}",
        description=COMMANDS[command] + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    return _describe(parser, command)


def add_commands(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the configuration commands to ``loopbus``'s subcommands (for its help; their
    arguments are read by :func:`main`)."""
    for command, summary in COMMANDS.items():
        parser = commands.add_parser(
            command,
            help=summary,
            description=summary + ".",
            formatter_class=argparse.RawDescriptionHelpFormatter,
            allow_abbrev=False,
        )
        _describe(parser, command)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``loopbus COMMAND ARGS...`` (``argv`` is ``["fit", "--config", "run.yaml",
    ...]``; default ``sys.argv[1:]``) and return its exit status: 0 when it ran, 2 when
    the command line or a configuration file is wrong (every problem printed on stderr
    with its key, before the module or the data are built and before anything is
    written). Exceptions of the run itself propagate."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in COMMANDS:
        given = repr(args[0]) if args else "nothing"
        print(
            f"loopbus: the command must be one of {', '.join(COMMANDS)}; got {given}.",
            file=sys.stderr,
        )
        return 2
    command = args[0]
    if command == "lighthouse":
        return lighthouse_main(args[1:])
    if command == "sweep":
        return sweep_main(args[1:], resolve, run_stage)
    try:
        line = read_command_line(command, args[1:])
        if line.help:
            _parser(command).print_help()
            return 0
        resolved, saved = resolve(line)
    except ConfigError as exc:
        print(f"loopbus {command}: {exc}", file=sys.stderr)
        return 2
    if saved is not None:
        _say_changes(line, saved, resolved)
    if "print-config" in line.flags:
        sys.stdout.write(to_yaml(resolved.config))
        return 0
    if "explain" in line.flags:
        sys.stdout.write(explain(resolved))
        return 0
    return run_stage(command, resolved)


def _lighthouse_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--bind", default="[::]:29510", help="host:port to listen on (port 0: any free port)"
    )
    parser.add_argument(
        "--min-replicas",
        type=int,
        default=1,
        help="the fewest replica groups a quorum forms with (a majority of the groups "
        "keeps two halves of a split run from both training)",
    )
    parser.add_argument(
        "--join-timeout-ms",
        type=int,
        default=60_000,
        help="how long a quorum waits for groups that have not asked yet",
    )
    parser.add_argument("--quorum-tick-ms", type=int, default=100, help="quorum check period")
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5_000,
        help="a group silent this long is left out of the next quorum",
    )
    parser.epilog = (
        "The replica groups find it through TORCHFT_LIGHTHOUSE=<the address it prints> "
        "(or FaultTolerantStrategy(lighthouse=...)); see docs/distributed.md. It runs "
        "until interrupted (SIGINT or SIGTERM)."
    )
    return parser


def lighthouse_main(argv: Sequence[str]) -> int:
    """``loopbus lighthouse [--bind HOST:PORT] ...``: serve a Lighthouse until SIGINT
    or SIGTERM; print its address first (one line, flushed)."""
    import signal

    parser = _parser("lighthouse")
    args = parser.parse_args(list(argv))
    from loopbus._exceptions import MisconfigurationError
    from loopbus.distributed._ft import serve_lighthouse

    stop = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    try:
        server = serve_lighthouse(
            args.bind,
            min_replicas=args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            quorum_tick_ms=args.quorum_tick_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        )
    except (MisconfigurationError, RuntimeError, OSError) as exc:
        print(f"loopbus lighthouse: {exc}", file=sys.stderr)
        return 2
    address = server.address()
    print(
        f"loopbus lighthouse: listening on {address} (min_replicas={args.min_replicas}); "
        f"start the replica groups with TORCHFT_LIGHTHOUSE={address}",
        flush=True,
    )
    try:
        signal.sigwait(stop)
    finally:
        server.shutdown()
    return 0


def resolve(line: CommandLine) -> tuple[Resolved, dict[str, Any] | None]:
    """The configuration ``line`` gives, checked in full, and with ``--resume`` the saved
    configuration it started from; raises :class:`ConfigError`."""
    if "dry-run" in line.flags or line.grid or line.seeds is not None:
        raise ConfigError(
            [Problem("", "--grid, --seeds and --dry-run are options of loopbus sweep only.")]
        )
    config = Config()
    saved = None
    if line.resume is not None:
        if line.command != "fit":
            raise ConfigError(
                [Problem("", f"--resume is an option of loopbus fit, not of {line.command}.")]
            )
        saved, path, pointed = saved_config(line.resume)
        config.merge(saved, path)
        config.merge(pointed, f"--resume {line.resume}")
    assemble(line, config)
    check_shape(config, line.command)  # no torch yet
    check_values(config)
    return check_classes(config), saved


def _say_changes(line: CommandLine, saved: Mapping[str, Any], resolved: Resolved) -> None:
    """On stderr: the run resumed, and each key whose value differs from the saved one."""
    found = changes(saved, resolved.config)
    print(
        f"loopbus fit: resuming {line.resume} ({len(found)} change(s) to its configuration)",
        file=sys.stderr,
    )
    for key, before, after in found:
        source = resolved.origins.get(key, DEFAULT)
        print(f"  {key}: {_inline(before)} -> {_inline(after)}  # {source}", file=sys.stderr)


def to_yaml(config: Mapping[str, Any]) -> str:
    import yaml

    return str(yaml.safe_dump(dict(config), sort_keys=False, default_flow_style=False))


def _inline(value: Any) -> str:
    import yaml

    text = str(yaml.safe_dump(value, default_flow_style=True, width=10**9))
    return text.removesuffix("\n...\n").strip()


def _leaves(node: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from _leaves(value, path + ".")
        else:
            yield path, value


def explain(resolved: Resolved) -> str:
    """One line per key of the resolved configuration: its path, its value and where the
    value came from (``default``, a file's path, ``command line: --KEY=VALUE``)."""
    rows = [
        (path, _inline(value), resolved.origins.get(path, DEFAULT))
        for path, value in _leaves(resolved.config)
    ]
    width = max(len(path) for path, _, _ in rows)
    shown = max(min(len(text), 40) for _, text, _ in rows)
    return "".join(f"{path:<{width}}  {text:<{shown}}  # {source}\n" for path, text, source in rows)


def run_stage(command: str, resolved: Resolved, out: IO[str] | None = None) -> int:
    """Build what ``resolved`` names and run the stage: seed, plugins and ``Trainer``,
    the module, the data; the configuration handed to the trainer
    (``trainer.set_run_config``) where it takes one."""
    import loopbus

    out = out if out is not None else sys.stdout
    config = resolved.config
    seed = config["seed_everything"]
    if seed is True:
        seed = config["seed_everything"] = random.randrange(2**32)
        print(f"loopbus {command}: seed_everything drew the seed {seed}", file=sys.stderr)
    if seed is not False and seed is not None:
        loopbus.seed_everything(seed)
    module = resolved.model.build()
    data = resolved.data.build()
    plugins = None if resolved.plugins is None else [spec.build() for spec in resolved.plugins]
    try:
        args, kwargs = _data_arguments(command, data, resolved.data.path)
        trainer = _trainer(resolved.trainer, plugins)
    except ConfigError as exc:
        print(f"loopbus {command}: {exc}", file=sys.stderr)
        return 2
    if callable(getattr(trainer, "set_run_config", None)):
        trainer.set_run_config(config)
    if config["ckpt_path"] is not None:
        kwargs["ckpt_path"] = config["ckpt_path"]
    result = loopbus.run(getattr(trainer, command), module, *args, **kwargs)
    _report(command, result, out)
    return 0


def _trainer(options: Mapping[str, Any], plugins: list[Any] | None) -> Any:
    """``Trainer(**options, plugins=plugins)``; what it refuses (a precision it does not
    know, say) as a :class:`ConfigError` of the ``trainer`` section."""
    import loopbus

    strategy = options.get("strategy")
    if hasattr(strategy, "build"):  # {class_path, init_args}: a strategy object
        options = {**options, "strategy": strategy.build()}
    try:
        return loopbus.Trainer(**options, plugins=plugins)
    except (loopbus.MisconfigurationError, TypeError, ValueError) as exc:
        raise ConfigError([Problem("trainer", str(exc))]) from None


def _data_arguments(command: str, data: Any, path: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """How the stage takes what ``data.class_path`` built: a DataModule as
    ``datamodule=``; for ``fit`` a tuple as (training data, validation data); else the
    one loader."""
    from loopbus import is_datamodule

    if is_datamodule(data):
        return (), {"datamodule": data}
    if isinstance(data, tuple):
        if command == "fit" and 1 <= len(data) <= 2:
            return data, {}
        takes = "(train, val) or (train,)" if command == "fit" else "one loader"
        raise ConfigError(
            [
                Problem(
                    "data.class_path",
                    f"{path} returned a tuple of {len(data)}; loopbus "
                    f"{command} takes {takes}, or a DataModule.",
                )
            ]
        )
    return (data,), {}


def _report(command: str, result: Any, out: IO[str]) -> None:
    """What validate and test return (the last value of each record), as YAML; for
    predict, how many outputs."""
    if command in ("validate", "test") and isinstance(result, Mapping):
        values = {str(k): _number(v) for k, v in result.items()}
        out.write(to_yaml({command: values}))
    elif command == "predict" and isinstance(result, list):
        out.write(f"predict: {len(result)} outputs\n")


def _number(value: Any) -> Any:
    item = getattr(value, "item", None)
    return item() if callable(item) else value
