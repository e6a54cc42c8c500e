"""The one storage interface: a local directory and an fsspec store (``memory://``, in
this process) are both a :class:`~loopbus.storage.Storage`, chosen by ``store_for``, and
the search for the last checkpoint reads either alike."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from loopbus import CheckpointError, MisconfigurationError
from loopbus.checkpoint._locate import follow_pointer, latest
from loopbus.storage import (
    LocalStore,
    RemotePath,
    Storage,
    Store,
    located,
    open_location,
    store_for,
)


def _memory() -> RemotePath:
    pytest.importorskip("fsspec")
    return RemotePath(f"memory://loopbus-{uuid.uuid4().hex[:8]}/run")


def _fill(store: Storage) -> None:
    """Two checkpoints, the newer one torn (its marker records another size)."""
    for step, size in ((1, 4), (2, 9)):
        name = f"step={step}.ckpt"
        store.write(name, b"x" * 4)
        marker = {"size": size, "global_step": step, "created": float(step)}
        store.write(name + ".complete", json.dumps(marker).encode())


def test_store_for_tells_a_url_from_a_path(tmp_path: Path) -> None:
    local = store_for(tmp_path)
    assert isinstance(local, LocalStore)
    assert isinstance(local, Storage)
    assert local.renames
    assert local.noun == "file"
    remote = store_for(_memory())
    assert isinstance(remote, Store)
    assert isinstance(remote, Storage)
    assert not remote.renames
    assert remote.noun == "object"
    store, name = located(tmp_path / "a.ckpt")
    assert (store.directory, name) == (tmp_path, "a.ckpt")


@pytest.mark.parametrize("where", ["local", "memory"])
def test_latest_reads_either_store_alike(tmp_path: Path, where: str) -> None:
    store = store_for(tmp_path / "run" if where == "local" else _memory())
    if where == "local":
        (tmp_path / "run").mkdir()
    _fill(store)
    found, skipped = latest(store)
    assert found == "step=1.ckpt"
    assert skipped == [
        (
            "step=2.ckpt",
            "it has 4 bytes where its completeness marker records 9 (it is truncated or was "
            "modified)",
        )
    ]
    store.write("last.json", b'{"checkpoint": "../x.ckpt"}')
    with pytest.raises(ValueError, match="which is not a file name in its directory"):
        follow_pointer(store)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_the_folder_verbs_answer_alike_for_either_store(tmp_path: Path, where: str) -> None:
    store = store_for(tmp_path / "run" if where == "local" else _memory())
    store.make_directory()
    assert not store.exists("a.ckpt")
    store.write("a.ckpt", b"x")
    assert store.exists("a.ckpt")
    assert store.holds(store.path("a.ckpt"))
    assert not store.holds(store.below("inner").path("a.ckpt"))
    assert store.health is None
    assert store.shown == str(store.directory)
    staged = store.staging_name("b")
    # Staged under a temporary name where a rename publishes; in place otherwise.
    assert (staged != "b") if store.renames else (staged == "b")
    assert store.remove_stale_temporaries() == []


@pytest.mark.parametrize("where", ["local", "memory"])
def test_dcp_writer_and_reader_round_trip_either_store(tmp_path: Path, where: str) -> None:
    import torch
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    store = store_for(tmp_path / "run" if where == "local" else _memory())
    store.make_directory()
    state = {"w": torch.arange(4.0)}
    _save_state_dict(state, storage_writer=store.dcp_writer("shards"), no_dist=True)
    back = {"w": torch.zeros(4)}

    class Mixin:
        pass

    reader = store.dcp_reader("shards", mixin=Mixin)
    assert isinstance(reader, Mixin)
    _load_state_dict(back, storage_reader=reader, no_dist=True)
    assert torch.equal(back["w"], state["w"])


@pytest.mark.parametrize("where", ["local", "memory"])
def test_directories_and_unmarked_entries_answer_alike(tmp_path: Path, where: str) -> None:
    store = store_for(tmp_path / "run" if where == "local" else _memory())
    store.make_directory()
    store.write("a.ckpt", b"x")
    store.below("inner").write("shard", b"y")
    assert store.is_directory("inner")
    assert not store.is_directory("a.ckpt")
    assert not store.is_directory("missing")
    # Whole without a marker where a rename publishes; only by its marker otherwise.
    assert store.whole_without_marker() == (where == "local")


def test_open_location_tells_a_url_from_a_path(tmp_path: Path) -> None:
    assert open_location(tmp_path, owner="Checkpoint") == tmp_path
    remote = open_location(
        "memory://bucket/run", store_deadlines={"call_s": 5.0}, owner="Checkpoint"
    )
    assert isinstance(remote, RemotePath)
    assert remote.deadlines.call_s == 5.0
    assert remote.health is not None  # its calls are watched
    with pytest.raises(MisconfigurationError, match=r"Checkpoint\(storage_options=...\) "
                       r"applies to a URL dirpath such as 's3://bucket/run'; '.*' is a local"):
        open_location(tmp_path, storage_options={}, owner="Checkpoint")
    with pytest.raises(MisconfigurationError, match=r"Checkpoint\(dirpath=...\) must be a "):
        open_location("", owner="Checkpoint")
    with pytest.raises(MisconfigurationError, match=r"must be a dict of fsspec storage"):
        open_location("memory://b/run", storage_options=["key"], owner="Checkpoint")  # type: ignore[arg-type]


def test_a_missing_url_says_so_and_a_folder_names_what_it_skipped() -> None:
    from loopbus.checkpoint._locate import resolve_checkpoint

    directory = _memory()
    store = store_for(directory)
    _fill(store)
    with pytest.warns(UserWarning, match=r"step=2\.ckpt: it has 4 bytes"):
        assert resolve_checkpoint(directory) == directory / "step=1.ckpt"
    assert resolve_checkpoint(directory / "step=2.ckpt") == directory / "step=2.ckpt"
    with pytest.raises(CheckpointError, match=r"the object does not exist\. Checkpoints in "
                       r".*: step=1\.ckpt, step=2\.ckpt"):
        resolve_checkpoint(directory / "nope.ckpt")
    store.remove("step=1.ckpt.complete")
    with pytest.raises(
        CheckpointError,
        match=r"no checkpoint in the directory .*Skipped as not complete: step=2\.ckpt: it "
        r"has 4 bytes.*It holds step=1\.ckpt without completeness markers",
    ):
        resolve_checkpoint(directory)
