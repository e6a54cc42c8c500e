"""The CSV and JSON-lines loggers on a full disk: a failed write, the final write when a
logger closes its file, and a header rewrite each fail the run with an error that names
the logger and the file and says "No space left on device"; what was written before
stays readable, and a failed rewrite leaves no temporary file behind.

The full disk is a fake (``tests/checkpoint/_full_disk.py``: writes fail with ENOSPC, as
write(2) does on a full disk)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from loopbus import HandlerError, Module, Trainer
from loopbus.events import FitCompleted, TrainBatchCompleted
from loopbus.plugins import CSVLogger, JSONLLogger, read_csv, read_jsonl
from tests.checkpoint._full_disk import NO_SPACE, FullDisk
from tests.helpers import TinyModule, make_loader

STEPS = 8  # 128 samples in batches of 16


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FullDisk:
    return FullDisk(monkeypatch, tmp_path)


def _steps(path: Path) -> list[int]:
    if path.suffix == ".csv":
        return [int(row["step"]) for row in read_csv(path)]
    return [record.step for record in read_jsonl(path)]


@pytest.mark.parametrize("kind", [CSVLogger, JSONLLogger], ids=["csv", "jsonl"])
async def test_a_failed_write_names_the_logger_and_the_file(
    disk: FullDisk, tmp_path: Path, kind: type[CSVLogger | JSONLLogger]
) -> None:
    logger = kind(tmp_path, flush_interval=0, buffer=1)
    path = logger.path
    full = [False]
    disk.full = lambda p: full[0] and p == path
    trainer = Trainer(max_steps=STEPS, plugins=[logger], device="cpu", enable_model_summary=False)

    def fill_up(event: TrainBatchCompleted) -> None:
        full[0] = full[0] or trainer.global_step >= 3

    trainer.subscribe(TrainBatchCompleted, fill_up)
    with pytest.raises(
        (HandlerError, RuntimeError),
        match=rf"{kind.__name__} could not write {re.escape(str(path))}: {NO_SPACE}",
    ):
        await trainer.fit(TinyModule(), make_loader(n=16 * STEPS))
    assert disk.failed
    # What was written before the disk filled up is intact (a torn last line is skipped).
    steps = _steps(path)
    assert steps == list(range(1, len(steps) + 1))


async def test_a_failed_write_at_close_names_the_logger_and_the_file(
    disk: FullDisk, tmp_path: Path
) -> None:
    full = [False]

    class FullAtClose(CSVLogger):
        def close(self) -> None:
            full[0] = True  # the disk fills up just before the last row is written
            super().close()

    logger = FullAtClose(tmp_path)
    path = logger.path
    disk.full = lambda p: full[0] and p == path
    trainer = Trainer(max_steps=STEPS, plugins=[logger], device="cpu", enable_model_summary=False)
    with pytest.raises(
        RuntimeError,
        match=rf"FullAtClose could not finish writing {re.escape(str(path))}: {NO_SPACE} "
        r"\(when it closed its file at the end of the stage: the records it still held are "
        r"missing; what it wrote before is intact\)",
    ) as caught:
        await trainer.fit(TinyModule(), make_loader(n=16 * STEPS))
    assert isinstance(caught.value.__cause__, OSError)
    # Every row but the last one (held until the logger closed) was written.
    assert _steps(path) == list(range(1, STEPS))
    assert logger._file is None  # closed all the same


async def test_a_failed_final_write_names_the_file(disk: FullDisk, tmp_path: Path) -> None:
    logger = JSONLLogger(tmp_path, flush_interval=3600, name="", version="")  # one write, then all at the end
    path = logger.path
    full = [False]
    disk.full = lambda p: full[0] and p == path
    trainer = Trainer(max_steps=STEPS, plugins=[logger], device="cpu", enable_model_summary=False)

    def fill_up(event: FitCompleted) -> None:
        full[0] = True

    trainer.subscribe(FitCompleted, fill_up)
    with pytest.raises(
        RuntimeError, match=rf"JSONLLogger could not write {re.escape(str(path))}: {NO_SPACE}"
    ):
        await trainer.fit(TinyModule(), make_loader(n=16 * STEPS))
    steps = _steps(path)
    assert steps == list(range(1, len(steps) + 1))
    assert len(steps) < STEPS


class NewColumnAtStep3(Module):
    """Puts ``a`` at every step and, from step 3, ``b``: a new column, so the CSV file's
    header is rewritten then."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.layer(x), y)
        self.put("a", loss)
        if self.trainer.global_step >= 2:
            self.put("b", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


async def test_a_failed_header_rewrite_leaves_the_file_and_no_temporary(
    disk: FullDisk, tmp_path: Path
) -> None:
    logger = CSVLogger(tmp_path, flush_interval=0, buffer=1, name="", version="")
    path = logger.path
    disk.full = lambda p: p.parent == tmp_path and p.name.startswith(".metrics.csv.")  # the rewrite's
    trainer = Trainer(max_steps=STEPS, plugins=[logger], device="cpu", enable_model_summary=False)
    with pytest.raises(
        (HandlerError, RuntimeError),
        match=rf"CSVLogger could not write {re.escape(str(path))}: {NO_SPACE}",
    ):
        await trainer.fit(NewColumnAtStep3(), make_loader(n=16 * STEPS))
    assert disk.failed
    assert _names(tmp_path) == ["metrics.csv", "run.json"]
    rows = read_csv(path)
    assert [row["step"] for row in rows] == [1, 2][: len(rows)]
    assert all("b" not in row for row in rows)
    assert _first_line(path) == "step,epoch,time,a"


def _names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _first_line(path: Path) -> str:
    return path.read_text().splitlines()[0]


# TensorBoard's own writer thread re-raises the failed write after handing it over (its
# design): the thread's traceback is printed besides the error the run raises.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_tensorboard_write_on_a_full_disk_names_the_event_file(
    disk: FullDisk, tmp_path: Path
) -> None:
    pytest.importorskip("tensorboard")
    from loopbus.plugins import TensorBoardLogger

    logger = TensorBoardLogger(tmp_path, name="", version="", flush_interval=0, buffer=1)
    full = [False]
    disk.full = lambda p: full[0] and p.name.startswith("events.out.tfevents.")
    trainer = Trainer(max_steps=STEPS, plugins=[logger], device="cpu", enable_model_summary=False)

    def fill_up(event: TrainBatchCompleted) -> None:
        full[0] = full[0] or trainer.global_step >= 3

    trainer.subscribe(TrainBatchCompleted, fill_up)
    with pytest.raises(
        (HandlerError, RuntimeError),
        match=rf"TensorBoardLogger could not (finish )?write {re.escape(str(tmp_path))}/"
        rf"events\.out\.tfevents\.[^:]+: {NO_SPACE}",
    ):
        await trainer.fit(TinyModule(), make_loader(n=16 * STEPS))
    assert disk.failed


