"""Standard plugins. Each imports only public loopbus names, like user code would."""

from __future__ import annotations

import functools

from loopbus import register_precision, set_default_plugins

from ._checkpoint import Checkpoint as Checkpoint
from ._checkpoint import CheckpointSaved as CheckpointSaved
from ._early_stopping import EarlyStopping as EarlyStopping
from ._lr_monitor import LearningRateMonitor as LearningRateMonitor
from ._precision import MixedPrecision as MixedPrecision
from ._progress import ProgressBar as ProgressBar
from ._stream import ServerStarted as ServerStarted
from ._stream import StreamServer as StreamServer
from ._summary import ModelSummary as ModelSummary
from ._timer import Timer as Timer
from .loggers import CSVLogger as CSVLogger
from .loggers import JSONLLogger as JSONLLogger
from .loggers import Logger as Logger
from .loggers import MLflowLogger as MLflowLogger
from .loggers import TensorBoardLogger as TensorBoardLogger
from .loggers import WandbLogger as WandbLogger
from .loggers import decode_records as decode_records
from .loggers import read_csv as read_csv
from .loggers import read_jsonl as read_jsonl
from .loggers import read_run_info as read_run_info

__all__: list[str] = [
    "CSVLogger",
    "Checkpoint",
    "CheckpointSaved",
    "EarlyStopping",
    "JSONLLogger",
    "LearningRateMonitor",
    "Logger",
    "MLflowLogger",
    "MixedPrecision",
    "ModelSummary",
    "ProgressBar",
    "ServerStarted",
    "StreamServer",
    "TensorBoardLogger",
    "Timer",
    "WandbLogger",
    "decode_records",
    "read_csv",
    "read_jsonl",
    "read_run_info",
]

# Trainer(precision="16-mixed" | "bf16-mixed") builds a MixedPrecision.
register_precision("16-mixed", functools.partial(MixedPrecision, "16-mixed"))
register_precision("bf16-mixed", functools.partial(MixedPrecision, "bf16-mixed"))
# Trainer(plugins=None): a progress bar and the model summary (loggers are opt-in).
set_default_plugins([ProgressBar, ModelSummary])
