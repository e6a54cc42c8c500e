"""TensorBoard logger (the optional extra ``tensorboard``)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from loopbus import PutRecord

from ._base import Logger
from ._files import DEFAULT_NAME, VersionedDir, save_dir_of

__all__ = ["TensorBoardLogger"]


def _flatten(hparams: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """TensorBoard's hparams take numbers, strings and bools: nested mappings become
    ``outer/inner`` names, lists and None their text."""
    flat: dict[str, Any] = {}
    for key, value in hparams.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}/"))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


class TensorBoardLogger(VersionedDir, Logger):
    """Writes every put record as a TensorBoard scalar (tag = record name, x = step,
    wall time = the record's time) to event files in :attr:`log_dir`,
    ``save_dir/loopbus_logs/version_N`` (the layout of :class:`CSVLogger`; ``name=""``
    and ``version=""`` write straight into the given folder)::

        trainer = Trainer(plugins=[ProgressBar(), TensorBoardLogger("runs/exp1")])
        # then: tensorboard --logdir runs

    A resumed ``fit`` (``ckpt_path=...``) continues the same run: its event file starts
    with TensorBoard's purge marker (``SummaryWriter(purge_step=...)``), so the scalars
    of steps after the checkpoint's that an earlier process wrote are hidden, and each
    step shows once. The module's hyperparameters (``save_hyperparameters``) appear in
    TensorBoard's HParams view of the same run.

    Needs the ``tensorboard`` package: ``pip install 'loopbus[tensorboard]'``. Like every
    :class:`Logger` it writes from worker threads, flushed at least every
    ``flush_interval`` seconds and at the end of each stage.
    """

    def __init__(
        self,
        save_dir: str | os.PathLike[str] | None = None,
        *,
        log_dir: str | os.PathLike[str] | None = None,
        name: str = DEFAULT_NAME,
        version: int | str | None = None,
        flush_interval: float = 0.5,
        buffer: int = 1024,
        overflow: Literal["block", "drop"] = "block",
    ) -> None:
        if importlib.util.find_spec("tensorboard") is None:
            raise ModuleNotFoundError(
                "TensorBoardLogger needs the tensorboard package, which is not installed. "
                "Install it with: pip install 'loopbus[tensorboard]'"
            )
        if log_dir is not None:
            if save_dir is not None:
                raise TypeError(
                    "TensorBoardLogger takes save_dir, not both save_dir and log_dir "
                    "(log_dir is its old name)."
                )
            warnings.warn(
                "TensorBoardLogger(log_dir=...) is deprecated: the folder is save_dir, as "
                "for the other loggers and Lightning's (logger.log_dir is the version "
                "folder inside it). Write TensorBoardLogger(save_dir=...).",
                DeprecationWarning,
                stacklevel=2,
            )
            save_dir = log_dir
        super().__init__(flush_interval=flush_interval, buffer=buffer, overflow=overflow)
        self._init_dir("TensorBoardLogger", save_dir_of("TensorBoardLogger", save_dir), name, version)
        self._writer: Any = None
        self._events_file: Path | None = None  # the event file, once open

    def _holds_output(self, folder: Path) -> bool:
        return any(folder.glob("events.out.tfevents.*"))

    def __repr__(self) -> str:
        return f"TensorBoardLogger({str(self._root)!r}, name={self.name!r})"

    def open(self, stage: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = self.log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        resume = self.resume_step
        # TensorBoard hides the earlier events of steps >= purge_step: those after the
        # checkpoint's step, which the resumed run writes again.
        purge_step = None if resume is None else resume + 1
        before = set(log_dir.glob("events.out.tfevents.*"))
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)
        # The event file it made (created with the writer): what a failed write names.
        made = sorted(set(log_dir.glob("events.out.tfevents.*")) - before)
        self._events_file = made[-1] if len(made) == 1 else log_dir

    def write_hparams(self, hparams: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard.summary import hparams as hparams_summaries

        # Into this run's own event file (SummaryWriter.add_hparams would start a
        # sub-run in another directory).
        file_writer = self._writer.file_writer
        for summary in hparams_summaries(_flatten(hparams), {}):  # type: ignore[no-untyped-call]
            file_writer.add_summary(summary)

    def write(self, records: Sequence[PutRecord]) -> None:
        add_scalar = self._writer.add_scalar
        with self._naming_the_file():
            for record in records:
                add_scalar(record.name, float(record.value), record.step, walltime=record.time)

    def flush(self) -> None:
        if self._writer is not None:
            with self._naming_the_file():
                self._writer.flush()

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            with self._naming_the_file():
                writer.close()

    @contextlib.contextmanager
    def _naming_the_file(self) -> Iterator[None]:
        """TensorBoard's writer thread raises a failed write (a full disk) without the
        file's name: add the event file's."""
        try:
            yield
        except OSError as exc:
            if exc.filename is not None:
                raise
            raise OSError(exc.errno, exc.strerror or str(exc), str(self._events_file or self.log_dir)) from exc
