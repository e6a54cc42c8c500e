"""Where batches come from: batch sources that hand a loop its batches one ahead, nested
moves to a device and CUDA side-stream prefetch, the elastic distributed sampler, and
DataModules (objects that make a stage's loaders, Lightning's shape).

Imports ``loopbus.state`` and the base layer.
"""

from __future__ import annotations

from ._datamodule import is_datamodule as is_datamodule
from ._datamodule import prepare_datamodule as prepare_datamodule
from ._sampler import ElasticDistributedSampler as ElasticDistributedSampler

__all__ = [
    "ElasticDistributedSampler",
    "is_datamodule",
    "prepare_datamodule",
]
