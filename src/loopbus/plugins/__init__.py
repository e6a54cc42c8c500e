"""Standard plugins. Each imports only public loopbus names, like user code would."""

from __future__ import annotations

__all__: list[str] = []