def _said(error: BaseException) -> str:
    """Everything ``error`` says: its message, its notes, and those of the errors it
    groups."""
    parts = [str(error), *getattr(error, "__notes__", [])]
    if isinstance(error, BaseExceptionGroup):
        parts += [_said(inner) for inner in error.exceptions]
    return "\n".join(parts)


@pytest.mark.parametrize("when", ["during", "at-the-end"])
async def test_when_several_loggers_fail_each_failure_is_reported(
    disk: FullDisk, tmp_path: Path, when: str
) -> None:
    # During the run each fails at a hand-over; at the end each fails in its stop(), one
    # after the other.
    # During: every record handed over at once; at the end: all of them held until then.
    options: dict[str, Any] = (
        {"flush_interval": 0, "buffer": 1} if when == "during" else {"flush_interval": 3600}
    )
    csv = CSVLogger(tmp_path / "csv", name="", version="", **options)
    jsonl = JSONLLogger(tmp_path / "jsonl", name="", version="", **options)
    full = [False]
    disk.full = lambda p: full[0] and p in (csv.path, jsonl.path)
    trainer = Trainer(
        max_steps=STEPS, plugins=[csv, jsonl], device="cpu", enable_model_summary=False
    )

    def fill_up(event: Any) -> None:
        full[0] = full[0] or when == "at-the-end" or trainer.global_step >= 3

    trainer.subscribe(TrainBatchCompleted if when == "during" else FitCompleted, fill_up)
    with pytest.raises((HandlerError, RuntimeError, BaseExceptionGroup)) as caught:
        await trainer.fit(TinyModule(), make_loader(n=16 * STEPS))
    said = _said(caught.value)
    for name, path in (("CSVLogger", csv.path), ("JSONLLogger", jsonl.path)):
        assert f"{name} could not write {path}: {NO_SPACE}" in said, said
