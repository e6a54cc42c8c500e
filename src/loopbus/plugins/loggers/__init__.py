"""Loggers: put records to files and experiment trackers, written off the event loop.

The base :class:`Logger` batches the records and hands them to a worker thread; the file
loggers (CSV, JSON lines, TensorBoard) and the tracker loggers (MLflow, W&B) build on it.
Like every standard plugin, these modules import only public names (``loopbus``,
``loopbus.events``) and their sibling plugin modules.
"""

from __future__ import annotations

from ._base import Logger as Logger
from ._csv import CSVLogger as CSVLogger
from ._csv import read_csv as read_csv
from ._files import read_run_info as read_run_info
from ._jsonl import JSONLLogger as JSONLLogger
from ._jsonl import decode_records as decode_records
from ._jsonl import read_jsonl as read_jsonl
from ._mlflow import MLflowLogger as MLflowLogger
from ._tensorboard import TensorBoardLogger as TensorBoardLogger
from ._wandb import WandbLogger as WandbLogger

__all__ = [
    "CSVLogger",
    "JSONLLogger",
    "Logger",
    "MLflowLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "decode_records",
    "read_csv",
    "read_run_info",
    "read_jsonl",
]
