"""The engine's shape, measured: the figures the training-step issue asks for.

* ``TrainEpochLoop`` in lines (target <= 150), the ``Trainer`` class (<= 500);
* the longest function in ``engine/`` (<= 80 lines);
* the distinct attributes ``_loops.py`` reads of the host a stage gives its loops
  (``host.X`` / ``self.host.X``; target <= 8), and, for information, those it reads of
  the parts the host hands out (the run state, the options, the steps);
* ``object.__setattr__`` on an object other than the one whose method runs (target 0);
* imports of ``_trainer`` from ``_step.py``, ``_loops.py``, ``_records.py``,
  ``_module.py`` and ``_plugin.py``, type-only ones included (target 0); type-only
  imports of the public ``loopbus.Trainer`` name are listed apart.

    python benchmarks/architecture.py        # prints the figures; exit 1 if one is off
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[1] / "src" / "loopbus" / "engine"
NO_TRAINER = ("_step.py", "_loops.py", "_records.py", "_module.py", "_plugin.py")


@dataclass
class Report:
    figures: list[tuple[str, object, object, bool]] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    def add(self, name: str, value: object, target: object, ok: bool) -> None:
        self.figures.append((name, value, target, ok))

    @property
    def ok(self) -> bool:
        return all(ok for *_, ok in self.figures)


def _tree(name: str) -> ast.Module:
    return ast.parse((ENGINE / name).read_text(), filename=name)


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise LookupError(name)


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1  # type: ignore[attr-defined,no-any-return]


def _functions(tree: ast.AST) -> Iterator[ast.FunctionDef | ast.AsyncFunctionDef]:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def _host_reads(tree: ast.Module) -> tuple[set[str], set[str]]:
    """Attributes read of the host (``host.X``, ``self.host.X``) and of what it hands
    out (read through locals named after the host's parts)."""
    host: set[str] = set()
    parts: set[str] = set()
    handed_out = {"state", "options", "step", "source", "sources", "records", "collective"}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        value = node.value
        if isinstance(value, ast.Name) and value.id == "host":
            host.add(node.attr)
        elif (
            isinstance(value, ast.Attribute)
            and value.attr == "host"
            and isinstance(value.value, ast.Name)
            and value.value.id == "self"
        ):
            host.add(node.attr)
        elif isinstance(value, ast.Name) and value.id in handed_out:
            parts.add(f"{value.id}.{node.attr}")
    return host, parts


def _foreign_setattr(tree: ast.Module) -> list[str]:
    """``object.__setattr__(x, ...)`` where ``x`` is not ``self`` (the object whose
    method runs)."""
    return [
        f"line {node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "__setattr__"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "object"
        and node.args
        and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self")
    ]


def _imports(tree: ast.Module) -> Iterator[tuple[int, str, list[str]]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            yield node.lineno, module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []


def measure() -> Report:
    report = Report()
    loops = _tree("_loops.py")
    epoch = _lines(_class(loops, "TrainEpochLoop"))
    report.add("TrainEpochLoop lines", epoch, "<= 150", epoch <= 150)
    trainer = _lines(_class(_tree("_trainer.py"), "Trainer"))
    report.add("Trainer class lines", trainer, "<= 500", trainer <= 500)
    longest = ("", 0)
    for path in sorted(ENGINE.glob("*.py")):
        for fn in _functions(_tree(path.name)):
            if _lines(fn) > longest[1]:
                longest = (f"{path.name}:{fn.name}", _lines(fn))
    report.add(f"longest engine function ({longest[0]})", longest[1], "<= 80", longest[1] <= 80)
    host, parts = _host_reads(loops)
    report.add("distinct host attributes _loops.py reads", len(host), "<= 8", len(host) <= 8)
    report.details.append(f"host attributes read by _loops.py: {sorted(host)}")
    report.details.append(
        f"attributes read of what the host hands out ({len(parts)}): {sorted(parts)}"
    )
    foreign = []
    for path in sorted(ENGINE.glob("*.py")):
        foreign += [f"{path.name} {hit}" for hit in _foreign_setattr(_tree(path.name))]
    report.add("object.__setattr__ on another object", len(foreign), "0", not foreign)
    report.details += foreign
    trainer_imports = []
    for name in NO_TRAINER:
        for line, module, names in _imports(_tree(name)):
            if module.endswith("_trainer"):
                trainer_imports.append(f"{name}:{line} imports {module}")
            elif module in ("loopbus", "..") and "Trainer" in names:
                report.details.append(
                    f"{name}:{line} names the public type loopbus.Trainer (type-only) for "
                    "its public signatures"
                )
    report.add(
        f"imports of _trainer from {', '.join(NO_TRAINER)}",
        len(trainer_imports),
        "0",
        not trainer_imports,
    )
    report.details += trainer_imports
    return report


def main() -> int:
    report = measure()
    for name, value, target, ok in report.figures:
        print(f"{'ok ' if ok else 'OFF'}  {name}: {value} (target {target})")
    for line in report.details:
        print(f"     {line}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
