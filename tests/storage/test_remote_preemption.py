"""Preemption with a remote ``Checkpoint``: a training process (``_remote_kill_script.py``,
uploading to the session's S3 server) gets SIGTERM while a known batch runs, mid-epoch;
before it exits (status 143) the checkpoint of that step is complete on the server (the
object, its marker recording its size, ``last.json`` naming it), although remote saves
upload in the background; and ``fit(ckpt_path="last")`` in this process resumes from it
to the same final weights as an uninterrupted run, bit for bit. For checkpoint files and
sharded ones (a prefix each, its marker written last).

The process runs on the same async library as the test (asyncio, trio)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from loopbus import RemotePath
from tests.helpers import ROOT

from ._remote_kill_script import (
    EPOCHS,
    EVERY_N_STEPS,
    PER_EPOCH,
    assert_same_final,
    build,
    final_state,
)
from .conftest import S3

STEPS = EPOCHS * PER_EPOCH
#: The signal lands in epoch 1, batch 9: step 50, between two periodic saves (48, 54).
WAIT_AT = (1, 9)
STOP_STEP = PER_EPOCH + WAIT_AT[1] + 1
STOPPED = f"epoch=1-step={STOP_STEP}.ckpt"
PREVIOUS = f"epoch=1-step={STOP_STEP // EVERY_N_STEPS * EVERY_N_STEPS}.ckpt"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(signal, "SIGTERM"), reason="POSIX signals needed"),
]


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    trainer, module, train = build(None, None)
    loopbus.run(trainer.fit, module, train)
    return final_state(trainer, module)


def _preempt(s3: S3, tmp_path: Path, backend: str, sharded: bool) -> tuple[int, str]:
    """Start the run, send SIGTERM once batch ``WAIT_AT`` runs; its status and stderr."""
    ready = tmp_path / "ready"
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "tests.storage._remote_kill_script",
            "--endpoint", s3.endpoint,
            "--url", s3.url,
            "--out", str(tmp_path / "final.pt"),
            "--threads", str(torch.get_num_threads()),
            "--backend", backend,
            "--wait-at", "{}:{}".format(*WAIT_AT),
            "--ready", str(ready),
            *(["--sharded"] if sharded else []),
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if proc.poll() is not None:
                raise AssertionError(f"the run ended before the signal: {proc.stderr.read()[-4000:]}")  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the run never reached the signal's batch"
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, err


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "sharded"])
async def test_sigterm_completes_the_remote_checkpoint_before_exit_and_resumes_exactly(
    s3: S3,
    tmp_path: Path,
    anyio_backend: tuple[str, dict[str, Any]],
    reference: dict[str, Any],
    sharded: bool,
) -> None:
    rc, err = _preempt(s3, tmp_path, anyio_backend[0], sharded)
    assert rc == 128 + signal.SIGTERM == 143, err[-4000:]
    assert f"stopped at step {STOP_STEP} on SIGTERM; exiting with status 143" in err
    assert not (tmp_path / "final.pt").exists()

    # The process has exited: what the server holds now was written before it did. The
    # stop's checkpoint is complete and named last; keep_last=2 evicted all but one more.
    fs = s3.fs
    if sharded:  # a prefix each: the shards, the plain state, the marker written last
        inside = (".metadata", "__0_0.distcp", "loopbus_state.pt", "loopbus.complete")
        assert s3.keys() == sorted(
            [*(f"{c}/{n}" for c in (PREVIOUS, STOPPED) for n in inside), "last.json"]
        )
        marker = json.loads(fs.cat_file(f"{s3.bucket}/run/{STOPPED}/loopbus.complete"))
        for name, size in marker["files"].items():
            assert size == fs.size(f"{s3.bucket}/run/{STOPPED}/{name}") > 0, name
    else:
        assert s3.keys() == sorted(
            [PREVIOUS, f"{PREVIOUS}.complete", STOPPED, f"{STOPPED}.complete", "last.json"]
        )
        marker = json.loads(fs.cat_file(f"{s3.bucket}/run/{STOPPED}.complete"))
        assert marker["size"] == fs.size(f"{s3.bucket}/run/{STOPPED}") > 0
    assert marker["global_step"] == STOP_STEP
    assert json.loads(fs.cat_file(f"{s3.bucket}/run/last.json"))["checkpoint"] == STOPPED
    directory = RemotePath(s3.url, s3.options)
    assert str(loopbus.latest_checkpoint(directory)) == f"{s3.url}/{STOPPED}"
    state = loopbus.load_checkpoint(directory)  # checks size and CRC-32
    assert state["loopbus"]["global_step"] == STOP_STEP
    assert state["loops/fit"]["loops"]["epoch_loop"]["state"]["in_epoch"] is True
    # Nothing of the upload is left behind locally.
    assert [p.name for p in os.scandir(tmp_path) if p.name.startswith("loopbus-upload-")] == []

    trainer, module, train = build(s3.url, s3.options, sharded=sharded)
    await trainer.fit(module, train, ckpt_path="last")
    assert_same_final(final_state(trainer, module), reference)
