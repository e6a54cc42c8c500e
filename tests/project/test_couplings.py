"""The couplings figures that are at their targets stay there (benchmarks/couplings.py):
no file reads another class's private attributes, and no private module name is used by
two packages. The figures still above their targets are reported by the script itself."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers import load_benchmark


@pytest.fixture(scope="module")
def couplings() -> ModuleType:
    return load_benchmark("couplings")


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
