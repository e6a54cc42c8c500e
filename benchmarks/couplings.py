"""The couplings that make a change touch many places, counted in ``src/loopbus``.

The figures the "fewer places to change" issue asks for, beside ``architecture.py
--layout``:

* **storage branches outside ``storage/``**: calls of ``is_url(...)`` and
  ``isinstance(..., RemotePath)`` in the other packages (target 0): a verb that asks
  whether it runs on a URL or a path keeps a local and a remote twin;
* **the widest internal signature**: the parameters (``self``/``cls`` not counted) of the
  functions and methods that are not public API, in the engine's packages (target <= 6).
  Public API is what a package's ``__all__`` names: its functions, and its classes'
  methods (``Trainer(...)`` takes its options as keywords by design);
* **files that read another class's private attributes**: ``x._name`` where ``x`` is not
  ``self``/``cls``/``super()``, not a module, and ``_name`` is not an attribute or method
  of a class defined in the same module (a leading underscore is private to its module:
  a class and the functions beside it that build or inspect it are one owner), nor
  namedtuple's ``_replace``/``_asdict`` family, nor ``_metadata`` (the attribute torch's
  ``state_dict()`` format keeps its versions in, on the dict itself) (target 0);
* **module names used twice**: a private module name (``_name.py``) that two packages
  both use, so a path in a message or a traceback does not say which one (target 0).

    python benchmarks/couplings.py          # prints the figures and where they come from
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "loopbus"
ENGINE = (
    "state", "data", "records", "step", "distributed", "checkpoint", "loop", "stage",
    "storage", "events",
)
#: Underscore names that are another library's public protocol, not a private attribute.
_PROTOCOLS = {"_replace", "_asdict", "_fields", "_make", "_field_defaults", "_metadata"}


def _modules(src: Path) -> dict[str, ast.Module]:
    return {
        p.relative_to(src).as_posix(): ast.parse(p.read_text(), filename=str(p))
        for p in sorted(src.rglob("*.py"))
    }


def storage_branches(trees: dict[str, ast.Module]) -> list[str]:
    """``file:line`` of each ``is_url(...)`` / ``isinstance(..., RemotePath)`` outside
    ``storage/``."""
    found = []
    for name, tree in trees.items():
        if name.startswith("storage/"):
            continue
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            if node.func.id == "is_url" or (
                node.func.id == "isinstance"
                and len(node.args) == 2
                and "RemotePath" in ast.unparse(node.args[1])
            ):
                found.append(f"{name}:{node.lineno}")
    return found


def _public(trees: dict[str, ast.Module]) -> set[str]:
    """The names some package's ``__all__`` lists."""
    names: set[str] = set()
    for name, tree in trees.items():
        if not name.endswith("__init__.py"):
            continue
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                names |= set(ast.literal_eval(node.value))
    return names


def widest(trees: dict[str, ast.Module]) -> list[tuple[int, str]]:
    """(parameters, ``file:line name``) of the engine's internal functions, widest first."""
    public = _public(trees)
    rows = []

    def visit(node: ast.AST, where: str, owner: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, where, child.name)
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                exposed = owner if owner is not None else child.name
                if exposed not in public:
                    a = child.args
                    count = sum(
                        p.arg not in ("self", "cls") for p in a.posonlyargs + a.args + a.kwonlyargs
                    )
                    label = f"{owner}.{child.name}" if owner else child.name
                    rows.append((count, f"{where}:{child.lineno} {label}"))
                visit(child, where, None)
            else:
                visit(child, where, owner)

    for name, tree in trees.items():
        if name.split("/")[0] in ENGINE:
            visit(tree, name, None)
    return sorted(rows, reverse=True)


def _own(cls: ast.ClassDef) -> set[str]:
    """What a class defines: its methods, class attributes and ``self.x`` attributes."""
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in ("self", "cls"):
                names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def private_reads(trees: dict[str, ast.Module]) -> dict[str, list[str]]:
    """file -> ``line:expression`` of each read of another class's private attribute."""
    found: dict[str, list[str]] = {}
    for name, tree in trees.items():
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported |= {(a.asname or a.name).split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported |= {a.asname or a.name for a in node.names}

        own = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                own |= _own(node)
        for node in ast.walk(tree):
            if _foreign(node, own, imported):
                found.setdefault(name, []).append(f"{node.lineno}:{ast.unparse(node)}")
    return found


def _foreign(node: ast.AST, own: set[str], imported: set[str]) -> bool:
    if not isinstance(node, ast.Attribute):
        return False
    attr = node.attr
    if not attr.startswith("_") or attr.endswith("__") or attr in _PROTOCOLS or attr in own:
        return False
    value, root = node.value, node.value
    while isinstance(root, ast.Attribute):
        root = root.value
    if isinstance(value, ast.Name) and value.id in ("self", "cls"):
        return False
    if isinstance(value, ast.Call) and ast.unparse(value.func) == "super":
        return False
    return not (isinstance(root, ast.Name) and root.id in imported)


def repeated_names(src: Path) -> dict[str, list[str]]:
    """Private module names (``_x.py``) found in more than one package folder."""
    seen: dict[str, list[str]] = {}
    for path in sorted(src.rglob("_*.py")):
        if path.name != "__init__.py" and "__pycache__" not in path.parts:
            seen.setdefault(path.name, []).append(str(path.relative_to(src)))
    return {name: paths for name, paths in seen.items() if len(paths) > 1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--src", type=Path, default=SRC, help="the loopbus package folder")
    args = parser.parse_args(argv)
    trees = _modules(args.src)
    branches = storage_branches(trees)
    rows = widest(trees)
    reads = private_reads(trees)
    twice = repeated_names(args.src)
    figures = [
        ("is_url / RemotePath tests outside storage/", len(branches), "0", not branches),
        ("widest internal signature in the engine", rows[0][0], "<= 6", rows[0][0] <= 6),
        ("files that read another class's private attributes", len(reads), "0", not reads),
        ("module names used twice", len(twice), "0", not twice),
    ]
    for label, value, target, ok in figures:
        print(f"{'ok ' if ok else 'OFF'}  {label}: {value} (target {target})")
    print("     storage branches: " + (", ".join(branches) or "none"))
    print("     signatures over 6: " + ", ".join(f"{w} {n}" for n, w in rows if n > 6))
    for name, lines in reads.items():
        print(f"     {name}: {', '.join(lines)}")
    for name, paths in twice.items():
        print(f"     {name}: {', '.join(paths)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
