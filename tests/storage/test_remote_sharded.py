"""Sharded checkpoints in an object store, in one process, against the S3 server
(conftest.py): ``Checkpoint("s3://...", sharded=True)`` writes each checkpoint under a
prefix of its own (DCP's shards, ``loopbus_state.pt``, the marker last), resumes
exactly, keeps what it keeps and nothing more; a prefix whose marker is missing or does
not match its objects is never taken; a failed write is reported and never named
last; the shards load, consolidate (to a file or to the store), and the CLI reads
them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from loopbus import CheckpointError, Plugin, RemotePath, Trainer
from loopbus.plugins import Checkpoint
from loopbus.storage import _store
from tests.helpers import ROOT, TinyModule, make_loader

from .conftest import S3, SECRET, make_bucket, options_for
from .test_remote_checkpoint import Outage, own_server  # noqa: F401  (a fixture)

PER_EPOCH = 4  # make_loader(64, 16)
SHARDED = {".metadata", "__0_0.distcp", "loopbus_state.pt", "loopbus.complete"}


async def _fit(
    epochs: int, plugins: list[Plugin], ckpt_path: Any = None
) -> tuple[Trainer, TinyModule]:
    loopbus.seed_everything(3)
    module = TinyModule()
    trainer = Trainer(max_epochs=epochs, plugins=plugins, device="cpu")
    await trainer.fit(module, make_loader(64, 16), ckpt_path=ckpt_path)
    return trainer, module


def _sharded(s3: S3, **options: Any) -> Checkpoint:
    return Checkpoint(s3.url, storage_options=s3.options, sharded=True, **options)


async def test_a_remote_sharded_run_resumed_from_last_ends_bit_identical(s3: S3) -> None:
    _, straight = await _fit(4, [])
    await _fit(2, [_sharded(s3, every_n_epochs=1)])
    assert s3.grouped() == {"epoch=1-step=8.ckpt": SHARDED, "last.json": {""}}
    last = loopbus.latest_checkpoint(RemotePath(s3.url, s3.options))
    assert str(last) == f"{s3.url}/epoch=1-step=8.ckpt"
    assert loopbus.is_sharded_checkpoint(last)
    info = loopbus.checkpoint_info(last)
    assert info is not None
    assert (info["layout"], info["global_step"], info["world_size"]) == ("sharded", 8, 1)
    assert set(info["files"]) == SHARDED - {"loopbus.complete"}
    assert info["files"][".metadata"] == s3.fs.size(f"{s3.bucket}/run/epoch=1-step=8.ckpt/.metadata")

    trainer, resumed = await _fit(4, [_sharded(s3, every_n_epochs=1)], ckpt_path="last")
    assert trainer.global_step == 4 * PER_EPOCH
    for name, tensor in straight.state_dict().items():
        assert torch.equal(resumed.state_dict()[name], tensor), name


async def test_keep_last_two_over_ten_sharded_saves_leaves_no_orphans_nor_secrets(s3: S3) -> None:
    checkpoint = _sharded(s3, every_n_steps=2, keep_last=2, save_on_end=False)
    await _fit(5, [checkpoint])
    assert s3.grouped() == {
        "epoch=4-step=18.ckpt": SHARDED,
        "epoch=4-step=20.ckpt": SHARDED,
        "last.json": {""},
    }
    # The storage options' secret is in no object (DCP's index names the URL only).
    fs = s3.fs
    for key in fs.find(s3.bucket):
        assert SECRET.encode() not in fs.cat_file(key), key


async def test_an_incomplete_sharded_prefix_is_never_taken_and_goes_at_resume(s3: S3) -> None:
    await _fit(1, [_sharded(s3, every_n_epochs=1)])
    fs, run = s3.fs, f"{s3.bucket}/run"
    directory = RemotePath(s3.url, s3.options)
    # A newer save whose writers died before the marker: shards, no marker.
    fs.copy(f"{run}/epoch=0-step=4.ckpt/__0_0.distcp", f"{run}/epoch=5-step=99.ckpt/__0_0.distcp")
    # One whose marker lists a shard of another size (truncated).
    for name in (".metadata", "loopbus_state.pt", "loopbus.complete"):
        fs.copy(f"{run}/epoch=0-step=4.ckpt/{name}", f"{run}/epoch=6-step=98.ckpt/{name}")
    fs.pipe_file(f"{run}/epoch=6-step=98.ckpt/__0_0.distcp", b"torn")
    fs.rm_file(f"{run}/last.json")
    with pytest.warns(UserWarning, match="passed over|not complete|skipped") as caught:
        found = loopbus.latest_checkpoint(directory)
    assert str(found) == f"{s3.url}/epoch=0-step=4.ckpt"
    said = " ".join(str(w.message) for w in caught)
    assert "epoch=5-step=99.ckpt: it has no completeness marker loopbus.complete" in said
    assert "epoch=6-step=98.ckpt: its object __0_0.distcp has 4 bytes" in said
    torn = r"the object .*/epoch=6-step=98.ckpt/__0_0.distcp of the sharded checkpoint .* is truncated"
    with pytest.raises(CheckpointError, match=torn):
        loopbus.load_checkpoint(directory / "epoch=6-step=98.ckpt")
    # A run that resumes from the folder removes what dead writers left, nothing else.
    with pytest.warns(UserWarning, match="epoch=5-step=99.ckpt"):
        trainer, _ = await _fit(2, [_sharded(s3, every_n_epochs=1)], ckpt_path="last")
    assert trainer.global_step == 2 * PER_EPOCH
    assert sorted(s3.grouped()) == ["epoch=1-step=8.ckpt", "last.json"]


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
async def test_ckpt_path_best_loads_the_best_remote_checkpoint(s3: S3, sharded: bool) -> None:
    loopbus.seed_everything(3)
    module = TinyModule()
    checkpoint = Checkpoint(
        s3.url, storage_options=s3.options, sharded=sharded, monitor="val/loss", keep_best=1
    )
    trainer = Trainer(max_epochs=3, plugins=[checkpoint], device="cpu")
    await trainer.fit(module, make_loader(64, 16), make_loader(32, 16))
    best = checkpoint.best_checkpoint_path
    assert isinstance(best, RemotePath)
    assert str(best).startswith(f"{s3.url}/epoch=")
    expected = loopbus.load_checkpoint(best)["module"]["layer.weight"]
    with torch.no_grad():
        module.layer.weight.zero_()
    await trainer.test(module, make_loader(32, 16), ckpt_path="best")
    assert torch.equal(module.layer.weight, expected)


async def test_remote_sharded_checkpoints_load_and_consolidate(s3: S3, tmp_path: Path) -> None:
    trainer, module = await _fit(1, [_sharded(s3, every_n_epochs=1)])
    url = RemotePath(f"{s3.url}/epoch=0-step=4.ckpt", s3.options)
    for path in (url, RemotePath(s3.url, s3.options)):
        state = loopbus.load_checkpoint(path)
        assert state["loopbus"]["global_step"] == 4
        assert torch.equal(state["module"]["layer.weight"], module.layer.weight)
    rebuilt = TinyModule.load_from_checkpoint(url)
    assert torch.equal(rebuilt.layer.weight, module.layer.weight)
    # To a local file, and to the store (an object with its marker).
    local = loopbus.consolidate_checkpoint(url, tmp_path / "full.ckpt")
    assert torch.equal(torch.load(local, weights_only=True)["module"]["layer.weight"], module.layer.weight)
    out = RemotePath(f"s3://{s3.bucket}/full/one.ckpt", s3.options)
    assert loopbus.consolidate_checkpoint(url, out) == out
    assert s3.keys("full") == ["one.ckpt", "one.ckpt.complete"]
    state = loopbus.load_checkpoint(out)
    assert state["loopbus"]["layout"] == "consolidated"
    assert torch.equal(state["module"]["layer.weight"], module.layer.weight)
    with pytest.raises(CheckpointError, match="will not overwrite"):
        loopbus.consolidate_checkpoint(url, out)
    # A sharded save over a name that holds one replaces it whole (marker first).
    again = RemotePath(f"s3://{s3.bucket}/again/one.ckpt", s3.options)
    loopbus.ShardedCheckpointWriter().save(trainer, again).wait()
    s3.fs.pipe_file(f"{s3.bucket}/again/one.ckpt/__9_9.distcp", b"left by a larger job")
    with torch.no_grad():
        module.layer.weight.add_(1.0)
    loopbus.ShardedCheckpointWriter().save(trainer, again).wait()
    assert set(s3.keys("again")) == {f"one.ckpt/{name}" for name in SHARDED}
    assert torch.equal(loopbus.load_checkpoint(again)["module"]["layer.weight"], module.layer.weight)
    # trainer.save_checkpoint to a URL: the object, then its marker.
    saved = trainer.save_checkpoint(RemotePath(f"s3://{s3.bucket}/saved/by-hand.ckpt", s3.options))
    assert isinstance(saved, RemotePath)
    assert s3.keys("saved") == ["by-hand.ckpt", "by-hand.ckpt.complete"]
    assert loopbus.load_checkpoint(saved)["loopbus"]["global_step"] == 4


async def test_a_failed_sharded_write_is_reported_and_never_named_last(
    own_server: Any,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_store, "BACKOFF", 0.05)
    holder, port, endpoint = own_server
    bucket = make_bucket(endpoint)
    url, options = f"s3://{bucket}/run", options_for(endpoint)
    s3 = S3(url, bucket, endpoint, options)
    # The server stops after step 4 (step 2's checkpoint is complete by then), and is
    # back at step 7: the save of step 4 fails, those after it succeed.
    outage = Outage(holder, port, stop_at=4, restart_at=7, published=(s3, "step=2."))
    checkpoint = Checkpoint(
        url, storage_options=options, sharded=True, every_n_steps=2, upload_retries=1,
        keep_last=None, save_on_end=False,
    )  # fmt: skip
    with pytest.warns(UserWarning, match=r"cannot save to s3://.* now|saves to s3://.* resumed") as caught:
        await _fit(2, [outage, checkpoint])
    failures = [str(w.message) for w in caught if "cannot save to" in str(w.message)]
    assert len(failures) == 1  # the outage is said once
    assert "epoch=0-step=4.ckpt" in failures[0]
    kept = s3.grouped()
    assert "epoch=0-step=4.ckpt" not in kept or "loopbus.complete" not in kept["epoch=0-step=4.ckpt"]
    # A save due while the failed upload still retried was skipped at once; the newest
    # complete one is a later save, named "last".
    latest = loopbus.latest_checkpoint(RemotePath(url, options))
    assert latest is not None
    assert latest.name in ("epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt")
    assert kept[latest.name] == SHARDED


def test_the_cli_consolidates_from_the_store_with_standard_credentials(
    s3: S3, tmp_path: Path
) -> None:
    # A command in a process of its own: run once, not on each async library.
    _, module = loopbus.run(_fit, 1, [_sharded(s3, every_n_epochs=1)])
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        # The standard places botocore reads: no storage options are passed.
        "AWS_ACCESS_KEY_ID": s3.options["key"],
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL_S3": s3.endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "none"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
    }
    out = tmp_path / "full.ckpt"
    command = [sys.executable, "-m", "loopbus", "consolidate"]
    proc = subprocess.run(
        [*command, s3.url, str(out)], env=env, cwd=tmp_path, capture_output=True, timeout=120
    )
    said = proc.stderr.decode()
    assert proc.returncode == 0, said[-3000:]
    assert "its newest complete sharded checkpoint, epoch=0-step=4.ckpt (step 4)" in said
    state = torch.load(out, weights_only=True)
    assert torch.equal(state["module"]["layer.weight"], module.layer.weight)
    assert SECRET not in proc.stdout.decode() + said
    # Nothing sharded there: said, with nothing written.
    empty = f"s3://{make_bucket(s3.endpoint)}/run"
    proc = subprocess.run(
        [*command, empty, str(tmp_path / "none.ckpt")],
        env=env, cwd=tmp_path, capture_output=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1
    assert f"no sharded checkpoint at {empty}: nothing is there" in proc.stderr.decode()
    assert not (tmp_path / "none.ckpt").exists()
    assert json.loads(s3.fs.cat_file(f"{s3.bucket}/run/last.json"))["checkpoint"] == "epoch=0-step=4.ckpt"
