"""DDP on GPUs under torchrun (NCCL): one process per GPU (at most two); stop requests
travel on the host over a gloo group next to NCCL, so the stop lands where it does on
the CPU. Skipped without CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.torchrun import launch, ok, same, summary, weights

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.slow,
]

NPROC = min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 0


def test_ddp_on_gpus_with_nccl(tmp_path: Path) -> None:
    ok(launch(tmp_path, "--epochs", "2", "--strategy", "ddp", nproc=NPROC))
    summaries = [summary(tmp_path, rank) for rank in range(NPROC)]
    for rank, s in enumerate(summaries):
        assert (s["strategy"], s["world_size"], s["backend"]) == ("ddp", NPROC, "nccl")
        assert s["device"] == f"cuda:{rank}"
        assert s["val_acc"] > 0.8
    if NPROC == 2:
        assert same(weights(tmp_path, 0), weights(tmp_path, 1))


def test_a_stop_on_gpus_lands_at_the_same_step_everywhere(tmp_path: Path) -> None:
    rank = NPROC - 1
    ok(
        launch(
            tmp_path,
            "--epochs", "2", "--strategy", "ddp", "--stop-rank", str(rank), "--stop-at", "10",
            "--stop-check-interval", "0", nproc=NPROC,
        )
    )  # fmt: skip
    steps = {summary(tmp_path, r)["step"] for r in range(NPROC)}
    # Asked by a handler after step 10: sent at boundary 10, read at boundary 11 (the
    # exchange is on the host: the device is never waited for).
    assert steps == {11}
    assert summary(tmp_path, rank)["stop_reason"] == f"rank {rank} asked at step 10"
