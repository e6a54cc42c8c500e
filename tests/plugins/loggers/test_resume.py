"""File loggers across a resume: ``fit(..., ckpt_path=...)`` continues the same history
(rows after the checkpoint's step dropped and written again, nothing earlier lost, no
duplicates) in CSV, JSON lines and TensorBoard."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

import loopbus
from loopbus import Trainer
from loopbus.plugins import (
    Checkpoint,
    CSVLogger,
    JSONLLogger,
    TensorBoardLogger,
    read_csv,
    read_jsonl,
)
from loopbus.plugins.loggers._csv import _csv_step_time
from loopbus.plugins.loggers._files import _continue_after
from tests.helpers import TinyModule, make_loader

STEPS = 12  # 3 epochs of 4 batches, validation (4 batches) after each


def loggers(out: Path) -> list[Any]:
    return [
        CSVLogger(out, name="", version=""),
        JSONLLogger(out, name="", version=""),
        TensorBoardLogger(out / "tb", name="", version=""),
    ]


async def fit(out: Path, ckpt_dir: Path | None, ckpt_path: Path | None = None) -> None:
    loopbus.seed_everything(0)
    plugins = loggers(out)
    if ckpt_dir is not None:
        plugins.append(Checkpoint(ckpt_dir, every_n_steps=2, keep_last=None))
    trainer = Trainer(max_steps=STEPS, plugins=plugins, device="cpu")
    await trainer.fit(TinyModule(), make_loader(n=64), make_loader(n=64), ckpt_path=ckpt_path)


def key(rows: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """What must match between runs: everything but the wall time."""
    return [tuple(sorted((k, v) for k, v in row.items() if k != "time")) for row in rows]


def scalars(log_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.filterwarnings("ignore:resuming mid-epoch:UserWarning")
@pytest.mark.parametrize("resume_step", [6, 4])
async def test_a_resumed_fit_continues_every_log_without_loss_or_duplicates(
    tmp_path: Path, resume_step: int
) -> None:
    pytest.importorskip("tensorboard")
    # The history a run that never stopped writes.
    reference = tmp_path / "reference"
    await fit(reference, None)
    ref_records = read_jsonl(reference / "records.jsonl")
    assert [r.step for r in ref_records if r.name == "train/loss"] == list(range(1, STEPS + 1))

    # A run that wrote all 12 steps, then is resumed from its checkpoint at step 6 (mid
    # epoch) or 4 (the last batch of an epoch, before that epoch's validation).
    out, ckpts = tmp_path / "run", tmp_path / "ckpts"
    await fit(out, ckpts)
    first = read_jsonl(out / "records.jsonl")
    first_rows = read_csv(out / "metrics.csv")
    ckpt = ckpts / f"epoch={(resume_step - 1) // 4}-step={resume_step}.ckpt"
    assert ckpt.exists(), sorted(os.listdir(ckpts))
    # TensorBoard reads a directory's event files in name order, and a name holds the
    # second it was created and a per-process counter: let the resumed run's file be
    # named after the first run's as another process's would.
    await anyio.sleep(1 - time.time() % 1 + 0.01)
    await fit(out, ckpts, ckpt_path=ckpt)

    # JSON lines: the same records as the uninterrupted run, in the same order...
    records = read_jsonl(out / "records.jsonl")
    same = [(r.name, r.step, r.epoch, r.source) for r in records]
    assert same == [(r.name, r.step, r.epoch, r.source) for r in ref_records]
    assert [r.value for r in records] == pytest.approx([r.value for r in ref_records])
    # ...those published before the checkpoint kept from the first run as they were
    # (at step 4 the validation ran after the checkpoint: the resumed run repeats it)...
    taken = loopbus.load_checkpoint(ckpt)["loopbus"]["created"]
    kept = [r for r in first if r.step < resume_step or (r.step == resume_step and r.time <= taken)]
    assert len(kept) == resume_step + 4 * (resume_step // 4 if resume_step == 6 else 0)
    assert records[: len(kept)] == kept
    # ...and after it written by the resumed run (none left from the first).
    later = records[len(kept) :]
    assert later
    assert all(r.step >= resume_step and r.time > taken for r in later)
    assert not {r.time for r in later} & {r.time for r in first}
    train = [r.step for r in records if r.name == "train/loss"]
    assert train == sorted(set(train))  # strictly increasing: no duplicates

    # CSV: the early rows untouched, every training step once.
    rows = read_csv(out / "metrics.csv")
    kept_rows = [row for row in first_rows if row["step"] < resume_step or row["time"] <= taken]
    assert rows[: len(kept_rows)] == kept_rows
    train_steps = [row["step"] for row in rows if "train/loss" in row]
    assert train_steps == list(range(1, STEPS + 1))
    # TensorBoard: after the purge each training step shows once, with resumed values.
    tb = scalars(out / "tb", "train/loss")
    assert [s for s, _ in tb] == list(range(1, STEPS + 1))
    expected = [r.value for r in records if r.name == "train/loss"]
    assert [v for _, v in tb] == pytest.approx(expected, rel=1e-6)
    val = [s for s, _ in scalars(out / "tb", "val/loss")]
    ref_val = [s for s, _ in scalars(reference / "tb", "val/loss")]
    if resume_step == 6:
        # A checkpoint between steps: every row and every scalar as in the run that
        # never stopped.
        assert key(rows) == key(read_csv(reference / "metrics.csv"))
        assert val == ref_val
    else:
        # The documented limit: a checkpoint taken before a validation at its own step.
        # The CSV row that holds that step's training loss also took the first
        # validation batch's loss, and TensorBoard purges by step, so both keep what
        # the first run's validation wrote at step 4 and show it twice.
        assert val == sorted([*ref_val, *[4] * 4])
        extra = [row for row in rows if row["step"] == 4 and "train/loss" not in row]
        assert len(extra) == 4


async def test_a_fresh_fit_still_starts_new_files(tmp_path: Path) -> None:
    await fit(tmp_path, None)
    await fit(tmp_path, None)  # no ckpt_path: mode="w" starts over, as before
    steps = [r.step for r in read_jsonl(tmp_path / "records.jsonl") if r.name == "train/loss"]
    assert steps == list(range(1, STEPS + 1))
    assert [r["step"] for r in read_csv(tmp_path / "metrics.csv") if "train/loss" in r] == list(
        range(1, STEPS + 1)
    )


def test_cutting_a_log_is_crash_safe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "metrics.csv"
    original = b"step,epoch,time,x\n1,0,1.0,1\n2,0,2.0,2\n3,0,3.0,3\n4,0,4.0,"
    path.write_bytes(original)

    def crash(*args: Any) -> None:
        raise OSError("power cut")

    # A crash before the rename: the file is as it was, no temporary is left behind.
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="power cut"):
        _continue_after(path, 2, None, _csv_step_time, header=1)
    assert path.read_bytes() == original
    assert sorted(os.listdir(tmp_path)) == ["metrics.csv"]
    monkeypatch.undo()

    _continue_after(path, 2, None, _csv_step_time, header=1)
    assert path.read_bytes() == b"step,epoch,time,x\n1,0,1.0,1\n2,0,2.0,2\n"
    assert sorted(os.listdir(tmp_path)) == ["metrics.csv"]
    # Nothing after the step: the file is left alone (not even rewritten).
    before = path.stat().st_mtime_ns, path.stat().st_ino
    _continue_after(path, 5, None, _csv_step_time, header=1)
    assert (path.stat().st_mtime_ns, path.stat().st_ino) == before
