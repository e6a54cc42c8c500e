"""Checkpoint files on object storage, against a running S3 server (moto's, see
conftest.py): a fit with ``Checkpoint("s3://...")`` resumes exactly from
``ckpt_path="last"``; keep_last leaves exactly what it keeps; a checkpoint without its
completeness marker is never taken as last; an unreachable server is retried, or
reported with nothing incomplete named last; URLs load, and tell what to install when
a package is missing; the storage options' secret is written nowhere."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

import loopbus
from loopbus import (
    CheckpointError,
    HandlerError,
    MisconfigurationError,
    Plugin,
    RemotePath,
    Trainer,
    on,
)
from loopbus.events import TrainBatchCompleted
from loopbus.plugins import Checkpoint, JSONLLogger
from loopbus.storage import _store
from tests.helpers import TinyModule, make_loader

from .conftest import S3, SECRET, free_port, make_bucket, options_for, start_server

PER_EPOCH = 4  # make_loader(64, 16)


def _weights(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items()}


async def _fit(
    epochs: int, plugins: list[Plugin], ckpt_path: Any = None, **options: Any
) -> tuple[Trainer, TinyModule]:
    loopbus.seed_everything(3)
    module = TinyModule()
    trainer = Trainer(max_epochs=epochs, plugins=plugins, device="cpu", **options)
    await trainer.fit(module, make_loader(64, 16), ckpt_path=ckpt_path)
    return trainer, module


def _remote(s3: S3, **options: Any) -> Checkpoint:
    return Checkpoint(s3.url, storage_options=s3.options, **options)


# ---------------------------------------------------------------- resume


async def test_a_remote_run_resumed_from_last_ends_bit_identical(s3: S3) -> None:
    _, straight = await _fit(4, [])
    expected = _weights(straight)

    await _fit(2, [_remote(s3, every_n_epochs=1)])
    assert sorted(s3.keys()) == [
        "epoch=1-step=8.ckpt",
        "epoch=1-step=8.ckpt.complete",
        "last.json",
    ]
    checkpoint = _remote(s3, every_n_epochs=1)
    assert checkpoint.last_checkpoint_path is None  # a property: it never calls the store
    last = checkpoint.latest_checkpoint()  # looks now
    assert checkpoint.last_checkpoint_path == last
    assert isinstance(last, RemotePath)
    assert str(last) == f"{s3.url}/epoch=1-step=8.ckpt"
    trainer, resumed = await _fit(4, [checkpoint], ckpt_path="last")
    assert trainer.global_step == 4 * PER_EPOCH
    for name, tensor in expected.items():
        assert torch.equal(resumed.state_dict()[name], tensor), name


async def test_a_url_as_ckpt_path_resumes_from_that_checkpoint(s3: S3) -> None:
    await _fit(1, [_remote(s3, every_n_epochs=1)])
    url = RemotePath(f"{s3.url}/epoch=0-step=4.ckpt", s3.options)
    trainer, _ = await _fit(2, [_remote(s3, every_n_epochs=1)], ckpt_path=url)
    assert trainer.global_step == 2 * PER_EPOCH


# ---------------------------------------------------------------- what is kept


async def test_keep_last_two_over_ten_saves_leaves_exactly_two_complete(s3: S3) -> None:
    saved: list[str] = []

    class Saves(Plugin):
        @on(loopbus.plugins.CheckpointSaved)
        def _saved(self, event: Any) -> None:
            saved.append(event.path)

    checkpoint = _remote(s3, every_n_steps=2, keep_last=2, save_on_end=False)
    await _fit(5, [checkpoint, Saves()])
    assert len(saved) == 10
    assert s3.keys() == [
        "epoch=4-step=18.ckpt",
        "epoch=4-step=18.ckpt.complete",
        "epoch=4-step=20.ckpt",
        "epoch=4-step=20.ckpt.complete",
        "last.json",
    ]
    for name in ("epoch=4-step=18.ckpt", "epoch=4-step=20.ckpt"):
        info = loopbus.checkpoint_info(f"{s3.url}/{name}", storage_options=s3.options)
        assert info is not None
        assert info["size"] == s3.fs.size(f"{s3.bucket}/run/{name}")


async def test_a_checkpoint_without_its_marker_is_never_taken_as_last(s3: S3) -> None:
    await _fit(1, [_remote(s3, every_n_epochs=1)])
    fs = s3.fs
    # An upload killed midway: the object is there, its marker and the pointer are not.
    data = fs.cat_file(f"{s3.bucket}/run/epoch=0-step=4.ckpt")
    fs.pipe_file(f"{s3.bucket}/run/epoch=9-step=99.ckpt", data)
    directory = RemotePath(s3.url, s3.options)
    assert loopbus.latest_checkpoint(directory) == f"{s3.url}/epoch=0-step=4.ckpt"
    # Without the pointer, the newest complete one is taken, and the other one named.
    fs.rm_file(f"{s3.bucket}/run/last.json")
    with pytest.warns(UserWarning, match=r"epoch=9-step=99.ckpt: it has no completeness marker"):
        found = loopbus.latest_checkpoint(directory)
    assert found == f"{s3.url}/epoch=0-step=4.ckpt"
    # A marker that does not fit its object (a replaced object): not complete either.
    fs.pipe_file(f"{s3.bucket}/run/epoch=9-step=99.ckpt.complete", b'{"size": 3, "global_step": 99}')
    with pytest.warns(UserWarning, match=r"where its completeness marker records 3"):
        assert loopbus.latest_checkpoint(directory) == f"{s3.url}/epoch=0-step=4.ckpt"


# ---------------------------------------------------------------- an unreachable server


class Outage(Plugin):
    """Stops the server after the ``stop_at``-th step; starts it again ``restart_after``
    seconds later (in a thread), or at the ``restart_at``-th step."""

    def __init__(self, server: list[Any], port: int, stop_at: int, **when: Any) -> None:
        self.server, self.port, self.stop_at = server, port, stop_at
        self.published: tuple[S3, str] | None = when.get("published")
        self.restart_after: float | None = when.get("restart_after")
        self.restart_at: int | None = when.get("restart_at")
        self.thread: threading.Thread | None = None
        self.trainer: Any = None

    def setup(self, trainer: Any, stage: str) -> None:
        self.trainer = trainer

    def restart(self) -> None:
        self.server[0] = start_server(self.port)

    @on(TrainBatchCompleted)
    async def _step(self, event: TrainBatchCompleted) -> None:
        step = self.trainer.global_step
        if step == self.stop_at:
            if self.published is not None:  # the save before the outage is uploaded
                await _wait_until_last_is(*self.published)
            self.server[0].stop()
            if self.restart_after is not None:
                self.thread = threading.Timer(self.restart_after, self.restart)
                self.thread.start()
        if step == self.restart_at:
            self.restart()


async def _wait_until_last_is(s3: S3, name: str) -> None:
    fs, pointer = s3.fs, f"{s3.bucket}/run/last.json"
    deadline = time.monotonic() + 20
    while name.encode() not in (fs.cat_file(pointer) if fs.exists(pointer) else b""):
        assert time.monotonic() < deadline, f"{name} was never published"
        await anyio.sleep(0.05)


@pytest.fixture
def own_server() -> Any:
    """A server of the test's own, that it may stop: ``([server], port, endpoint)``."""
    pytest.importorskip("moto.server")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    port = free_port()
    holder = [start_server(port)]
    yield holder, port, f"http://127.0.0.1:{port}"
    holder[0].stop()
    s3fs.S3FileSystem.clear_instance_cache()


