"""``loopbus sweep``: a grid of ``fit`` runs from one configuration. Each point (a value
of every ``--grid`` key, and a seed of ``--seeds``) is the configuration with those keys
overridden, checked in full before anything runs; the points run one after another, each
in its own version folder of the run folder (``trainer.root_dir``), or with
``--dry-run`` are printed as one ``loopbus fit`` command line each, for a scheduler. The
sweep's spec (the command line, every point and its folder) is saved beside the runs as
``sweep-<time>.yaml``.
"""

from __future__ import annotations

import dataclasses
import itertools
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ._config_sources import CommandLine, read_command_line
from ._errors import ConfigError, Problem
from ._sections import Resolved

#: How a command line is resolved and a stage run (``_main``'s, handed in).
Resolve = Callable[[CommandLine], tuple[Resolved, object]]
RunStage = Callable[[str, Resolved], int]

__all__ = ["SWEEP_HELP", "Point", "plan", "sweep_main"]

SWEEP_HELP = """\
usage: loopbus sweep --config FILE [--KEY=VALUE ...] --grid KEY=V1,V2[,...] [--grid ...]
                     [--seeds S1,S2,...] [--dry-run]

A grid of `loopbus fit` runs: one per combination of the --grid values (and of the
--seeds, set as seed_everything), each checked before any runs, each in its own version
folder of trainer.root_dir/trainer.name (give --trainer.root_dir=runs). Values are read
as YAML (1e-3, true, null); a value cannot itself hold a comma. --dry-run prints one
`loopbus fit` command line per point instead of running them. Either way the sweep's
spec is saved beside the runs as sweep-<time>.yaml.
"""


@dataclasses.dataclass(frozen=True)
class Point:
    """One run of a sweep: the overrides it adds (``--KEY=VALUE``, in order) and the
    version folder it runs in."""

    overrides: tuple[str, ...]
    version: int


def _grid(line: CommandLine) -> list[list[str]]:
    """Each axis of the sweep as its overrides: one list of ``--KEY=VALUE`` per
    ``--grid`` (and one for ``--seeds``)."""
    problems: list[Problem] = []
    axes: list[list[str]] = []
    for spec in line.grid:
        key, equals, values = spec.partition("=")
        if not equals or not key or not values:
            problems.append(
                Problem(
                    "",
                    f"--grid {spec!r}: write --grid KEY=V1,V2, such as "
                    "--grid model.init_args.lr=1e-3,3e-3.",
                )
            )
            continue
        axes.append([f"--{key}={value.strip()}" for value in values.split(",")])
    if line.seeds is not None:
        axes.append([f"--seed_everything={seed.strip()}" for seed in line.seeds.split(",")])
    if not axes:
        problems.append(Problem("", "a sweep needs at least one --grid KEY=V1,V2 or --seeds."))
    if problems:
        raise ConfigError(problems)
    return axes


def plan(line: CommandLine, resolve: Resolve) -> tuple[Path, list[Point]]:
    """The sweep's folder (``root_dir/name``) and its points, each with the next free
    version folder in order; every point's configuration checked in full first (a
    :class:`ConfigError` names the point's overrides)."""
    points: list[tuple[str, ...]] = list(itertools.product(*_grid(line)))
    folder: Path | None = None
    for overrides in points:
        point = _point_line(line, overrides, version=None)
        try:
            resolved, _ = resolve(point)
        except ConfigError as exc:
            at = " ".join(overrides)
            raise ConfigError(
                [Problem(p.path, f"{p.message} (at {at})", p.source) for p in exc.problems]
            ) from None
        root = resolved.trainer.get("root_dir")
        if root is None:
            raise ConfigError(
                [
                    Problem(
                        "trainer.root_dir",
                        "a sweep runs each point in its own version "
                        "folder: give one, such as --trainer.root_dir=runs.",
                    )
                ]
            )
        folder = Path(str(root)) / str(resolved.trainer.get("name", "loopbus_logs"))
    assert folder is not None
    first = _next_version(folder)
    return folder, [Point(overrides, first + i) for i, overrides in enumerate(points)]


def _point_line(line: CommandLine, overrides: Sequence[str], version: int | None) -> CommandLine:
    """``line`` (as ``loopbus fit``) with a point's overrides, and its version."""
    extra = [*overrides, *([] if version is None else [f"--trainer.version={version}"])]
    point = read_command_line("fit", extra)
    return dataclasses.replace(
        line,
        command="fit",
        steps=[*line.steps, *point.steps],
        grid=[],
        seeds=None,
        flags=line.flags - {"dry-run"},
    )


def _next_version(folder: Path) -> int:
    """One more than the highest ``version_N`` in ``folder`` (0 for none)."""
    taken = [
        int(child.name.removeprefix("version_"))
        for child in (folder.iterdir() if folder.is_dir() else ())
        if child.name.startswith("version_") and child.name[8:].isdigit()
    ]
    return max(taken, default=-1) + 1


def _command(line: CommandLine, point: Point) -> str:
    """The ``loopbus fit`` command line that runs ``point``."""
    words = ["loopbus", "fit"]
    for step in line.steps:
        words += ["--config", step[1]] if step[0] == "file" else [step[3]]
    words += [*point.overrides, f"--trainer.version={point.version}"]
    return shlex.join(words)


def _save_spec(folder: Path, line: CommandLine, points: list[Point], dry_run: bool) -> Path:
    import yaml

    spec = {
        "sweep": {"grid": line.grid, "seeds": line.seeds, "dry_run": dry_run},
        "points": [
            {
                "version": p.version,
                "folder": str(folder / f"version_{p.version}"),
                "overrides": list(p.overrides),
                "command": _command(line, p),
            }
            for p in points
        ],
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / time.strftime("sweep-%Y%m%d-%H%M%S.yaml")
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def sweep_main(tokens: Sequence[str], resolve: Resolve, run_stage: RunStage) -> int:
    """``loopbus sweep ARGS...``: 0 when every point ran (or was printed), 2 for a wrong
    command line or configuration (before anything runs), else the first failing
    point's status. ``resolve`` and ``run_stage`` are the configuration commands'."""
    try:
        line = read_command_line("sweep", tokens)
        if line.help:
            sys.stdout.write(SWEEP_HELP)
            return 0
        unknown = line.flags - {"dry-run"}
        if unknown or line.resume is not None:
            raise ConfigError(
                [
                    Problem(
                        "",
                        "loopbus sweep takes --config, --KEY=VALUE, --grid, --seeds and --dry-run.",
                    )
                ]
            )
        folder, points = plan(line, resolve)
    except ConfigError as exc:
        print(f"loopbus sweep: {exc}", file=sys.stderr)
        return 2
    dry_run = "dry-run" in line.flags
    spec = _save_spec(folder, line, points, dry_run)
    print(f"loopbus sweep: {len(points)} point(s); spec in {spec}", file=sys.stderr)
    for point in points:
        if dry_run:
            print(_command(line, point))
            continue
        print(
            f"loopbus sweep: {' '.join(point.overrides)} -> version_{point.version}",
            file=sys.stderr,
        )
        resolved, _ = resolve(_point_line(line, point.overrides, point.version))
        status = run_stage("fit", resolved)
        if status != 0:
            return status
    return 0
