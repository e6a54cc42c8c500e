"""Standard plugins. Each imports only public loopbus names, like user code would."""

from __future__ import annotations

from ._checkpoint import Checkpoint as Checkpoint
from ._stream import ServerStarted as ServerStarted
from ._stream import StreamServer as StreamServer

__all__: list[str] = ["Checkpoint", "ServerStarted", "StreamServer"]
