"""State that survives the process: the registry of checkpoint parts, the file format
(atomic writes, completeness markers, bounded decoding), sharded checkpoints through
``torch.distributed.checkpoint``, and the random generators' states.

Imports ``loopbus.step``, ``loopbus.state`` and the base modules, and reads nothing of
the trainer: a save is handed a :class:`CheckpointRegistry`, which the trainer builds
(the parts, the module and optimizers, how far the run is, and the strategy, as a
protocol of its own: ``_registry.SaveStrategy``).

Modules, bottom to top: ``_format`` (names, markers, pointers, the header), ``_write``
(plain values, atomic writes), ``_clean`` (removal), ``_diagnose`` (files read as
untrusted input), ``_locate`` (which checkpoint a directory or ``ckpt_path`` means),
``_rng_state`` (generators), ``_registry`` (what a save is handed), ``_parts`` (the
registry's parts, composing and loading a checkpoint dict), ``_sharded_save`` and
``_sharded_load`` (sharded checkpoints), ``_load`` (reading any checkpoint).

The sharded modules import ``torch.distributed.checkpoint`` (a third of the time
``import loopbus`` takes), so they load on first use: their names here resolve when read,
and the verbs that need them import them when a checkpoint is sharded.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._clean import remove_checkpoint as remove_checkpoint
from ._clean import remove_incomplete_checkpoints as remove_incomplete_checkpoints
from ._clean import remove_stale_temporaries as remove_stale_temporaries
from ._format import checkpoint_info as checkpoint_info
from ._format import is_sharded_checkpoint as is_sharded_checkpoint
from ._load import load_checkpoint as load_checkpoint
from ._locate import latest_checkpoint as latest_checkpoint
from ._parts import CheckpointMismatch as CheckpointMismatch
from ._registry import CheckpointRegistry as CheckpointRegistry
from ._write import write_checkpoint as write_checkpoint

if TYPE_CHECKING:
    from ._sharded_load import consolidate_checkpoint as consolidate_checkpoint
    from ._sharded_save import ShardedCheckpointWriter as ShardedCheckpointWriter
    from ._sharded_save import ShardedSave as ShardedSave

#: The names of the sharded modules, loaded on first use (module ``__getattr__``).
_ON_FIRST_USE = {
    "consolidate_checkpoint": "._sharded_load",
    "ShardedCheckpointWriter": "._sharded_save",
    "ShardedSave": "._sharded_save",
}


def __getattr__(name: str) -> Any:
    module = _ON_FIRST_USE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "CheckpointMismatch",
    "CheckpointRegistry",
    "ShardedCheckpointWriter",
    "ShardedSave",
    "checkpoint_info",
    "consolidate_checkpoint",
    "is_sharded_checkpoint",
    "latest_checkpoint",
    "load_checkpoint",
    "remove_checkpoint",
    "remove_incomplete_checkpoints",
    "remove_stale_temporaries",
    "write_checkpoint",
]
