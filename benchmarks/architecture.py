"""The engine's shape, measured: the figures the training-step issue asks for.

* ``TrainEpochLoop`` in lines (target <= 150), the ``Trainer`` class (<= 500);
* the longest function in the engine's packages (<= 80 lines);
* the distinct attributes ``_loops.py`` reads of the host a stage gives its loops
  (``host.X`` / ``self.host.X``; target <= 8), and, for information, those it reads of
  the parts the host hands out (the run state, the options, the steps);
* ``object.__setattr__`` on an object other than the one whose method runs (target 0);
* imports of ``_trainer`` from ``_step.py``, ``_loops.py``, ``_records.py``,
  ``_module.py`` and ``_plugin.py``, type-only ones included (target 0); type-only
  imports of the public ``loopbus.Trainer`` name are listed apart.

A second report, ``layout``, measures the whole of ``src/loopbus`` against the layout
issue's targets (the engine split into packages by concern):

* modules per package folder (target <= 12), the longest module (<= 700 lines), the
  longest class (<= 400) and the longest function (<= 60), named by file and line;
* import cycles among loopbus modules, type-only imports (``if TYPE_CHECKING:``) and
  imports deferred into functions counted: the strongly connected components of the
  import graph (Tarjan), with their sizes (target: none);
* the modules that import the trainer's module (``stage/_trainer.py``), type-only
  imports counted (target <= 3);
* the packages whose docstring does not state their concern and what they may import
  (target: none).

An import is an arrow to the module it names: ``from . import x`` and ``from .. import x``
to the submodule ``x`` when there is one, relative imports resolved against the importing
module's package, ``importlib.import_module("literal", __name__)`` as a deferred import.
A name imported from a package's ``__init__`` that only re-exports it (``from loopbus
import Trainer``) is an arrow to the module that defines it: the facades re-export by
design (plugins import public names), and what a cycle means is modules that need each
other. The report also prints, for information, the cycles of the literal graph (arrows to
the facades themselves) and those left without the type-only imports.

    python benchmarks/architecture.py        # prints the figures; exit 1 if one is off
    python benchmarks/architecture.py --layout   # and the layout report; both count
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "loopbus"
#: The packages that were ``engine/`` before the layout redesign.
ENGINE_PACKAGES = ("state", "data", "records", "step", "distributed", "checkpoint", "loop", "stage")
NO_TRAINER = (
    "step/_step.py", "loop/_loops.py", "records/_records.py", "step/_module.py", "stage/_plugin.py"
)


@dataclass
class Report:
    figures: list[tuple[str, object, object, bool]] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    def add(self, name: str, value: object, target: object, ok: bool) -> None:
        self.figures.append((name, value, target, ok))

    @property
    def ok(self) -> bool:
        return all(ok for *_, ok in self.figures)


def _tree(name: str, src: Path = SRC) -> ast.Module:
    return ast.parse((src / name).read_text(), filename=name)


def _engine_modules(src: Path) -> list[str]:
    return [
        path.relative_to(src).as_posix()
        for package in ENGINE_PACKAGES
        for path in sorted((src / package).glob("*.py"))
    ]


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


def measure(src: Path = SRC) -> Report:
    report = Report()
    loops = _tree("loop/_loops.py", src)
    epoch = _lines(_class(loops, "TrainEpochLoop"))
    report.add("TrainEpochLoop lines", epoch, "<= 150", epoch <= 150)
    trainer = _lines(_class(_tree("stage/_trainer.py", src), "Trainer"))
    report.add("Trainer class lines", trainer, "<= 500", trainer <= 500)
    longest = ("", 0)
    for name in _engine_modules(src):
        for fn in _functions(_tree(name, src)):
            if _lines(fn) > longest[1]:
                longest = (f"{name}:{fn.name}", _lines(fn))
    report.add(f"longest engine function ({longest[0]})", longest[1], "<= 80", longest[1] <= 80)
    host, parts = _host_reads(loops)
    report.add("distinct host attributes _loops.py reads", len(host), "<= 8", len(host) <= 8)
    report.details.append(f"host attributes read by _loops.py: {sorted(host)}")
    report.details.append(
        f"attributes read of what the host hands out ({len(parts)}): {sorted(parts)}"
    )
    foreign = []
    for name in _engine_modules(src):
        foreign += [f"{name} {hit}" for hit in _foreign_setattr(_tree(name, src))]
    report.add("object.__setattr__ on another object", len(foreign), "0", not foreign)
    report.details += foreign
    trainer_imports = []
    for name in NO_TRAINER:
        for line, module, names in _imports(_tree(name, src)):
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


# ---------------------------------------------------------------- the layout report
TRAINER = "loopbus.stage._trainer"


@dataclass
class Source:
    """One module of the tree: its dotted name, file, parsed tree and what it binds."""

    name: str
    path: Path
    is_package: bool
    tree: ast.Module
    lines: int
    defined: set[str] = field(default_factory=set)
    #: names bound by ``from X import a as b`` outside functions: b -> (X resolved, a)
    bindings: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def package(self) -> str:
        return self.name if self.is_package else self.name.rpartition(".")[0]


@dataclass(frozen=True)
class Arrow:
    """One import: ``source`` imports ``target`` at ``line``; ``kind`` is ``runtime``,
    ``deferred`` (inside a function) or ``type-only`` (under ``if TYPE_CHECKING:``)."""

    source: str
    target: str
    line: int
    kind: str


def modules(root: Path, package: str) -> dict[str, Source]:
    """Every ``.py`` file under ``root`` (the folder of the package ``package``)."""
    found: dict[str, Source] = {}
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        name = ".".join([package, *parts])
        text = path.read_text(encoding="utf-8")
        tree = ast.parse(text, filename=str(path))
        found[name] = Source(name, path, is_package, tree, len(text.splitlines()))
    for source in found.values():
        _bind(source)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(
    body: list[ast.stmt], type_only: bool = False, deferred: bool = False
) -> Iterator[tuple[ast.AST, bool, bool]]:
    """Every node under ``body`` with whether it sits under ``if TYPE_CHECKING:`` and
    whether it sits inside a function."""
    for node in body:
        yield node, type_only, deferred
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _statements(node.body, True, deferred)
            yield from _statements(node.orelse, type_only, deferred)
            continue
        inner = deferred or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                yield from _statements([child], type_only, inner)
            else:
                for sub in ast.walk(child):
                    yield sub, type_only, inner


def _base(source: Source, level: int, module: str | None) -> str:
    """The absolute module ``from <level dots><module> import ...`` names in ``source``."""
    if not level:
        return module or ""
    parts = source.package.split(".")
    if level > 1:
        parts = parts[: len(parts) - (level - 1)]
    return ".".join([*parts, module] if module else parts)


def _known(name: str, found: dict[str, Source]) -> str | None:
    """``name`` or its longest prefix that is a module of the tree (None: outside it)."""
    while name:
        if name in found:
            return name
        name = name.rpartition(".")[0]
    return None


def _bind(source: Source) -> None:
    for node in source.tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            source.defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            source.defined |= {t.id for t in targets if isinstance(t, ast.Name)}
    for statement, _, deferred in _statements(source.tree.body):
        if isinstance(statement, ast.ImportFrom) and not deferred:
            base = _base(source, statement.level, statement.module)
            for alias in statement.names:
                if alias.name != "*":
                    source.bindings[alias.asname or alias.name] = (base, alias.name)


def _defining(module: str, name: str, found: dict[str, Source], seen: set[str]) -> str:
    """The module that defines ``name`` imported from ``module``: a submodule of that
    name, or, through a package that only re-exports it, the module it comes from."""
    sub = f"{module}.{name}"
    if sub in found:
        return sub
    source = found[module]
    if source.is_package and name not in source.defined and name in source.bindings:
        base, original = source.bindings[name]
        known = _known(base, found)
        if known is not None and f"{module}:{name}" not in seen:
            seen.add(f"{module}:{name}")
            return _defining(known, original, found, seen) if known == base else known
    return module


def arrows(found: dict[str, Source], through_facades: bool = True) -> list[Arrow]:
    """Every import between modules of the tree. With ``through_facades``, a name taken
    from a package that re-exports it is an arrow to the module that defines it;
    without, an arrow to the package (the literal graph)."""
    out: list[Arrow] = []
    for source in found.values():
        for node, type_only, deferred in _statements(source.tree.body):
            kind = "type-only" if type_only else "deferred" if deferred else "runtime"
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [_known(alias.name, found) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _base(source, node.level, node.module)
                known = _known(base, found)
                if known is None:
                    continue
                for alias in node.names:
                    if known != base or alias.name == "*":
                        targets.append(known)
                    elif through_facades:
                        targets.append(_defining(known, alias.name, found, set()))
                    else:
                        sub = f"{known}.{alias.name}"
                        targets.append(sub if sub in found else known)
            elif isinstance(node, ast.Call) and _is_import_module(node):
                literal = node.args[0].value  # type: ignore[attr-defined]
                level = len(literal) - len(literal.lstrip("."))
                targets = [_known(_base(source, level, literal[level:] or None), found)]
            out += [
                Arrow(source.name, target, node.lineno, kind)  # type: ignore[attr-defined]
                for target in targets
                if target is not None and target != source.name
            ]
    return out


def _is_import_module(node: ast.Call) -> bool:
    func = node.func
    named = (isinstance(func, ast.Attribute) and func.attr == "import_module") or (
        isinstance(func, ast.Name) and func.id == "import_module"
    )
    return (
        named
        and bool(node.args)
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    )


def graph(found: dict[str, Source], edges: list[Arrow]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {name: set() for name in found}
    for arrow in edges:
        out[arrow.source].add(arrow.target)
    return out


def strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components (iterative), each sorted, largest first."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return sorted(components, key=lambda c: (-len(c), c))


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The components that are cycles: more than one module, or one importing itself."""
    return [c for c in strongly_connected(edges) if len(c) > 1 or c[0] in edges[c[0]]]


