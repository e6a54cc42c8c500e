"""Standard plugins. Each imports only public loopbus names, like user code would."""

from __future__ import annotations

from ._checkpoint import Checkpoint as Checkpoint

__all__: list[str] = ["Checkpoint"]
