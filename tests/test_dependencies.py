"""The dependency rule: events <- engine <- plugins (see loopbus/__init__.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "loopbus"


def imports_of(path: Path) -> list[tuple[str, int]]:
    """Absolute names imported by ``path`` (relative imports resolved), with levels."""
    package = ".".join(path.relative_to(SRC.parent).with_suffix("").parts[:-1])
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(alias.name, 0) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                name = ".".join([*base, node.module] if node.module else base)
            else:
                name = node.module or ""
            out.append((name, node.level))
            out += [(f"{name}.{alias.name}", node.level) for alias in node.names]
    return out


def test_events_import_neither_torch_nor_the_engine() -> None:
    for path in (SRC / "events").rglob("*.py"):
        for name, _ in imports_of(path):
            assert not name.startswith(("torch", "loopbus.engine", "loopbus.plugins")), (path, name)
    # Importing loopbus.events imports the package __init__, which loads everything; so
    # load the events package on its own, the way a consumer of messages would.
    code = (
        "import importlib.util, sys, pathlib;"
        f"root = pathlib.Path({str(SRC)!r});"
        "spec = importlib.util.spec_from_file_location('loopbus', root / '__init__.py', submodule_search_locations=[str(root)]);"
        "pkg = importlib.util.module_from_spec(spec); sys.modules['loopbus'] = pkg;"
        "import loopbus.events;"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(('loopbus.engine', 'loopbus.plugins'))))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_engine_never_imports_plugins() -> None:
    for path in (SRC / "engine").rglob("*.py"):
        for name, _ in imports_of(path):
            assert not name.startswith("loopbus.plugins"), (path, name)


def test_plugins_import_only_public_names() -> None:
    public = {"loopbus", "loopbus.events", "loopbus.plugins"}
    for path in (SRC / "plugins").rglob("*.py"):
        for name, _level in imports_of(path):
            if not name.startswith("loopbus"):
                continue
            parts = name.split(".")
            # loopbus.X / loopbus.events.X (a public name) or a sibling plugin module
            if name.startswith("loopbus.plugins"):
                continue
            assert not any(p.startswith("_") for p in parts[1:2]), (path, name)
            assert not name.startswith("loopbus.engine"), (path, name)
            assert ".".join(parts[:2]) in public or parts[:1] == ["loopbus"], (path, name)
            if name.startswith("loopbus.events."):
                assert not parts[2].startswith("_"), (path, name)