def _qualified(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, ast.AST]]:
    """Classes and functions with their dotted names (``Class.method``, ``f.inner``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from _qualified(node, f"{name}.")
        else:
            yield from _qualified(node, prefix)


def longest(found: dict[str, Source], root: Path, kind: type | tuple[type, ...]) -> tuple[str, int]:
    """The longest class or function (by ``kind``), as ``file:line Name`` and lines,
    counted from its ``class``/``def`` line to its last line."""
    best = ("", 0)
    for source in found.values():
        for name, node in _qualified(source.tree):
            if isinstance(node, kind) and _lines(node) > best[1]:
                where = source.path.relative_to(root).as_posix()
                best = (f"{where}:{node.lineno} {name}", _lines(node))  # type: ignore[attr-defined]
    return best


def states_concern(doc: str | None) -> bool:
    """A package docstring states its concern: a first line of at least three words,
    and it says what the package may import (STYLE.md: "a docstring that says its
    concern and what it may import")."""
    if not doc:
        return False
    return len(doc.strip().splitlines()[0].split()) >= 3 and "import" in doc.lower()


def _short(name: str, package: str) -> str:
    return name[len(package) + 1 :] if name.startswith(f"{package}.") else name


def measure_layout(
    root: Path = SRC, package: str = "loopbus", trainer: str = TRAINER
) -> Report:
    report = Report()
    found = modules(root, package)
    folders: dict[str, int] = {}
    for source in found.values():
        folders[source.package] = folders.get(source.package, 0) + 1
    widest = max(folders, key=lambda k: (folders[k], k))
    report.add(
        f"most modules in one package folder ({widest})", folders[widest], "<= 12",
        folders[widest] <= 12,
    )
    report.details.append(
        "modules per package folder: "
        + ", ".join(f"{k} {v}" for k, v in sorted(folders.items(), key=lambda kv: -kv[1]))
    )
    biggest = max(found.values(), key=lambda s: (s.lines, s.name))
    where = biggest.path.relative_to(root).as_posix()
    report.add(f"longest module ({where})", biggest.lines, "<= 700", biggest.lines <= 700)
    over = sorted((s for s in found.values() if s.lines > 700), key=lambda s: -s.lines)
    if over:
        report.details.append(
            "modules over 700 lines: "
            + ", ".join(f"{s.path.relative_to(root).as_posix()} {s.lines}" for s in over)
        )
    name, lines = longest(found, root, ast.ClassDef)
    report.add(f"longest class ({name})", lines, "<= 400", lines <= 400)
    name, lines = longest(found, root, (ast.FunctionDef, ast.AsyncFunctionDef))
    report.add(f"longest function ({name})", lines, "<= 60", lines <= 60)
    long_functions = sum(
        1
        for source in found.values()
        for _, node in _qualified(source.tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _lines(node) > 60
    )
    report.details.append(f"functions over 60 lines: {long_functions}")

    edges = arrows(found)
    found_cycles = cycles(graph(found, edges))
    in_cycles = sum(len(c) for c in found_cycles)
    report.add(
        "modules in import cycles, type-only imports counted", in_cycles, "0", not in_cycles
    )
    for component in found_cycles:
        by_package: dict[str, int] = {}
        for member in component:
            key = found[member].package
            by_package[key] = by_package.get(key, 0) + 1
        report.details.append(
            f"cycle of {len(component)} ("
            + ", ".join(f"{n} in {k}" for k, n in sorted(by_package.items()))
            + "): "
            + " ".join(_short(m, package) for m in component)
        )
    runtime = cycles(graph(found, [a for a in edges if a.kind != "type-only"]))
    report.details.append(
        "without the type-only imports: "
        + (", ".join(f"a cycle of {len(c)}" for c in runtime) or "no cycle")
    )
    literal_edges = arrows(found, through_facades=False)
    literal = graph(found, literal_edges)
    report.details.append(
        "literal graph (arrows to the re-exporting packages themselves): "
        + (", ".join(f"a cycle of {len(c)}" for c in cycles(literal)) or "no cycle")
    )
    for pkg in sorted(n for n, s in found.items() if s.is_package):
        members = {n for n, s in found.items() if s.package == pkg}
        inside = {n: literal[n] & members for n in members}
        pairs = sum(len(targets) for targets in inside.values())
        largest = max((len(c) for c in cycles(inside)), default=0)
        report.details.append(
            f"{pkg} (literal graph, its __init__ included): {len(members)} modules, "
            f"{pairs} import arrows between them, largest cycle among them {largest}"
        )

    importers = sorted({(a.source, a.line, a.kind) for a in edges if a.target == trainer})
    names = sorted({source for source, *_ in importers})
    report.add(
        f"modules that import {_short(trainer, package)}, type-only imports counted",
        len(names), "<= 3", len(names) <= 3,
    )
    report.details.append(
        f"importers of {_short(trainer, package)}: "
        + ", ".join(f"{_short(s, package)}:{line} ({kind})" for s, line, kind in importers)
    )
    direct = sorted({a.source for a in literal_edges if a.target == trainer})
    report.details.append(
        f"of them, naming {_short(trainer, package)} itself (not a re-exported name): "
        + (", ".join(_short(s, package) for s in direct) or "none")
    )

    lacking = sorted(
        n for n, s in found.items() if s.is_package and not states_concern(ast.get_docstring(s.tree))
    )
    report.add(
        "packages whose docstring does not state their concern", len(lacking), "0", not lacking
    )
    report.details += [f"no concern stated: {n}" for n in lacking]
    return report


def _print(title: str, report: Report) -> None:
    print(title)
    for name, value, target, ok in report.figures:
        print(f"{'ok ' if ok else 'OFF'}  {name}: {value} (target {target})")
    for line in report.details:
        print(f"     {line}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layout", action="store_true",
        help="also print the layout report; its targets then count for the exit status",
    )
    parser.add_argument(
        "--src", type=Path, default=SRC,
        help="the loopbus package folder to measure (default: this checkout's src/loopbus)",
    )
    args = parser.parse_args(argv)
    report = measure(args.src)
    _print("training step", report)
    ok = report.ok
    if args.layout:
        layout = measure_layout(args.src)
        print()
        _print("layout", layout)
        ok = ok and layout.ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
