"""An object store that fails, against moto's S3 server: missing credentials and a
missing bucket are one-line ``CheckpointError``s naming the URL and the fix (at the start
of ``fit``, in ``load_checkpoint``, ``Module.load_from_checkpoint`` and ``loopbus
consolidate``), before anything trains; ``Checkpoint.last_checkpoint_path`` never calls
the store; the checkpoints a run evicted but a kill kept it from deleting are deleted when
the run resumes; the checkpoint's write, upload and eviction show as profiler ranges."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
import torch

import loopbus
from loopbus import CheckpointError, HandlerError, RemotePath, Trainer
from loopbus.plugins import Checkpoint
from loopbus.storage import _store
from tests.helpers import ROOT, TinyModule, make_loader

from ._remote_kill_script import EVERY_N_STEPS, build
from .conftest import S3, free_port, make_bucket, options_for
from .test_remote_kill import Gate, Kill
from .test_store_deadlines import Count, _fit

PER_EPOCH = 4  # make_loader(64, 16)


@pytest.fixture
def no_credentials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """No credentials anywhere botocore looks (no AWS_* variables, empty config files,
    no instance metadata): the storage options to reach the server without any."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    empty = tmp_path / "empty"
    empty.write_text("")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
    monkeypatch.setattr(_store, "BACKOFF", 0.01)
    return {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9", "region_name": "us-east-1"}}


# ---------------------------------------------------------------- credentials, bucket

_NO_CREDENTIALS = "no credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"


async def test_missing_credentials_are_one_checkpoint_error_naming_the_fix(
    no_credentials: dict[str, Any],
) -> None:
    pytest.importorskip("s3fs")
    url = "s3://loopbus-anywhere/run"
    where = RemotePath(url, no_credentials)
    for call in (
        lambda: loopbus.load_checkpoint(where),
        lambda: TinyModule.load_from_checkpoint(where / "x.ckpt"),
        lambda: loopbus.latest_checkpoint(where),
    ):
        with pytest.raises(CheckpointError) as info:
            call()
        message = str(info.value)
        assert url in message
        assert "NoCredentialsError" in message
        assert _NO_CREDENTIALS in message
        assert "tries)" not in message  # not tried again: another try cannot mend it
        assert "\n" not in message
    # At the start of fit, before anything trains: resuming ...
    count = Count()
    with pytest.raises(CheckpointError, match=_NO_CREDENTIALS):
        await _fit(1, [count, Checkpoint(url, storage_options=no_credentials)], "last")
    # ... or not (the folder's lease, at FitStarted).
    with pytest.raises(HandlerError) as caught:
        await _fit(1, [count, Checkpoint(url, storage_options=no_credentials)])
    assert isinstance(caught.value.original, CheckpointError)
    assert _NO_CREDENTIALS in str(caught.value.original)
    assert url in str(caught.value.original)
    assert count.batches == 0


def test_loopbus_consolidate_without_credentials_says_what_to_do(
    no_credentials: dict[str, Any], s3_endpoint: str
) -> None:
    env = {**os.environ, "AWS_ENDPOINT_URL_S3": s3_endpoint}
    done = subprocess.run(
        [sys.executable, "-m", "loopbus", "consolidate", "s3://loopbus-any/run", "out.ckpt"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("loopbus consolidate: cannot ")
    assert "s3://loopbus-any/run" in lines[0]
    assert _NO_CREDENTIALS in lines[0]


async def test_a_missing_bucket_is_refused_before_training(s3_endpoint: str) -> None:
    count = Count()
    checkpoint = Checkpoint("s3://nosuchbucket/run", storage_options=options_for(s3_endpoint))
    with pytest.raises(HandlerError) as caught:
        await _fit(2, [count, checkpoint])
    error = caught.value.original
    assert isinstance(error, CheckpointError)
    assert str(error) == (
        "Checkpoint('s3://nosuchbucket/run') cannot write into s3://nosuchbucket/run: the "
        "bucket nosuchbucket does not exist (or is not reachable with these credentials): "
        "create it or fix dirpath."
    )
    assert count.batches == 0


# ---------------------------------------------------------------- no I/O in properties


async def test_last_checkpoint_path_never_calls_the_store(s3: S3) -> None:
    checkpoint = Checkpoint(s3.url, storage_options=s3.options, every_n_epochs=1)
    await _fit(2, [checkpoint])
    last = checkpoint.last_checkpoint_path
    assert last == f"{s3.url}/epoch=1-step=8.ckpt"
    # With the store out of reach it answers at once, from what the plugin knows.
    away = Checkpoint(s3.url, storage_options=options_for(f"http://127.0.0.1:{free_port()}"))
    started = time.monotonic()
    assert away.last_checkpoint_path is None
    assert checkpoint.last_checkpoint_path == last
    assert time.monotonic() - started < 1
    # Looking now is a method: it calls the store.
    assert Checkpoint(s3.url, storage_options=s3.options).latest_checkpoint() == last


# ---------------------------------------------------------------- eviction after a kill


class DeleteGate(Gate):
    """The gate of ``test_remote_kill``, killing at a DELETE instead of a PUT."""

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        if environ["REQUEST_METHOD"] == "DELETE":
            bucket, _, key = unquote(environ.get("PATH_INFO", "")).lstrip("/").partition("/")
            rule = self.rules.get(bucket)
            if rule is not None and rule.kill_now(key):
                start_response("503 Service Unavailable", [("Content-Length", "0")])
                return [b""]
        return self.app(environ, start_response)


@pytest.mark.slow
def test_a_resumed_run_removes_what_a_kill_kept_it_from_evicting(
    s3_endpoint: str, tmp_path: Path
) -> None:
    # keep_last=2, a save every 6 steps. Each save first deletes an old marker of its own
    # name (a DELETE of a marker); the third save then evicts the first, marker first:
    # the 4th DELETE of a marker. Killed there, the first stays, complete, for good.
    kill = Kill("marker", 4, bucket=make_bucket(s3_endpoint))
    url = f"s3://{kill.bucket}/run"
    gate = DeleteGate()
    gate.rules[kill.bucket] = kill
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    try:
        kill.proc = subprocess.Popen(
            [
                sys.executable, "-m", "tests.storage._remote_kill_script",
                "--endpoint", gate.endpoint, "--url", url, "--out", str(tmp_path / "final.pt"),
            ],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        _, stderr = kill.proc.communicate(timeout=120)
    finally:
        if kill.proc is not None and kill.proc.poll() is None:
            kill.proc.kill()
        gate.close()
    assert kill.killed_at == f"run/epoch=0-step={EVERY_N_STEPS}.ckpt.complete", stderr[-3000:]
    s3 = S3(url, kill.bucket, s3_endpoint, options_for(s3_endpoint))
    first, third = f"epoch=0-step={EVERY_N_STEPS}.ckpt", f"epoch=0-step={3 * EVERY_N_STEPS}.ckpt"
    assert {first, f"{first}.complete", f"{third}.complete"} <= set(s3.keys())

    trainer, module, train = build(url, s3.options)
    loopbus.run(functools.partial(trainer.fit, module, train, ckpt_path="last"))
    left = [k for k in s3.keys() if k.endswith(".ckpt")]
    assert first not in left  # removed when the run resumed: its state recorded it
    assert len(left) == 2, left  # keep_last=2: the end-of-fit save and the one before


# ---------------------------------------------------------------- profiler ranges


def _ranges(run: Any) -> set[str]:
    from torch.profiler import ProfilerActivity, profile

    previous = loopbus.profiling_ranges(True)
    try:
        # The write runs in a worker thread: profiled with every thread, as the
        # Profiler plugin does.
        every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        with profile(activities=[ProfilerActivity.CPU], experimental_config=every_thread) as prof:
            run()
    finally:
        loopbus.profiling_ranges(previous)
    return {event.name for event in prof.events() if event.name.startswith("loopbus.checkpoint")}


def test_the_write_upload_and_eviction_are_profiler_ranges(tmp_path: Path, s3: S3) -> None:
    def fit(dirpath: Any, **options: Any) -> None:
        checkpoint = Checkpoint(dirpath, every_n_steps=2, keep_last=1, **options)
        loopbus.run(Trainer(max_epochs=1, plugins=[checkpoint], device="cpu").fit,
                    TinyModule(), make_loader(64, 16))  # fmt: skip

    local = _ranges(lambda: fit(tmp_path))
    assert {"loopbus.checkpoint.write", "loopbus.checkpoint.evict"} <= local
    remote = _ranges(lambda: fit(s3.url, storage_options=s3.options))
    assert {"loopbus.checkpoint.upload", "loopbus.checkpoint.evict"} <= remote
    # Off by default: no range at all.
    every_thread = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with torch.profiler.profile(experimental_config=every_thread) as prof:
        fit(tmp_path / "off")
    assert not [e for e in prof.events() if e.name.startswith("loopbus.checkpoint.")]
