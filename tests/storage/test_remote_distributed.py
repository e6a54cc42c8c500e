"""Sharded checkpoints in an object store under ``torchrun`` (gloo, CPU), against the S3
server (conftest.py): every rank writes its shards straight to the store through DCP's
fsspec writer, rank 0 writes the completeness marker last.

- kill -9 while a rank writes its shards (inside the asynchronous save of step 20), or
  while rank 0 uploads a checkpoint file (DDP): ``ckpt_path="last"`` resumes from the
  newest complete checkpoint, bit-identical to an uninterrupted run, and the store is
  left with exactly the checkpoints kept (what the killed save wrote is removed when the
  run resumes);
- a job of 4 FSDP ranks killed mid-epoch resumes on 2 from the store, training every
  sample of the interrupted epoch once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import loopbus
from loopbus import RemotePath
from tests.distributed.test_sharded import (
    COMMON,
    _optimizer,
    _same_optimizer_state,
    resume_at_another_world_size,
)
from tests.torchrun import launch, ok, same, summary, weights

from .conftest import S3

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not torch.distributed.is_available(), reason="torch.distributed is not available"
    ),
]


def _to(s3: S3) -> tuple[str, ...]:
    """The script's options that send its sharded checkpoints to the test's bucket."""
    return ("--ckpt-url", s3.url, "--storage-options", json.dumps(s3.options))


def _same_as(uninterrupted: Path, resumed: Path) -> None:
    """The resumed job ended with the never-killed one's weights and optimizer state, on
    both ranks, after as many steps."""
    for rank in (0, 1):
        assert same(weights(uninterrupted, rank), weights(resumed, rank))
        assert _same_optimizer_state(
            _optimizer(uninterrupted, rank)["state"], _optimizer(resumed, rank)["state"]
        )
    assert summary(resumed, 0)["step"] == 32


def test_killed_while_writing_remote_shards_resumes_bit_identical(
    uninterrupted: Path,  # the same job, never killed (tests/conftest.py)
    s3: S3,
    tmp_path: Path,
) -> None:
    common = (*COMMON, "--strategy", "ddp", *_to(s3))
    proc = launch(tmp_path, *common, "--kill-in-save", "20")
    assert proc.returncode != 0
    directory = RemotePath(s3.url, s3.options)
    # The save of step 20 never got its marker: "last" is step 10's, complete.
    left = s3.grouped()
    assert "loopbus.complete" not in left.get("epoch=1-step=20.ckpt", set())
    last = loopbus.latest_checkpoint(directory)
    assert str(last) == f"{s3.url}/epoch=0-step=10.ckpt"
    info = loopbus.checkpoint_info(last)
    assert info is not None
    assert (info["global_step"], info["world_size"], info["layout"]) == (10, 2, "sharded")
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "loopbus_state.pt"} <= set(info["files"])

    ok(launch(tmp_path, *common, "--resume"))
    assert torch.load(tmp_path / "loaded_rank0.pt", weights_only=True)["step"] == 10
    _same_as(uninterrupted, tmp_path)
    # keep_last=2: exactly the two newest, each whole (its marker lists every object
    # under its prefix), and not one object more.
    kept = s3.grouped()
    assert sorted(kept) == ["epoch=1-step=30.ckpt", "epoch=1-step=32.ckpt", "last.json"]
    for name in ("epoch=1-step=30.ckpt", "epoch=1-step=32.ckpt"):
        info = loopbus.checkpoint_info(directory / name)
        assert info is not None
        assert kept[name] == {*info["files"], "loopbus.complete"}, name
    assert json.loads(s3.fs.cat_file(f"{s3.bucket}/run/last.json"))["checkpoint"] == (
        "epoch=1-step=32.ckpt"
    )


def test_killed_in_a_remote_file_upload_under_ddp_resumes_bit_identical(
    uninterrupted: Path,  # the same job, never killed (tests/conftest.py)
    s3: S3,
    tmp_path: Path,
) -> None:
    # Checkpoint files: rank 0 uploads each in the background; killed as it starts the
    # upload of step 20's (the uninterrupted job trained the same: checkpoints do not
    # change training).
    common = ("--epochs", "2", "--ckpt", "10", "--keep-last", "2", *_to(s3))
    proc = launch(tmp_path, *common, "--kill-in-upload", "20")
    assert proc.returncode != 0
    # The killed job's folder lease is left behind; the resumed job on this host takes
    # it over (its holder's process is gone).
    assert sorted(s3.keys()) == [
        ".loopbus-lease",
        "epoch=0-step=10.ckpt",
        "epoch=0-step=10.ckpt.complete",
        "last.json",
    ]
    ok(launch(tmp_path, *common, "--resume"))
    assert torch.load(tmp_path / "loaded_rank0.pt", weights_only=True)["step"] == 10
    _same_as(uninterrupted, tmp_path)
    assert sorted(s3.keys()) == [
        "epoch=1-step=30.ckpt",
        "epoch=1-step=30.ckpt.complete",
        "epoch=1-step=32.ckpt",
        "epoch=1-step=32.ckpt.complete",
        "last.json",
    ]


def test_a_job_of_four_fsdp_ranks_resumes_on_two_from_the_store(s3: S3, tmp_path: Path) -> None:
    # 8 steps an epoch on 4 ranks: saved at step 4, 256 samples into the epoch.
    resume_at_another_world_size(
        tmp_path, RemotePath(s3.url, s3.options), 4, 2, 4, 6, "fsdp", *_to(s3)
    )
    assert sorted(s3.grouped())[-1] == "last.json"
