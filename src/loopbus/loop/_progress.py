"""Progress counters of a loop, as in Lightning's progress tracking.

Each iteration moves through four counters: ``ready`` (about to start), ``started``
(``on_advance_start`` done), ``processed`` (``advance`` done) and ``completed``
(``on_advance_end`` done). ``total`` counts over the loop's lifetime, ``current`` since
the loop's last reset (for the train epoch loop: within the current epoch).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Counters", "Progress"]

_FIELDS = ("ready", "started", "processed", "completed")


class Counters:
    __slots__ = _FIELDS

    def __init__(self) -> None:
        self.ready = 0
        self.started = 0
        self.processed = 0
        self.completed = 0

    def reset(self) -> None:
        self.ready = self.started = self.processed = self.completed = 0

    def reset_on_restart(self) -> None:
        """Roll back an iteration that was in flight when the state was saved."""
        self.ready = self.started = self.processed = self.completed

    def skip_to(self, iteration: int) -> None:
        """Make the iteration in flight number ``iteration`` (counting from 0) when it is
        further on: the ones between were done elsewhere (a fault-tolerant replica group
        that healed from a peer in a later epoch). Each counter moves on alike."""
        skipped = max(0, iteration - (self.ready - 1))
        self.ready += skipped
        self.started += skipped
        self.processed += skipped
        self.completed += skipped

    def state_dict(self) -> dict[str, int]:
        return {f: getattr(self, f) for f in _FIELDS}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in _FIELDS:
            value = state[f]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"progress counter {f!r} must be an int >= 0, got {value!r}")
            setattr(self, f, value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Counters) and self.state_dict() == other.state_dict()

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        inner = ", ".join(f"{f}={getattr(self, f)}" for f in _FIELDS)
        return f"Counters({inner})"


class Progress:
    """``total`` and ``current`` :class:`Counters` of one loop."""

    __slots__ = ("current", "total")

    def __init__(self) -> None:
        self.total = Counters()
        self.current = Counters()

    def reset(self) -> None:
        """Start a new run: the current counters go back to zero."""
        self.current.reset()

    def reset_on_restart(self) -> None:
        self.total.reset_on_restart()
        self.current.reset_on_restart()

    def state_dict(self) -> dict[str, dict[str, int]]:
        return {"total": self.total.state_dict(), "current": self.current.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total.load_state_dict(state["total"])
        self.current.load_state_dict(state["current"])

    def __repr__(self) -> str:
        return f"Progress(total={self.total!r}, current={self.current!r})"
