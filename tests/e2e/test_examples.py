"""The examples a newcomer runs first must keep working."""

from __future__ import annotations

import runpy
import sys

import pytest
import torch

from tests.helpers import ROOT

EXAMPLES = ROOT / "examples"


@pytest.fixture
def example_path() -> object:
    sys.path.insert(0, str(EXAMPLES))
    yield
    sys.path.remove(str(EXAMPLES))


def test_custom_loop_example(capsys: pytest.CaptureFixture[str]) -> None:
    namespace = runpy.run_path(str(EXAMPLES / "custom_loop.py"))
    import anyio

    result = anyio.run(namespace["main"])
    assert torch.allclose(result, torch.tensor([1.0, -2.0]), atol=1e-3)
    out = capsys.readouterr().out
    assert "iteration  10" in out
    assert "minimum at [1.0, -2.0]" in out


def test_digits_demo_reaches_95_percent(example_path: object) -> None:
    import digits

    accuracy = digits.main(["--epochs", "30"])
    assert accuracy >= 0.95


@pytest.mark.external
def test_digits_demo_compiled(example_path: object) -> None:
    import digits
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    # Compiled steps (training, validation with its other batch size) and the AdamW
    # step with its tensor learning rate under the cosine schedule: no warning that
    # the optimizer stays eager (warnings are errors here), and it learns as in eager.
    accuracy = digits.main(["--epochs", "15", "--compile"])
    assert accuracy >= 0.9
    assert counters["stats"]["unique_graphs"] >= 3
    torch._dynamo.reset()