async def test_uploads_are_retried_while_the_server_restarts(
    own_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_store, "BACKOFF", 0.2)
    holder, port, endpoint = own_server
    url = f"s3://{make_bucket(endpoint)}/run"
    options = options_for(endpoint)
    outage = Outage(holder, port, stop_at=4, restart_after=0.5)
    checkpoint = Checkpoint(
        url, storage_options=options, every_n_steps=2, keep_last=2, upload_retries=6, save_on_end=False
    )
    await _fit(2, [outage, checkpoint])
    assert outage.thread is not None
    outage.thread.join()
    found = loopbus.latest_checkpoint(RemotePath(url, options))
    assert found == f"{url}/epoch=1-step=8.ckpt"
    assert loopbus.checkpoint_info(found) is not None


async def test_a_failed_upload_is_reported_and_never_named_last(
    own_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_store, "BACKOFF", 0.05)
    holder, port, endpoint = own_server
    url = f"s3://{make_bucket(endpoint)}/run"
    options = options_for(endpoint)
    seen: list[Any] = []

    class Look(Plugin):
        """At the step the server comes back: what "last" is."""

        def setup(self, trainer: Any, stage: str) -> None:
            self.trainer = trainer

        @on(TrainBatchCompleted)
        def _look(self, event: Any) -> None:
            if self.trainer.global_step == 7:
                last = loopbus.latest_checkpoint(RemotePath(url, options))
                info = loopbus.checkpoint_info(last) or {}
                seen.append((last, info.get("size"), holder_size(endpoint, options, str(last))))

    bucket = url.split("/")[2]
    outage = Outage(
        holder, port, stop_at=4, restart_at=7, published=(S3(url, bucket, endpoint, options), "step=2.")
    )
    checkpoint = Checkpoint(
        url, storage_options=options, every_n_steps=2, upload_retries=1, save_on_end=False
    )
    with pytest.warns(UserWarning, match=r"cannot save to s3://.* now|saves to s3://.* resumed") as caught:
        await _fit(3, [outage, Look(), checkpoint])
    messages = [str(w.message) for w in caught]
    # Step 4's upload failed (and step 6's too, unless it began after the server came
    # back): the outage is said once, with the store's error; then that saves resumed.
    assert len(messages) == 2, messages
    assert "EndpointConnectionError" in messages[0]
    assert "resumed" in messages[1]
    # At the restart "last" is a complete checkpoint: step 2's (or step 6's, uploaded
    # after the restart), never the failed one.
    last, marked, size = seen[0]
    assert last in (f"{url}/epoch=0-step=2.ckpt", f"{url}/epoch=1-step=6.ckpt")
    assert marked == size
    # The saves due while an upload retried the failing store were skipped at once; the
    # newest complete one is kept alone (step 6's, in flight when the store came back, or
    # a later one).
    keys = S3(url, bucket, endpoint, options).keys()
    assert len(keys) == 3, keys
    assert keys[2] == "last.json", keys
    assert keys[1] == keys[0] + ".complete"
    assert keys[0] in ("epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=10.ckpt", "epoch=2-step=12.ckpt")


