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
    with pytest.raises(
        MisconfigurationError,
        match=r"Checkpoint\(storage_options=...\) "
        r"applies to a URL dirpath such as 's3://bucket/run'; '.*' is a local",
    ):
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
    with pytest.raises(
        CheckpointError,
        match=r"the object does not exist\. Checkpoints in "
        r".*: step=1\.ckpt, step=2\.ckpt",
    ):
        resolve_checkpoint(directory / "nope.ckpt")
    store.remove("step=1.ckpt.complete")
    with pytest.raises(
        CheckpointError,
        match=r"no checkpoint in the directory .*Skipped as not complete: step=2\.ckpt: it "
        r"has 4 bytes.*It holds step=1\.ckpt without completeness markers",
    ):
        resolve_checkpoint(directory)


# ---------------------------------------------------------------- completing a sharded checkpoint


def _store_at(tmp_path: Path, where: str) -> Storage:
    store = store_for(tmp_path / "run" if where == "local" else _memory())
    store.make_directory()
    return store


def _shards(store: Storage, name: str) -> str:
    """The directory where ``name``'s shards are written (staged), with one shard in it."""
    staged = store.staging_name(name)
    store.below(staged).write("__0_0.distcp", b"s" * 5)
    return staged


def _complete(store: Storage, staged: str, name: str = "a.ckpt", **given: object) -> dict:
    options: dict = {
        "plain": "state.pt",
        "write_plain": lambda f: f.write(b"p" * 3),
        "marker": "done.json",
        "info": {"global_step": 3},
    }
    options.update(given)
    return store.complete_sharded(staged, name, **options)


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_completed_sharded_checkpoint_has_a_marker_of_its_files(
    tmp_path: Path, where: str
) -> None:
    store = _store_at(tmp_path, where)
    staged = _shards(store, "a.ckpt")
    record = _complete(store, staged)
    files = {"__0_0.distcp": 5, "state.pt": 3}
    assert record == {"global_step": 3, "checkpoint": "a.ckpt", "files": files}
    inside = store.below("a.ckpt")
    assert json.loads(inside.read_small("done.json")) == record
    assert inside.listing() == {**files, "done.json": len(inside.read_small("done.json"))}
    assert store.contents() == ({}, {"a.ckpt"})  # its staging directory renamed, if any
    # Without a plain state to write, only what is there is listed.
    staged = _shards(store, "b.ckpt")
    record = _complete(store, staged, "b.ckpt", write_plain=None)
    assert record["files"] == {"__0_0.distcp": 5}


def test_an_object_store_completes_a_checkpoint_only_in_place() -> None:
    store = store_for(_memory())
    with pytest.raises(ValueError, match=r"writes 'a\.ckpt' in place, not as '\.a\.tmp'"):
        _complete(store, ".a.tmp")


def test_a_local_completion_replaces_a_directory_of_that_name(tmp_path: Path) -> None:
    store = _store_at(tmp_path, "local")
    store.below("a.ckpt").write("old", b"o")
    _complete(store, _shards(store, "a.ckpt"))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["a.ckpt"]  # none aside
    assert sorted(store.below("a.ckpt").listing()) == ["__0_0.distcp", "done.json", "state.pt"]


@pytest.mark.parametrize("moved_back", [True, False], ids=["moved-back", "left-aside"])
def test_a_failed_local_rename_puts_the_old_directory_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, moved_back: bool
) -> None:
    import os

    from loopbus.storage import CompletionFailed

    store = _store_at(tmp_path, "local")
    store.below("a.ckpt").write("old", b"o")
    staged = _shards(store, "a.ckpt")
    real = os.replace
    target = str(tmp_path / "run" / "a.ckpt")

    def replace(src: object, dst: object) -> None:
        if str(src) == str(store.path(staged)) or (not moved_back and str(dst) == target):
            raise OSError(28, "No space left on device")
        real(src, dst)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(CompletionFailed) as caught:
        _complete(store, staged)
    failed = caught.value
    assert (failed.entry, failed.staged, failed.removed) == (None, True, store.path(staged))
    assert isinstance(failed.cause, OSError)
    left = sorted(p.name for p in (tmp_path / "run").iterdir())
    if moved_back:
        assert failed.aside is None
        assert left == ["a.ckpt"]
        assert store.below("a.ckpt").listing() == {"old": 1}
    else:
        assert failed.aside is not None
        assert left == [failed.aside.name]  # the staging directory is removed
        assert (failed.aside / "old").read_bytes() == b"o"


@pytest.mark.parametrize("failing", ["state.pt", "done.json"])
@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_failed_completion_leaves_nothing_half_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str, failing: str
) -> None:
    from loopbus.storage import CompletionFailed

    store = _store_at(tmp_path, where)
    if store.renames:  # one of that name stays as it was
        store.below("a.ckpt").write("old", b"o")
    staged = _shards(store, "a.ckpt")
    real = type(store).write

    def write(self: Storage, name: str, data: bytes) -> None:
        if name == failing:
            raise OSError(28, "No space left on device")
        real(self, name, data)  # type: ignore[arg-type]

    def write_plain(file: object) -> None:
        if failing == "state.pt":
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(store), "write", write)
    with pytest.raises(CompletionFailed) as caught:
        _complete(store, staged, write_plain=write_plain)
    failed = caught.value
    assert failed.entry == failing
    assert failed.staged == store.renames
    assert failed.removed == store.path(staged)
    assert failed.aside is None
    assert str(failed.cause) == "[Errno 28] No space left on device"
    if store.renames:
        assert store.contents() == ({}, {"a.ckpt"})
        assert store.below("a.ckpt").listing() == {"old": 1}
    else:
        assert store.contents() == ({}, set())
