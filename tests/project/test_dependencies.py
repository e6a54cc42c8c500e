"""The dependency rule: events <- engine <- plugins (see loopbus/__init__.py)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT

SRC = ROOT / "src" / "loopbus"


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


@pytest.mark.external
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


#: The engine's packages: everything the plugins sit on, below the facade.
ENGINE = ("state", "data", "records", "step", "distributed", "checkpoint", "loop", "stage")


def test_engine_never_imports_plugins() -> None:
    checked: dict[str, int] = {}
    for package in ENGINE:
        for path in (SRC / package).rglob("*.py"):
            checked[package] = checked.get(package, 0) + 1
            for name, _ in imports_of(path):
                assert not name.startswith("loopbus.plugins"), (path, name)
    assert sorted(checked) == sorted(ENGINE), checked  # each package has files to check


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


# ---------------------------------------------------------------- the package layers
#: Bottom to top: a module imports only from its own package or those below it, lazy and
#: type-only imports included. The base layer is ``loopbus``'s own private modules.
LAYERS = (
    "base",
    "events",
    "stream",
    "dashboard",
    "state",
    "data",
    "records",
    "step",
    "distributed",
    "storage",
    "checkpoint",
    "loop",
    "stage",
    "plugins",
)

#: The arrows that point up, each with why. A new one fails the test below; one that is
#: gone fails it too, so that this list only shrinks.
UPWARD = {
    # ``Module.load_from_checkpoint`` reads a checkpoint file: a real arrow at run time (a
    # lazy import inside the classmethod), kept because the public classmethod belongs on
    # ``Module`` and reading a checkpoint is the checkpoint package's concern. (``Module.
    # trainer``, ``Loop.trainer`` and the ``Plugin`` hooks are typed with ``TrainerView``,
    # defined in ``step/``, so none of them names the stage's ``Trainer``.)
    ("loopbus.step._module", "checkpoint"): "Module.load_from_checkpoint reads a checkpoint",
}


def _layer(name: str) -> str | None:
    """The layer of the loopbus module ``name``; None for the ``loopbus`` facade itself."""
    parts = name.split(".")
    if parts[0] != "loopbus":
        return None
    if len(parts) == 1:
        return None
    head = parts[1]
    if head.startswith("_"):
        return "base" if head != "__main__" else None
    return head if head in LAYERS else None


def _facade_layer(imported: str) -> str | None:
    """The layer that defines ``loopbus.<name>`` when a module imports it from the facade."""
    import loopbus

    name = imported.split(".", 1)[1] if imported.count(".") == 1 else ""
    package = loopbus._ENGINE_NAMES.get(name)
    if package is not None:
        return package
    if name in ("events", "stream", "plugins"):
        return name
    return "base" if name else None


def test_each_package_imports_only_those_below_it() -> None:
    found: dict[tuple[str, str], str] = {}
    for path in sorted(SRC.rglob("*.py")):
        module = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        source = _layer(module)
        if source is None:
            continue
        bare = any(
            isinstance(node, ast.Import) and any(a.name == "loopbus" for a in node.names)
            for node in ast.walk(ast.parse(path.read_text()))
        )
        if bare and source != "plugins":  # ``import loopbus``: the facade is above all
            found[(module, "loopbus")] = "import loopbus"
        for name, _ in imports_of(path):
            if name == "loopbus" or not name.startswith("loopbus"):
                continue
            target = _layer(name)
            if target is None:  # ``from loopbus import X``: where X is defined
                target = _facade_layer(name)
            if target is None or target == source:
                continue
            if LAYERS.index(target) > LAYERS.index(source):
                found[(module, target)] = name
    unexpected = {k: v for k, v in found.items() if k not in UPWARD}
    assert not unexpected, (
        "these imports point up the layers (module, layer imported: name): "
        f"{unexpected}; import from a lower package, or pass what is needed in"
    )
    gone = sorted(set(UPWARD) - set(found))
    assert not gone, f"these upward imports are gone; remove them from UPWARD: {gone}"