async def test_saves_due_while_the_store_is_down_write_nothing_and_resume_after(
    own_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_store, "BACKOFF", 0.05)
    holder, port, endpoint = own_server
    url = f"s3://{make_bucket(endpoint)}/run"
    options = options_for(endpoint)
    taken: list[int] = []
    state_dict = Trainer.state_dict

    def counted(self: Trainer, *args: Any, **kwargs: Any) -> Any:
        taken.append(self.global_step)
        return state_dict(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "state_dict", counted)

    class Slow(Plugin):
        """From the outage on, steps long enough for a failing upload to end, and for
        the background look-up to answer, before the next save falls due."""

        def setup(self, trainer: Any, stage: str) -> None:
            self.trainer = trainer

        @on(TrainBatchCompleted)
        async def _slow(self, event: Any) -> None:
            if self.trainer.global_step >= 4:
                await anyio.sleep(0.1)

    outage = Outage(holder, port, stop_at=4, restart_at=12)
    checkpoint = Checkpoint(
        url, storage_options=options, every_n_steps=2, upload_retries=0, save_on_end=False
    )
    with pytest.warns(UserWarning, match=r"cannot save to s3://.* now|saves to s3://.* resumed") as caught:
        await _fit(6, [outage, Slow(), checkpoint])
    messages = [str(w.message) for w in caught]
    assert len(messages) == 2, messages
    assert "nothing written" in messages[0] or "an upload failed" in messages[0]
    assert "resumed" in messages[1]
    # 12 saves fell due (every 2 steps of 24). After step 4's (whose upload failed),
    # while the store was down (to step 12), the state was taken for at most one (due
    # before that failure was known); once the store answered again, saves resumed.
    during = [step for step in taken if 4 < step <= 12]
    assert len(during) <= 1, taken
    assert any(step > 12 for step in taken), taken
    assert loopbus.latest_checkpoint(RemotePath(url, options)) == f"{url}/epoch=5-step=24.ckpt"


def holder_size(endpoint: str, options: dict[str, Any], url: str) -> int:
    import s3fs

    size: int = s3fs.S3FileSystem(skip_instance_cache=True, **options).size(url)
    return size


