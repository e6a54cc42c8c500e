"""A URL is never taken for a path by accident: every option that takes a local path only
(the loggers' folders) refuses ``s3://``, ``gs://``, ``http://``, ``file://`` and the
like with an error that says what is supported, before anything is written (no local
folder named ``s3:``). Checkpoints on object storage (``Checkpoint``, ``ckpt_path``,
``save_checkpoint``, ``consolidate_checkpoint``) are tested in ``tests/remote``."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import loopbus
from loopbus import MisconfigurationError, Trainer
from loopbus.plugins import CSVLogger, JSONLLogger
from tests.helpers import TinyModule, make_loader

Call = Callable[[str], Any]


def _tensorboard(url: str) -> Any:
    if importlib.util.find_spec("tensorboard") is None:
        pytest.skip("tensorboard is not installed")
    from loopbus.plugins import TensorBoardLogger

    return TensorBoardLogger(url)


def _wandb(url: str) -> Any:
    if importlib.util.find_spec("wandb") is None:
        pytest.skip("wandb is not installed")
    from loopbus.plugins import WandbLogger

    return WandbLogger(project="p", dir=url, mode="offline")


CALLS: dict[str, tuple[Call, str]] = {
    "CSVLogger": (lambda url: CSVLogger(url), r"CSVLogger\(save_dir="),
    "JSONLLogger": (lambda url: JSONLLogger(url), r"JSONLLogger\(save_dir="),
    "TensorBoardLogger": (_tensorboard, r"TensorBoardLogger\(save_dir="),
    "WandbLogger": (_wandb, r"WandbLogger\(dir="),
}


@pytest.mark.parametrize("url", ["s3://bucket/run", "gs://bucket/run", "https://host/run", "file:///tmp/run"])
@pytest.mark.parametrize("what", sorted(CALLS))
def test_a_url_is_refused_naming_the_option_and_what_works(
    what: str, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    call, named = CALLS[what]
    with pytest.raises(MisconfigurationError, match=named) as caught:
        call(url)
    message = str(caught.value)
    assert url in message
    assert "local paths only" in message
    assert f"{url.split('://')[0]}://" in message
    assert os.listdir(tmp_path) == []  # nothing written, no folder named "s3:"


@pytest.mark.parametrize("stage", ["fit", "validate", "test", "predict"])
async def test_a_url_as_ckpt_path_without_its_package_is_refused_before_anything_runs(
    stage: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # File checkpoints on object storage are read from URLs (tests/remote); one whose
    # scheme's package is missing is refused before anything runs.
    from loopbus.storage import _store

    monkeypatch.setattr(_store, "_available", lambda module: module != "s3fs")
    monkeypatch.chdir(tmp_path)
    trainer = Trainer(max_steps=1, plugins=[], device="cpu")
    data = make_loader(32, 16) if stage != "predict" else [b[0] for b in make_loader(32, 16)]
    with pytest.raises(MisconfigurationError, match=r"ckpt_path='s3://bucket/run/last'.*loopbus\[s3\]"):
        await getattr(trainer, stage)(TinyModule(), data, ckpt_path="s3://bucket/run/last")
    assert trainer.global_step == 0
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("path", ["runs/s3:", "C:/runs/one", "s3:/single-slash", "a://"])
def test_paths_that_only_look_like_urls_are_paths(path: str) -> None:
    assert loopbus.check_local_path("dirpath", path) == path
    assert loopbus.check_local_path("dirpath", Path("runs") / "x") == Path("runs") / "x"
