"""TensorBoard logger (the optional extra ``tensorboard``)."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from loopbus import PutRecord

from ._loggers import Logger

__all__ = ["TensorBoardLogger"]


class TensorBoardLogger(Logger):
    """Writes every put record as a TensorBoard scalar (tag = record name, x = step,
    wall time = the record's time) to event files in ``log_dir``::

        trainer = Trainer(plugins=[ProgressBar(), TensorBoardLogger("runs/exp1")])
        # then: tensorboard --logdir runs

    Needs the ``tensorboard`` package: ``pip install 'loopbus[tensorboard]'``. Like every
    :class:`Logger` it writes from a worker thread, flushed at least every
    ``flush_interval`` seconds and at the end of each stage.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        flush_interval: float = 0.5,
        buffer: int = 1024,
        overflow: Literal["block", "drop"] = "block",
    ) -> None:
        if importlib.util.find_spec("tensorboard") is None:
            raise ModuleNotFoundError(
                "TensorBoardLogger needs the tensorboard package, which is not installed. "
                "Install it with: pip install 'loopbus[tensorboard]'"
            )
        super().__init__(flush_interval=flush_interval, buffer=buffer, overflow=overflow)
        self.log_dir = Path(log_dir)
        self._writer: Any = None

    def __repr__(self) -> str:
        return f"TensorBoardLogger({str(self.log_dir)!r})"

    def open(self, stage: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def write(self, records: Sequence[PutRecord]) -> None:
        add_scalar = self._writer.add_scalar
        for record in records:
            add_scalar(record.name, float(record.value), record.step, walltime=record.time)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
