"""The tools for tuning and understanding a run: the learning-rate and batch-size
finders, the profiler, the throughput monitor and weight averaging. Like every standard
plugin, these modules import only public names (``loopbus``, ``loopbus.events``) and
torch; where a tool needed more of the engine, the engine gained a documented public
name."""

from __future__ import annotations

from ._averaging import WeightAveraging as WeightAveraging
from ._batch_size import BatchSizeFinder as BatchSizeFinder
from ._batch_size import find_batch_size as find_batch_size
from ._batch_size import is_out_of_memory as is_out_of_memory
from ._lr_finder import LRFinder as LRFinder
from ._lr_finder import LRFinderPoint as LRFinderPoint
from ._lr_finder import LRFinderResult as LRFinderResult
from ._lr_finder import find_lr as find_lr
from ._profiler import Profiler as Profiler
from ._profiler import ProfileRow as ProfileRow
from ._profiler import ProfileSummary as ProfileSummary
from ._throughput import PEAK_FLOPS as PEAK_FLOPS
from ._throughput import ThroughputMeasured as ThroughputMeasured
from ._throughput import ThroughputMonitor as ThroughputMonitor
from ._throughput import peak_flops as peak_flops

__all__: list[str] = [
    "BatchSizeFinder",
    "LRFinder",
    "LRFinderPoint",
    "LRFinderResult",
    "PEAK_FLOPS",
    "ProfileRow",
    "ProfileSummary",
    "Profiler",
    "ThroughputMeasured",
    "ThroughputMonitor",
    "WeightAveraging",
    "find_batch_size",
    "find_lr",
    "is_out_of_memory",
    "peak_flops",
]
