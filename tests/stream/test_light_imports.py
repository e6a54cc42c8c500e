"""The stream client, the server and the ``loopbus`` command never import torch or the
engine (``loopbus watch`` starts fast), and the engine's names load on first use (the
sharded checkpoint's only when read)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import loopbus

HEAVY = "sorted(m for m in sys.modules if m.split('.')[0] == 'torch' or m.startswith(('loopbus.engine', 'loopbus.plugins')))"


def run(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return result.stdout.strip()


@pytest.mark.external
def test_stream_and_cli_import_neither_torch_nor_the_engine() -> None:
    code = f"import loopbus.stream, loopbus.__main__, sys; print({HEAVY})"
    assert run(code) == "[]"
    code = f"import loopbus, sys; loopbus.connect; loopbus.stream.Server; print({HEAVY})"
    assert run(code) == "[]"


@pytest.mark.external
def test_engine_names_load_on_first_use() -> None:
    code = (
        "import loopbus, sys; assert 'torch' not in sys.modules; "
        "from loopbus import Trainer; assert 'torch' in sys.modules; "
        "print(Trainer.__module__, loopbus.plugins.StreamServer.__module__, "
        "[type(p).__name__ for p in Trainer().plugins])"
    )
    assert run(code) == "loopbus loopbus.plugins ['ProgressBar', 'ModelSummary']"


@pytest.mark.external
def test_importing_the_plugins_first_still_names_them_publicly() -> None:
    code = (
        "from loopbus.plugins import EarlyStopping; import loopbus; "
        "print(EarlyStopping.__module__, loopbus.Trainer.__module__)"
    )
    assert run(code) == "loopbus.plugins loopbus"


def test_every_public_name_resolves() -> None:
    for name in loopbus.__all__:
        assert getattr(loopbus, name) is not None, name
    assert set(loopbus.__all__) <= set(dir(loopbus))


@pytest.mark.external
def test_the_sharded_checkpoint_modules_load_on_first_use() -> None:
    """A run without sharded state never imports ``torch.distributed.checkpoint`` (a third
    of the engine's import time): not with the engine, the plugins, a ``Checkpoint`` or a
    trainer; the sharded names load when first read, under their public module."""
    code = (
        "import sys, loopbus, loopbus.plugins; "
        "loopbus.plugins.Checkpoint(dirpath='unused'); loopbus.Trainer(); "
        "before = 'torch.distributed.checkpoint' in sys.modules; "
        "from loopbus import ShardedSave; "
        "from loopbus.checkpoint import ShardedCheckpointWriter; "
        "print(before, 'torch.distributed.checkpoint' in sys.modules, ShardedSave.__module__, "
        "ShardedCheckpointWriter is loopbus.ShardedCheckpointWriter)"
    )
    assert run(code) == "False True loopbus True"
