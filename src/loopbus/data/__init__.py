"""Where batches come from: batch sources that hand a loop its batches one ahead, nested
moves to a device and CUDA side-stream prefetch, and the elastic distributed sampler.

Imports ``loopbus.state`` and the base layer.
"""

from __future__ import annotations

from ._sampler import ElasticDistributedSampler as ElasticDistributedSampler

__all__ = [
    "ElasticDistributedSampler",
]
