"""State that survives the process: the registry of checkpoint parts, the file format
(atomic writes, completeness markers, bounded decoding), sharded checkpoints through
``torch.distributed.checkpoint``, and the random generators' states.

Imports ``loopbus.distributed``, ``loopbus.step``, ``loopbus.data``, ``loopbus.state``.
"""

from __future__ import annotations

from ._parts import CheckpointMismatch as CheckpointMismatch
from ._parts import checkpoint_info as checkpoint_info
from ._parts import is_sharded_checkpoint as is_sharded_checkpoint
from ._parts import latest_checkpoint as latest_checkpoint
from ._parts import load_checkpoint as load_checkpoint
from ._parts import remove_checkpoint as remove_checkpoint
from ._parts import remove_stale_temporaries as remove_stale_temporaries
from ._parts import write_checkpoint as write_checkpoint
from ._sharded import ShardedCheckpointWriter as ShardedCheckpointWriter
from ._sharded import ShardedSave as ShardedSave
from ._sharded import consolidate_checkpoint as consolidate_checkpoint

__all__ = [
    "CheckpointMismatch",
    "ShardedCheckpointWriter",
    "ShardedSave",
    "checkpoint_info",
    "consolidate_checkpoint",
    "is_sharded_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "remove_checkpoint",
    "remove_stale_temporaries",
    "write_checkpoint",
]
