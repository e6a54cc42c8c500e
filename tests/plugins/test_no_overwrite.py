"""No silent overwrite: a ``Checkpoint`` refuses a folder holding another run's
checkpoints (unless the run resumes from them or ``exist_ok=True``), and the file
loggers write each run into its own ``name/version_N`` folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import loopbus
from loopbus import HandlerError, MisconfigurationError, Plugin, Trainer
from loopbus.plugins import (
    Checkpoint,
    CSVLogger,
    JSONLLogger,
    TensorBoardLogger,
    read_csv,
    read_run_info,
)
from tests.ckpt_scenario import Net, make_data


def build(*plugins: Plugin, max_epochs: int = 1) -> tuple[Trainer, Net, Any]:
    loopbus.seed_everything(3)
    train, _ = make_data("plain", n_train=32, batch=8)
    return Trainer(plugins=list(plugins), device="cpu", max_epochs=max_epochs), Net(), train


def ckpt_names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.glob("*.ckpt"))


def snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(directory.rglob("*"))
    }


async def refused(trainer: Trainer, *args: Any, **kwargs: Any) -> str:
    """Run ``fit``; return the message of the MisconfigurationError it was refused with
    (raised by the plugin's FitStarted handler, so wrapped as a HandlerError)."""
    with pytest.raises(HandlerError) as info:
        await trainer.fit(*args, **kwargs)
    assert isinstance(info.value.original, MisconfigurationError)
    return str(info.value.original)


async def first_run(directory: Path, **options: Any) -> None:
    trainer, net, train = build(Checkpoint(directory, **options))
    await trainer.fit(net, train)


# ---------------------------------------------------------------- Checkpoint: refused


async def test_a_folder_holding_another_runs_checkpoints_is_refused(tmp_path: Path) -> None:
    await first_run(tmp_path)
    (tmp_path / ".stale.tmp-1-x@elsewhere").write_bytes(b"")  # left alone by a refusal
    before = snapshot(tmp_path)
    trainer, net, train = build(Checkpoint(tmp_path))
    message = await refused(trainer, net, train)
    assert str(tmp_path) in message
    for part in ("1 checkpoint(s)", "epoch=0-step=4.ckpt", "ckpt_path='last'", "exist_ok=True"):
        assert part in message
    assert "another folder" in message
    assert snapshot(tmp_path) == before  # nothing written, nothing removed


async def test_a_pointer_alone_is_refused(tmp_path: Path) -> None:
    (tmp_path / "last.json").write_text("{}")
    trainer, net, train = build(Checkpoint(tmp_path))
    assert "(newest: last.json)" in await refused(trainer, net, train)


async def test_a_sharded_checkpoint_directory_is_refused(tmp_path: Path) -> None:
    shard = tmp_path / "epoch=0-step=4.ckpt"
    shard.mkdir()
    (shard / "loopbus.complete").write_text("{}")
    trainer, net, train = build(Checkpoint(tmp_path))
    assert "1 checkpoint(s)" in await refused(trainer, net, train)


async def test_resuming_from_a_checkpoint_elsewhere_is_refused(tmp_path: Path) -> None:
    await first_run(tmp_path / "a")
    await first_run(tmp_path / "b", filename="b-{step}")
    source = loopbus.latest_checkpoint(tmp_path / "a")
    trainer, net, train = build(Checkpoint(tmp_path / "b"), max_epochs=2)
    assert "another run" in await refused(trainer, net, train, ckpt_path=source)


# ---------------------------------------------------------------- Checkpoint: allowed


async def test_exist_ok_adds_to_the_folder(tmp_path: Path) -> None:
    await first_run(tmp_path)
    await first_run(tmp_path, exist_ok=True)
    assert ckpt_names(tmp_path) == ["epoch=0-step=4-v1.ckpt", "epoch=0-step=4.ckpt"]
    assert loopbus.latest_checkpoint(tmp_path) == tmp_path / "epoch=0-step=4-v1.ckpt"


@pytest.mark.parametrize("how", ["last", "inside"])
async def test_resuming_from_the_folder_is_allowed(tmp_path: Path, how: str) -> None:
    await first_run(tmp_path)
    checkpoint = Checkpoint(tmp_path)
    trainer, net, train = build(checkpoint, max_epochs=2)
    path = "last" if how == "last" else str(loopbus.latest_checkpoint(tmp_path))
    await trainer.fit(net, train, ckpt_path=path)
    assert trainer.global_step == 8
    assert (tmp_path / "epoch=1-step=8.ckpt").exists()


async def test_a_second_fit_with_the_same_plugin_is_allowed(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path, keep_last=None)
    trainer, net, train = build(checkpoint)
    await trainer.fit(net, train)
    first = ckpt_names(tmp_path)
    await trainer.fit(net, train)  # not refused: this plugin wrote what the folder holds
    assert first
    assert set(first) <= set(ckpt_names(tmp_path))


async def test_a_missing_empty_or_unrelated_folder_is_allowed(tmp_path: Path) -> None:
    await first_run(tmp_path / "missing" / "deeper")
    (tmp_path / "empty").mkdir()
    await first_run(tmp_path / "empty")
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("not a checkpoint")
    (other / "metrics.csv").write_text("step,epoch,time\n")
    (other / "logs").mkdir()
    await first_run(other)
    for d in ("missing/deeper", "empty", "other"):
        assert (tmp_path / d / "epoch=0-step=4.ckpt").exists()


def test_exist_ok_is_false_by_default(tmp_path: Path) -> None:
    assert Checkpoint(tmp_path).exist_ok is False
    assert Checkpoint(os.fspath(tmp_path), exist_ok=True).exist_ok is True


# ---------------------------------------------------------------- loggers: version_N


def logged(save_dir: Path, **options: Any) -> CSVLogger:
    return CSVLogger(save_dir, flush_interval=0, **options)


async def test_two_runs_write_version_0_then_version_1(tmp_path: Path) -> None:
    for expected in (0, 1):
        csv, jsonl = logged(tmp_path), JSONLLogger(tmp_path / "j", flush_interval=0)
        trainer, net, train = build(csv, jsonl)
        await trainer.fit(net, train)
        assert csv.version == expected
        assert jsonl.log_dir == tmp_path / "j" / "loopbus_logs" / f"version_{expected}"
        assert csv.log_dir == tmp_path / "loopbus_logs" / f"version_{expected}"
        assert csv.path == csv.log_dir / "metrics.csv"
        assert read_csv(csv.path)


async def test_the_loggers_of_one_run_share_its_version_folder(tmp_path: Path) -> None:
    """Given the same folder, a run's CSV and JSONL loggers write side by side into one
    ``version_N`` (a version is taken by a logger of the same kind); the next run takes
    the next one."""
    for expected in (0, 1):
        csv, jsonl = logged(tmp_path), JSONLLogger(tmp_path, flush_interval=0)
        trainer, net, train = build(csv, jsonl)
        await trainer.fit(net, train)
        assert csv.version == jsonl.version == expected
        assert sorted(p.name for p in csv.log_dir.iterdir()) == [
            "metrics.csv",
            "records.jsonl",
            "run.json",
        ]
        info = read_run_info(csv.log_dir)
        assert info["name"] == "loopbus_logs"
        assert info["version"] == expected
        assert info["stage"] == "fit"
        assert info["resumed_from_step"] is None


async def test_an_explicit_version_or_name(tmp_path: Path) -> None:
    three, named = logged(tmp_path, version=3), logged(tmp_path, name="exp", version="run-a")
    flat = logged(tmp_path / "flat", name="", version="")
    trainer, net, train = build(three, named, flat)
    await trainer.fit(net, train)
    assert three.path == tmp_path / "loopbus_logs" / "version_3" / "metrics.csv"
    assert named.path == tmp_path / "exp" / "run-a" / "metrics.csv"
    assert flat.path == tmp_path / "flat" / "metrics.csv"
    for logger in (three, named, flat):
        assert read_csv(logger.path)


async def test_appending_continues_the_newest_version(tmp_path: Path) -> None:
    trainer, net, train = build(logged(tmp_path))
    await trainer.fit(net, train)
    again = logged(tmp_path, mode="a")
    trainer, net, train = build(again)
    await trainer.fit(net, train)
    assert again.version == 0


async def test_a_resumed_fit_continues_the_newest_version(tmp_path: Path) -> None:
    trainer, net, train = build(Checkpoint(tmp_path / "ckpt"), logged(tmp_path))
    await trainer.fit(net, train)
    resumed = logged(tmp_path)
    trainer, net, train = build(Checkpoint(tmp_path / "ckpt"), resumed, max_epochs=2)
    await trainer.fit(net, train, ckpt_path="last")
    assert resumed.version == 0
    assert read_run_info(resumed.log_dir)["resumed_from_step"] == 4
    assert {r["step"] for r in read_csv(resumed.path)} >= {4, 8}


async def test_tensorboard_names_its_version_in_run_json(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    board = TensorBoardLogger(tmp_path, flush_interval=0)
    trainer, net, train = build(board)
    await trainer.fit(net, train)
    assert board.log_dir == tmp_path / "loopbus_logs" / "version_0"
    assert read_run_info(board.log_dir)["version"] == 0


def test_tensorboard_takes_save_dir_and_log_dir_is_its_deprecated_name(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    assert TensorBoardLogger(save_dir=tmp_path).save_dir == tmp_path
    with pytest.warns(DeprecationWarning, match=r"TensorBoardLogger\(save_dir=\.\.\.\)"):
        old = TensorBoardLogger(log_dir=tmp_path)
    assert old.save_dir == tmp_path
    with pytest.raises(TypeError, match="not both"):
        TensorBoardLogger(tmp_path, log_dir=tmp_path)


def test_read_run_info_names_a_folder_that_is_not_a_version(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a logger's version folder"):
        read_run_info(tmp_path)
    (tmp_path / "run.json").write_text("[1")
    with pytest.raises(ValueError, match="not the run information"):
        read_run_info(tmp_path)
