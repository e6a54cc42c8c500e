"""Standard plugins (the tuning tools of ``loopbus.plugins.tuning`` among them). Each
imports only public loopbus names, like user code would."""

from __future__ import annotations

import functools

from loopbus import register_precision, set_default_plugins

from ._checkpoint import Checkpoint as Checkpoint
from ._checkpoint import CheckpointSaved as CheckpointSaved
from ._early_stopping import EarlyStopping as EarlyStopping
from ._lr_monitor import LearningRateMonitor as LearningRateMonitor
from ._mixed_precision import MixedPrecision as MixedPrecision
from ._progress_bar import ProgressBar as ProgressBar
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
from .tuning import PEAK_FLOPS as PEAK_FLOPS
from .tuning import BatchSizeFinder as BatchSizeFinder
from .tuning import LRFinder as LRFinder
from .tuning import LRFinderPoint as LRFinderPoint
from .tuning import LRFinderResult as LRFinderResult
from .tuning import Profiler as Profiler
from .tuning import ProfileRow as ProfileRow
from .tuning import ProfileSummary as ProfileSummary
from .tuning import ThroughputMeasured as ThroughputMeasured
from .tuning import ThroughputMonitor as ThroughputMonitor
from .tuning import WeightAveraging as WeightAveraging
from .tuning import find_batch_size as find_batch_size
from .tuning import find_lr as find_lr
from .tuning import is_out_of_memory as is_out_of_memory
from .tuning import peak_flops as peak_flops

__all__: list[str] = [
    "BatchSizeFinder",
    "CSVLogger",
    "Checkpoint",
    "CheckpointSaved",
    "EarlyStopping",
    "JSONLLogger",
    "LRFinder",
    "LRFinderPoint",
    "LRFinderResult",
    "LearningRateMonitor",
    "Logger",
    "MLflowLogger",
    "MixedPrecision",
    "ModelSummary",
    "PEAK_FLOPS",
    "ProfileRow",
    "ProfileSummary",
    "Profiler",
    "ProgressBar",
    "ServerStarted",
    "StreamServer",
    "TensorBoardLogger",
    "ThroughputMeasured",
    "ThroughputMonitor",
    "Timer",
    "WandbLogger",
    "WeightAveraging",
    "decode_records",
    "find_batch_size",
    "find_lr",
    "is_out_of_memory",
    "peak_flops",
    "read_csv",
    "read_jsonl",
    "read_run_info",
]

# Trainer(precision="16-mixed" | "bf16-mixed") builds a MixedPrecision.
register_precision("16-mixed", functools.partial(MixedPrecision, "16-mixed"))
register_precision("bf16-mixed", functools.partial(MixedPrecision, "bf16-mixed"))
# Trainer(plugins=None): a progress bar and the model summary (loggers are opt-in).
set_default_plugins([ProgressBar, ModelSummary])
