"""The couplings figures stay at their targets (benchmarks/couplings.py): no code outside
``storage/`` asks whether a location is a URL, no engine signature is wider than six
parameters, no file reads another class's private attributes, and no private module name
is used by two packages."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def couplings() -> ModuleType:
    return load_benchmark("couplings")


def test_no_code_outside_storage_asks_whether_a_location_is_a_url(couplings: ModuleType) -> None:
    assert couplings.storage_branches(couplings._modules(couplings.SRC)) == []


def test_no_engine_signature_is_wider_than_six(couplings: ModuleType) -> None:
    wide = [(n, where) for n, where in couplings.widest(couplings._modules(couplings.SRC)) if n > 6]
    assert wide == []


def test_no_file_reads_another_class_private_attributes(couplings: ModuleType) -> None:
    trees = couplings._modules(couplings.SRC)
    assert couplings.private_reads(trees) == {}


def test_no_module_name_is_used_by_two_packages(couplings: ModuleType) -> None:
    assert couplings.repeated_names(couplings.SRC) == {}


def test_a_repeated_module_name_is_found(couplings: ModuleType, tmp_path: Path) -> None:
    for package in ("one", "two"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
        (tmp_path / package / "_options.py").write_text("")
    (tmp_path / "two" / "_other.py").write_text("")
    assert couplings.repeated_names(tmp_path) == {
        "_options.py": ["one/_options.py", "two/_options.py"]
    }
