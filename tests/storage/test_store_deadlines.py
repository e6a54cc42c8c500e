"""Every store call under a deadline: a store that accepts connections and stops reading
(a TCP proxy in front of moto's S3 server, switched to stall) holds neither an upload
nor the training step; the stalled call is abandoned at ``call_s`` and tried again, a
save due meanwhile is skipped after ``save_wait_s`` with a warning naming the store and
the wait, and once the store reads again the saves succeed and the run resumes. A store
out of reach at the start of ``fit`` is a ``CheckpointError`` naming the URL; bad
deadlines are refused with a ``MisconfigurationError``."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import loopbus
from loopbus import (
    CheckpointError,
    HandlerError,
    MisconfigurationError,
    Plugin,
    RemotePath,
    StoreDeadlines,
    Trainer,
    on,
)
from loopbus.events import TrainBatchCompleted
from loopbus.plugins import Checkpoint
from loopbus.storage import Store, _store
from tests.helpers import TinyModule, load_benchmark, make_loader

from .conftest import free_port, make_bucket, options_for

PER_EPOCH = 4  # make_loader(64, 16)


#: A TCP proxy on 127.0.0.1 in front of the S3 server; while its ``stalled`` is set it
#: acts as a store that stops reading (the checkpoint benchmark's, shared).
StallProxy = load_benchmark("checkpoint").StallingProxy


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[StallProxy]:
    import s3fs

    host, port = s3_endpoint.removeprefix("http://").split(":")
    s3fs.S3FileSystem.clear_instance_cache()
    stall = StallProxy((host, int(port)))
    yield stall
    stall.close()
    s3fs.S3FileSystem.clear_instance_cache()


class Stall(Plugin):
    """Stalls the proxy at step ``since`` and lets it read again at step ``until``; every
    step takes ``pause`` seconds at least. Records the time between the steps that end
    while the proxy is stalled."""

    def __init__(self, proxy: StallProxy, since: int, until: int, pause: float) -> None:
        self.proxy, self.since, self.until, self.pause = proxy, since, until, pause
        self.gaps: list[float] = []
        self.last: float | None = None
        self.trainer: Any = None

    def setup(self, trainer: Any, stage: str) -> None:
        self.trainer = trainer

    @on(TrainBatchCompleted)
    async def _step(self, event: TrainBatchCompleted) -> None:
        step, now = self.trainer.global_step, time.monotonic()
        if self.proxy.stalled.is_set() and self.last is not None:
            self.gaps.append(now - self.last)
        self.last = now
        if step == self.since:
            self.proxy.stalled.set()
        if step == self.until:
            self.proxy.stalled.clear()
        await anyio.sleep(self.pause)


class Count(Plugin):
    def __init__(self) -> None:
        self.batches = 0

    @on(TrainBatchCompleted)
    def _count(self, event: TrainBatchCompleted) -> None:
        self.batches += 1


async def _fit(epochs: int, plugins: list[Plugin], ckpt_path: Any = None) -> Trainer:
    loopbus.seed_everything(3)
    trainer = Trainer(max_epochs=epochs, plugins=plugins, device="cpu")
    await trainer.fit(TinyModule(), make_loader(64, 16), ckpt_path=ckpt_path)
    return trainer


# ---------------------------------------------------------------- a stalled store


async def test_a_stalled_store_holds_neither_the_upload_nor_the_step(
    proxy: StallProxy, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_store, "BACKOFF", 0.05)
    bucket = make_bucket(s3_endpoint)
    url = f"s3://{bucket}/run"
    deadlines = StoreDeadlines(connect_s=2, read_s=2, call_s=2, save_wait_s=0.25)
    retries, pause, epochs = 1, 0.1, 8
    # The upload after step 3 stalls; its first call is abandoned at 2 s, its second
    # (begun before the proxy reads again at step 16) too. The saves due meanwhile are
    # skipped.
    stall = Stall(proxy, since=3, until=16, pause=pause)
    checkpoint = Checkpoint(
        url,
        storage_options=options_for(proxy.endpoint),
        store_deadlines=deadlines,
        every_n_steps=2,
        upload_retries=retries,
        save_on_end=False,
    )
    started = time.monotonic()
    with pytest.warns(UserWarning, match="cannot save to|saves to .* resumed") as caught:
        await _fit(epochs, [stall, checkpoint])
    took = time.monotonic() - started
    messages = [str(w.message) for w in caught]

    # Generous: every step's pause and wait, and the stalled upload's tries, many times.
    steps = epochs * PER_EPOCH
    limit = 3 * (steps * (pause + deadlines.save_wait_s) + (retries + 1) * deadlines.call_s) + 10
    assert took < limit, (took, limit)
    # No step waited for a stalled call.
    assert stall.gaps
    assert max(stall.gaps) < deadlines.call_s, stall.gaps

    # The outage is said once, when the first due save is skipped (not at every skip nor
    # at the failed upload), with its cause and how long it has lasted, and once more when
    # saves succeed again. (The upload in flight when the proxy stalls may still end
    # well: that is an outage of its own, said alike.)
    kinds = ["down" if "cannot save to" in m else "back" for m in messages]
    assert kinds[-2:] == ["down", "back"], "\n".join(messages)
    assert kinds == ["down", "back"] * (len(kinds) // 2), "\n".join(messages)
    assert len(kinds) <= 4, "\n".join(messages)
    down, back = messages[-2:]
    assert down.startswith(f"Checkpoint cannot save to {url} now: the save due at step ")
    assert "the previous upload is still in flight after" in down
    assert "save_wait_s=0.25): the store may be stalled" in down
    assert "(failing for " in down
    assert back.startswith(f"Checkpoint saves to {url} resumed: the store answers again after")
    assert "upload(s) failed meanwhile" in back

    # Once the store reads again the saves succeed: the last one is the last step's ...
    direct = RemotePath(url, options_for(s3_endpoint))
    last = loopbus.latest_checkpoint(direct)
    assert last == f"{url}/epoch={epochs - 1}-step={steps}.ckpt"
    # ... and the run resumes from it.
    count = Count()
    plugins: list[Plugin] = [count, Checkpoint(direct, every_n_steps=2)]
    with pytest.warns(UserWarning, match="resuming mid-epoch"):  # saved at its last step
        resumed = await _fit(epochs + 1, plugins, ckpt_path="last")
    assert count.batches == PER_EPOCH
    assert resumed.global_step == steps + PER_EPOCH


# ---------------------------------------------------------------- at the start of fit


async def test_a_store_out_of_reach_at_fit_start_is_a_checkpoint_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("s3fs")
    monkeypatch.setattr(_store, "BACKOFF", 0.01)
    url = "s3://loopbus-nowhere/run"
    options = options_for(f"http://127.0.0.1:{free_port()}")  # nothing listens there

    def checkpoint() -> Checkpoint:
        return Checkpoint(url, storage_options=options, store_deadlines={"call_s": 5})

    # Resuming: "last" is looked up before anything runs.
    with pytest.raises(CheckpointError) as info:
        await _fit(1, [checkpoint()], ckpt_path="last")
    message = str(info.value)
    assert f"cannot list {url} (3 tries): EndpointConnectionError" in message
    assert "check the endpoint (storage options' client_kwargs endpoint_url" in message
    assert "\n" not in message
    # A new run: the folder's first look (at FitStarted) says the same.
    with pytest.raises(HandlerError) as caught:
        await _fit(1, [checkpoint()])
    original = caught.value.original
    assert isinstance(original, CheckpointError)
    assert url in str(original)
    assert "EndpointConnectionError" in str(original)


# ---------------------------------------------------------------- the option


@pytest.mark.parametrize("bad", [0, -1, float("nan"), float("inf"), 1e9, True, "5", None])
def test_bad_deadlines_are_refused(bad: object) -> None:
    with pytest.raises(
        MisconfigurationError,
        match=r"StoreDeadlines\(call_s=\.\.\.\) must be a number of seconds in \(0, 86400.0\]",
    ):
        StoreDeadlines(call_s=bad)  # type: ignore[arg-type]


def test_the_deadlines_option_of_checkpoint(tmp_path: Path) -> None:
    pytest.importorskip("fsspec")
    with pytest.raises(
        MisconfigurationError,
        match=r"store_deadlines=\.\.\.\) has no deadline 'timeout'; its deadlines are connect_s, read_s, call_s, save_wait_s",
    ):
        Checkpoint("memory://run", store_deadlines={"timeout": 3})
    with pytest.raises(
        MisconfigurationError, match=r"must be a loopbus.StoreDeadlines or a dict of its fields"
    ):
        Checkpoint("memory://run", store_deadlines=5)  # type: ignore[arg-type]
    with pytest.raises(MisconfigurationError, match=r"StoreDeadlines\(read_s=\.\.\.\) must be"):
        Checkpoint("memory://run", store_deadlines={"read_s": -2})
    with pytest.raises(
        MisconfigurationError,
        match=r"Checkpoint\(store_deadlines=\.\.\.\) applies to a URL dirpath",
    ):
        Checkpoint(tmp_path, store_deadlines={"call_s": 5})
    checkpoint = Checkpoint("memory://run", store_deadlines={"call_s": 5})
    dirpath = checkpoint.dirpath
    assert isinstance(dirpath, RemotePath)
    assert dirpath.deadlines == StoreDeadlines(call_s=5)
    # The deadlines go wherever the URL goes.
    assert (dirpath / "x.ckpt").parent.deadlines.call_s == 5
    assert _store.remote_path(dirpath, {"key": "k"}).deadlines.call_s == 5
    assert RemotePath("memory://run").deadlines == StoreDeadlines()


def test_messages_show_the_url_without_credentials() -> None:
    assert RemotePath("ftp://user:pw@host/run").public_url == "ftp://host/run"
    assert RemotePath("s3://bucket/run@x").public_url == "s3://bucket/run@x"


def test_s3_calls_have_botocores_timeouts_and_no_retries_of_their_own() -> None:
    pytest.importorskip("s3fs")
    options = options_for("http://127.0.0.1:1")
    store = Store(RemotePath("s3://bucket/run", options, StoreDeadlines(connect_s=3, read_s=4)))
    config = store.fs.config_kwargs
    assert (config["connect_timeout"], config["read_timeout"]) == (3, 4)
    assert config["retries"] == {"total_max_attempts": 1}
    assert store.fs.retries == 1


def test_a_call_past_its_deadline_is_abandoned_and_tried_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("fsspec")
    monkeypatch.setattr(_store, "BACKOFF", 0.01)
    store = Store(RemotePath("memory://deadlines/run", deadlines={"call_s": 0.2}), retries=2)
    release = threading.Event()
    calls: list[str] = []

    def hang(path: str, data: bytes, **kwargs: Any) -> None:  # a blocking backend stalled
        calls.append(path)
        release.wait(30)

    monkeypatch.setattr(store.fs, "pipe_file", hang)
    started = time.monotonic()
    try:
        with pytest.raises(CheckpointError) as info:
            store.write("x.json", b"{}")
    finally:
        release.set()
    assert time.monotonic() - started < 10
    assert len(calls) == 3
    assert str(info.value).startswith(
        "cannot write memory://deadlines/run/x.json (3 tries): no answer within 0.2 s"
    )
