"""Test configuration: every async test runs on asyncio (debug mode) and trio, and the
scope leak check is on for every trainer the tests build."""

from __future__ import annotations

import os

os.environ.setdefault("LOOPBUS_LEAK_CHECK", "raise")

import pytest
import torch

# The tests use tiny models: one intra-op thread is fastest and stays fast on a busy
# machine (a pool of spinning threads fighting for two cores is not).
torch.set_num_threads(1)


@pytest.fixture(
    params=[
        pytest.param(("asyncio", {"debug": True}), id="asyncio"),
        pytest.param(("trio", {}), id="trio"),
    ]
)
def anyio_backend(request: pytest.FixtureRequest) -> tuple[str, dict[str, object]]:
    return request.param  # type: ignore[no-any-return]
