"""Sharded checkpoints (torch.distributed.checkpoint) in one process: the directory
format, its completeness marker, ``last``/``best`` resolution, ``keep_last`` on
directories, stale temporaries, consolidation, and bad input. The multi-rank behaviour
(asynchronous saves under DDP, kill -9, resume at another world size) is in
``tests/distributed/test_sharded.py``."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import loopbus
from loopbus import CheckpointError, Trainer
from loopbus.checkpoint._format import SHARDED_MARKER, SHARDED_STATE
from loopbus.plugins import Checkpoint
from loopbus.storage import host_tag as _host_tag
from tests.ckpt_scenario import Net, make_data

DEAD_PID = 999_999_999
N_TRAIN = 64
BATCH = 8  # 8 steps an epoch


def _fit(
    directory: Path,
    *,
    epochs: int = 2,
    resume: str | Path | None = None,
    module: Net | None = None,
    **options: Any,
) -> tuple[Trainer, Net]:
    loopbus.seed_everything(5)
    net = module if module is not None else Net()
    train, val = make_data("plain", n_train=N_TRAIN, batch=BATCH)
    options.setdefault("every_n_steps", 4)
    plugin = Checkpoint(directory, sharded=True, **options)
    trainer = Trainer(max_epochs=epochs, plugins=[plugin], device="cpu")
    loopbus.run(trainer.fit, net, train, val, ckpt_path=resume)
    return trainer, net


def _dirs(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_dir())


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A finished single-process run with sharded checkpoints every 4 steps (keep 2)."""
    directory = tmp_path_factory.mktemp("sharded") / "ckpt"
    trainer, net = _fit(directory, keep_last=2)
    final = {
        "module": {k: v.clone() for k, v in net.state_dict().items()},
        "optimizer": trainer.optimizers[0].state_dict(),
    }
    return directory, final


def test_a_sharded_checkpoint_is_a_complete_directory(saved: tuple[Path, dict[str, Any]]) -> None:
    directory, _ = saved
    # keep_last=2 removed whole directories; the pointer names the newest: the end-of-fit
    # save, which took a name of its own after the periodic save of the same step.
    assert _dirs(directory) == ["epoch=1-step=16-v1.ckpt", "epoch=1-step=16.ckpt"]
    last = loopbus.latest_checkpoint(directory)
    assert last == directory / "epoch=1-step=16-v1.ckpt"
    info = json.loads((last / SHARDED_MARKER).read_text())
    assert info["layout"] == "sharded"
    assert (info["global_step"], info["world_size"], info["strategy"]) == (16, 1, "single")
    assert info["files"] == {
        p.name: p.stat().st_size for p in last.iterdir() if p.name != SHARDED_MARKER
    }
    assert {".metadata", SHARDED_STATE} <= set(info["files"])
    assert loopbus.is_sharded_checkpoint(last)
    assert not loopbus.is_sharded_checkpoint(directory)


