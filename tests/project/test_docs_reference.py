"""docs/reference.md describes every public name and every plugin (and Trainer) option."""

from __future__ import annotations

import inspect
import re
from types import ModuleType

import pytest

import loopbus
import loopbus.cli
import loopbus.dashboard
import loopbus.events
import loopbus.plugins
import loopbus.plugins.tuning
import loopbus.stream
from tests.helpers import ROOT

DOC = ROOT / "docs" / "reference.md"
PACKAGES: tuple[ModuleType, ...] = (
    loopbus,
    loopbus.plugins,
    loopbus.plugins.tuning,
    loopbus.events,
    loopbus.stream,
    loopbus.dashboard,
    loopbus.cli,
)
HEADING = re.compile(r"^(#{2,6}) (.*)$", re.M)
CODE = re.compile(r"`([^`]+)`")


def sections() -> dict[str, str]:
    """Qualified name in a heading -> the text of its entry (up to the next heading)."""
    text = DOC.read_text(encoding="utf-8")
    headings = list(HEADING.finditer(text))
    out: dict[str, str] = {}
    for i, heading in enumerate(headings):
        end = headings[i + 1].start() if i + 1 < len(headings) else len(text)
        body = text[heading.end() : end]
        for name in CODE.findall(heading.group(2)):
            out[name] = body
    return out


def public_names() -> list[str]:
    return [f"{package.__name__}.{name}" for package in PACKAGES for name in package.__all__]


def constructor_options(cls: type) -> list[str]:
    parameters = inspect.signature(cls).parameters.values()
    return [
        p.name
        for p in parameters
        if p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]


def documented_plugins() -> list[str]:
    return [
        f"loopbus.plugins.{name}"
        for name in loopbus.plugins.__all__
        if isinstance(getattr(loopbus.plugins, name), type)
        and issubclass(getattr(loopbus.plugins, name), loopbus.Plugin)
    ]


def test_every_public_name_has_a_heading() -> None:
    entries = sections()
    missing = [name for name in public_names() if name not in entries]
    assert not missing, (
        f"docs/reference.md has no heading for {missing}; add a '### `<name>`' entry "
        "with its signature, a description and a link to the longer doc."
    )


def test_every_entry_is_a_public_name() -> None:
    """No entry for a name that is gone (renamed or removed)."""
    known = set(public_names())
    stale = [name for name in sections() if name.startswith("loopbus.") and name not in known]
    assert not stale, f"docs/reference.md describes names that are not exported: {stale}"


def test_every_entry_has_a_signature_and_a_link() -> None:
    for name, body in sections().items():
        if not name.startswith("loopbus."):
            continue
        assert "```python" in body, f"the entry of {name} shows no signature"
        assert re.search(r"\]\([a-z]+\.md(#[a-z0-9-]+)?\)", body) or name.endswith("__version__"), (
            f"the entry of {name} links to no longer doc"
        )


@pytest.mark.parametrize("name", [*documented_plugins(), "loopbus.Trainer"])
def test_every_constructor_option_is_listed(name: str) -> None:
    module_name, _, attr = name.rpartition(".")
    cls = getattr(next(p for p in PACKAGES if p.__name__ == module_name), attr)
    body = sections()[name]
    rows = set(re.findall(r"^\| `([A-Za-z_][A-Za-z0-9_]*)` \|", body, re.M))
    options = constructor_options(cls)
    assert options, f"{name} has no options to check"
    missing = [option for option in options if option not in rows]
    assert not missing, (
        f"the entry of {name} in docs/reference.md lists no option {missing}; add a "
        "'| `option` | default | meaning |' row for each."
    )
    unknown = sorted(rows - set(options))
    assert not unknown, f"the entry of {name} lists options it does not take: {unknown}"


def test_the_readme_links_the_reference() -> None:
    readme = (DOC.parents[1] / "README.md").read_text(encoding="utf-8")
    assert "(docs/reference.md)" in readme