async def test_upload_errors_raise_stops_the_run(own_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_store, "BACKOFF", 0.05)
    holder, port, endpoint = own_server
    bucket = make_bucket(endpoint)
    url = f"s3://{bucket}/run"
    published = (S3(url, bucket, endpoint, options_for(endpoint)), "step=2.")
    outage = Outage(holder, port, stop_at=4, published=published)
    checkpoint = Checkpoint(
        url, storage_options=options_for(endpoint), every_n_steps=2, upload_retries=0, upload_errors="raise"
    )
    with pytest.raises(HandlerError, match=r"could not upload the checkpoint s3://.*epoch=0-step=4.ckpt"):
        await _fit(3, [outage, checkpoint])


# ---------------------------------------------------------------- reading URLs


async def test_load_checkpoint_info_and_load_from_checkpoint_on_urls(s3: S3) -> None:
    _, module = await _fit(1, [_remote(s3, every_n_epochs=1)])
    file = f"{s3.url}/epoch=0-step=4.ckpt"
    for path in (file, s3.url, f"{s3.url}/last.json"):
        state = loopbus.load_checkpoint(path, storage_options=s3.options)
        assert state["loopbus"]["global_step"] == 4
        assert torch.equal(state["module"]["layer.weight"], module.layer.weight)
    info = loopbus.checkpoint_info(file, storage_options=s3.options)
    assert info is not None
    assert info["global_step"] == 4
    assert info["size"] > 0
    assert loopbus.checkpoint_info(f"{s3.url}/nothing.ckpt", storage_options=s3.options) is None
    rebuilt = TinyModule.load_from_checkpoint(RemotePath(file, s3.options))
    assert torch.equal(rebuilt.layer.weight, module.layer.weight)
    # A corrupted object is refused by its marker, and the message names the URL.
    s3.fs.pipe_file(f"{s3.bucket}/run/epoch=0-step=4.ckpt", b"x" * info["size"])
    with pytest.raises(CheckpointError, match=rf"the checkpoint {file} is corrupted"):
        loopbus.load_checkpoint(file, storage_options=s3.options)
    with pytest.raises(CheckpointError, match=r"no checkpoint at s3://.*/elsewhere"):
        loopbus.load_checkpoint(f"s3://{s3.bucket}/elsewhere", storage_options=s3.options)


@pytest.mark.parametrize(
    ("url", "extra"), [("s3://bucket/run", "loopbus[s3]"), ("gs://bucket/run", "loopbus[gcs]")]
)
async def test_a_missing_package_is_named_with_its_extra(
    url: str, extra: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_store, "_available", lambda module: module not in ("s3fs", "gcsfs"))
    monkeypatch.chdir(tmp_path)
    calls = {
        "Checkpoint": lambda: Checkpoint(url),
        "load_checkpoint": lambda: loopbus.load_checkpoint(url),
        "checkpoint_info": lambda: loopbus.checkpoint_info(f"{url}/x.ckpt"),
        "load_from_checkpoint": lambda: TinyModule.load_from_checkpoint(url),
    }
    for call in calls.values():
        with pytest.raises(MisconfigurationError, match=re.escape(f"pip install '{extra}'")):
            call()
    trainer = Trainer(max_steps=1, plugins=[], device="cpu")
    with pytest.raises(MisconfigurationError, match=re.escape(f"pip install '{extra}'")):
        await trainer.fit(TinyModule(), make_loader(32, 16), ckpt_path=url)
    assert trainer.global_step == 0
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(_store, "_available", lambda module: module != "fsspec")
    with pytest.raises(MisconfigurationError, match=r"need fsspec.*" + re.escape(f"'{extra}'")):
        Checkpoint(url)


# ---------------------------------------------------------------- credentials


async def test_the_storage_options_secret_is_written_nowhere(s3: S3, tmp_path: Path) -> None:
    checkpoint = _remote(s3, every_n_steps=2, keep_last=None)
    assert SECRET not in repr(checkpoint)
    assert SECRET not in str(checkpoint.dirpath)
    await _fit(2, [checkpoint, JSONLLogger(tmp_path / "logs")])
    written = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files]
    assert written, "the logger wrote nothing"
    for path in written:
        with open(path, "rb") as file:  # noqa: ASYNC230
            assert SECRET.encode() not in file.read(), path
    fs = s3.fs
    keys = fs.find(s3.bucket)
    assert len(keys) > 3
    for key in keys:
        assert SECRET.encode() not in fs.cat_file(key), key
    state = loopbus.load_checkpoint(s3.url, storage_options=s3.options)
    assert SECRET not in repr(state)