def test_consolidated_equals_the_run_and_loads_weights_only(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    directory, final = saved
    last = directory / "epoch=1-step=16-v1.ckpt"  # saved when fit ended
    out = loopbus.consolidate_checkpoint(last, tmp_path / "full.ckpt")
    state = torch.load(out, weights_only=True)
    assert state["loopbus"]["layout"] == "consolidated"
    assert state["module"].keys() == final["module"].keys()
    assert all(torch.equal(state["module"][k], v) for k, v in final["module"].items())
    optimizer = state["optimizers/0"]
    assert optimizer["class"] == "torch.optim.sgd.SGD"
    saved_opt, live_opt = optimizer["state_dict"], final["optimizer"]
    assert saved_opt["param_groups"] == live_opt["param_groups"]
    assert saved_opt["state"].keys() == live_opt["state"].keys()
    for index, entry in live_opt["state"].items():
        assert torch.equal(saved_opt["state"][index]["momentum_buffer"], entry["momentum_buffer"])
    # The same dict from load_checkpoint and, for the weights, load_from_checkpoint.
    again = loopbus.load_checkpoint(last)
    assert all(torch.equal(again["module"][k], v) for k, v in final["module"].items())
    net = Net.load_from_checkpoint(last)
    assert all(torch.equal(net.state_dict()[k], v) for k, v in final["module"].items())
    # A consolidated file resumes a single-process run like any checkpoint file.
    assert loopbus.load_checkpoint(out)["run"] == state["run"]


def test_consolidation_overwrites_nothing(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    directory, _ = saved
    existing = tmp_path / "full.ckpt"
    existing.write_bytes(b"mine")
    with pytest.raises(CheckpointError, match="will not overwrite"):
        loopbus.consolidate_checkpoint(directory / "epoch=1-step=16.ckpt", existing)
    assert existing.read_bytes() == b"mine"


# One process, a plain loader: the resumed epoch skips its consumed batches by iterating.
@pytest.mark.filterwarnings("ignore:resuming mid-epoch by skipping")
@pytest.mark.parametrize("at", [4, 12], ids=["mid-first-epoch", "mid-second-epoch"])
def test_resume_from_a_sharded_checkpoint_is_exact(tmp_path: Path, at: int) -> None:
    full_trainer, full = _fit(tmp_path / "full", keep_last=None)
    name = f"epoch={at // 8}-step={at}.ckpt"
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(tmp_path / "full" / name, resumed_dir / name)
    trainer, resumed = _fit(resumed_dir, resume="last")
    assert trainer.global_step == full_trainer.global_step == 16
    for key, value in full.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key
    a, b = full_trainer.optimizers[0].state_dict(), trainer.optimizers[0].state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert all(
        torch.equal(a["state"][i]["momentum_buffer"], b["state"][i]["momentum_buffer"])
        for i in a["state"]
    )


def test_incomplete_and_temporary_directories_are_never_picked(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    _fit(directory, epochs=1, keep_last=None)
    assert _dirs(directory) == [
        "epoch=0-step=4.ckpt",
        "epoch=0-step=8-v1.ckpt",
        "epoch=0-step=8.ckpt",
    ]
    newest = directory / "epoch=0-step=8-v1.ckpt"
    # A newer directory without its marker (an interrupted save), and a temporary.
    torn = directory / "epoch=0-step=9.ckpt"
    shutil.copytree(newest, torn)
    (torn / SHARDED_MARKER).unlink()
    (directory / "last.json").unlink()
    skipped = r"epoch=0-step=9\.ckpt: it has no completeness marker loopbus\.complete"
    with pytest.warns(UserWarning, match=skipped):
        assert loopbus.latest_checkpoint(directory) == newest
    with pytest.raises(CheckpointError, match=r"incomplete: it has no completeness marker"):
        loopbus.load_checkpoint(torn)
    # "last" resolves to the complete one.
    with pytest.warns(UserWarning, match=skipped):
        trainer, _ = _fit(directory, epochs=2, resume="last", keep_last=None)
    assert trainer.global_step == 16


def test_stale_temporary_directories_are_removed(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    stale = directory / f".epoch=0-step=4.ckpt.tmp-{DEAD_PID}-abcd1234@{_host_tag()}"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"partial")
    live = directory / f".epoch=0-step=4.ckpt.tmp-1-abcd1234@{_host_tag()}"  # pid 1 runs
    live.mkdir()
    _fit(directory, epochs=1)
    assert not stale.exists()
    assert live.exists()


def test_evicting_a_linked_checkpoint_leaves_the_original_complete(tmp_path: Path) -> None:
    # Another run's checkpoint linked into a directory and resumed from there: once
    # keep_last evicts it, the link goes, but the original (the one its own directory's
    # last.json names) keeps its marker and every file.
    source = tmp_path / "source"
    _fit(source, epochs=1, keep_last=2)
    original = loopbus.latest_checkpoint(source)
    assert original == source / "epoch=0-step=8-v1.ckpt"
    files = sorted(p.name for p in original.iterdir())
    assert SHARDED_MARKER in files
    directory = tmp_path / "ckpt"
    directory.mkdir()
    link = directory / original.name
    link.symlink_to(original, target_is_directory=True)
    # Resumed for 2 more epochs: the saves at steps 12 and 16 evict the linked one.
    trainer, _ = _fit(directory, epochs=3, resume=link, keep_last=2)
    assert trainer.global_step == 24
    assert not os.path.lexists(link)
    assert sorted(p.name for p in original.iterdir()) == files
    assert loopbus.latest_checkpoint(source) == original  # no warning: still complete
    # Removed directly, too: the link only.
    link.symlink_to(original, target_is_directory=True)
    loopbus.remove_checkpoint(link)
    assert not os.path.lexists(link)
    assert sorted(p.name for p in original.iterdir()) == files


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_damaged_shard_is_refused_naming_the_file(tmp_path: Path, damage: str) -> None:
    directory = tmp_path / "ckpt"
    _fit(directory, epochs=1)
    last = loopbus.latest_checkpoint(directory)
    assert last is not None
    shard = last / "__0_0.distcp"
    if damage == "missing":
        shard.unlink()
        match = f"missing its file {shard}"
    else:
        with open(shard, "r+b") as file:
            file.truncate(shard.stat().st_size // 2)
        match = f"the file {shard} of the sharded checkpoint .* is truncated"
    with pytest.raises(CheckpointError, match=match):
        loopbus.load_checkpoint(last)
    with pytest.raises(CheckpointError, match=match):
        _fit(directory, epochs=2, resume=last)


def test_a_foreign_directory_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "weights"
    foreign.mkdir()
    (foreign / ".metadata").write_bytes(b"not ours")
    with pytest.raises(CheckpointError, match=r"is not a loopbus checkpoint|no completeness"):
        loopbus.load_checkpoint(foreign)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="no checkpoint in the directory"):
        loopbus.load_checkpoint(plain)


def test_another_model_is_refused_before_anything_loads(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    _fit(directory, epochs=1)
    wider = Net(hidden=16)
    before = {k: v.clone() for k, v in wider.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"'net\.0\.weight' has shape \(32, 4\)"):
        _fit(directory, epochs=2, resume="last", module=wider)
    assert all(torch.equal(wider.state_dict()[k], v) for k, v in before.items())


def test_pickled_objects_in_the_shards_are_refused(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

    target = tmp_path / "evil"
    evil = {"module": {"w": torch.ones(2)}, "extra": Path("x")}
    _save_state_dict(evil, storage_writer=FileSystemWriter(target), no_dist=True)
    good = tmp_path / "good.ckpt"
    directory = tmp_path / "ckpt"
    _fit(directory, epochs=1)
    last = loopbus.latest_checkpoint(directory)
    assert last is not None
    shutil.copytree(last, good)
    for name in os.listdir(target):
        shutil.copy(target / name, good / name)
    info = json.loads((good / SHARDED_MARKER).read_text())
    info["files"] = {p.name: p.stat().st_size for p in good.iterdir() if p.name != SHARDED_MARKER}
    (good / SHARDED_MARKER).write_text(json.dumps(info))
    with pytest.raises(CheckpointError, match="refusing the entry 'extra'"):
        loopbus.load_checkpoint(good)


def test_the_consolidate_command(
    saved: tuple[Path, dict[str, Any]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from loopbus.__main__ import main

    directory, final = saved
    out = tmp_path / "full.ckpt"
    assert main(["consolidate", str(directory / "epoch=1-step=16.ckpt"), str(out)]) == 0
    state = torch.load(out, weights_only=True)
    assert all(torch.equal(state["module"][k], v) for k, v in final["module"].items())
    assert main(["consolidate", str(directory / "epoch=1-step=16.ckpt"), str(out)]) == 1
    assert "will not overwrite" in capsys.readouterr().err


def test_best_and_last_resolve_to_complete_directories(tmp_path: Path) -> None:
    loopbus.seed_everything(5)
    net = Net()
    train, val = make_data("plain", n_train=N_TRAIN, batch=BATCH)
    best = Checkpoint(tmp_path / "best", sharded=True, monitor="val/loss", keep_best=1)
    trainer = Trainer(max_epochs=3, plugins=[best], device="cpu")
    loopbus.run(trainer.fit, net, train, val)
    path = best.best_checkpoint_path
    assert path is not None
    assert (path / SHARDED_MARKER).is_file()
    expected = loopbus.load_checkpoint(path)["module"]
    # Weights only, from the consolidated best checkpoint.
    torch.nn.init.zeros_(net.net[0].weight)
    loopbus.run(trainer.validate, net, val, ckpt_path="best")
    assert all(torch.equal(net.state_dict()[k], v) for k, v in expected.items())
    loopbus.run(trainer.validate, net, val, ckpt_path="last")
    last = loopbus.latest_checkpoint(tmp_path / "best")
    assert last is not None
    assert last.is_dir()
