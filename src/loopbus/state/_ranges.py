"""The switch for the engine's profiler ranges.

While it is on, the engine marks its own phases with ``torch.profiler.record_function``
ranges (``loopbus.data_fetch``, ``loopbus.step``, ``loopbus.put_flush``,
``loopbus.boundary``, ``loopbus.validation``, ``loopbus.checkpoint``, ...), so a
profiler's trace shows where the host time of a step went. While it is off (the
default) each phase reads one attribute and calls nothing: the ranges cost nothing.

One owner: this module holds the switch; :func:`profiling_ranges` is the only way to
change it (the ``Profiler`` plugin turns it on for its active window, then restores it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from torch.autograd.profiler import record_function

from .._exceptions import MisconfigurationError

__all__ = ["RANGES", "in_range", "profiling_ranges"]

T = TypeVar("T")


class _Switch:
    """The switch the engine's phases read (``if RANGES.on:``): an attribute load, no call."""

    __slots__ = ("on",)

    def __init__(self) -> None:
        self.on = False

    def __repr__(self) -> str:
        return f"profiling_ranges({self.on})"


#: Read by the engine's phases; set only through :func:`profiling_ranges`.
RANGES = _Switch()


def in_range(name: str, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` inside the profiler range ``name``: what a phase calls instead of
    ``fn(*args)`` while the switch is on."""
    with record_function(name):
        return fn(*args)


def profiling_ranges(enabled: bool | None = None) -> bool:
    """Turn the engine's profiler ranges on or off (``enabled``) and return the setting
    it had before; without ``enabled``, return the current setting.

    While on, the engine wraps each of its phases in a ``torch.profiler.record_function``
    range named ``loopbus.<phase>``, visible in any ``torch.profiler`` trace taken
    meanwhile. Process-wide (every trainer in the process); whoever turns it on restores
    the previous setting when done::

        previous = loopbus.profiling_ranges(True)
        try:
            ...  # profile
        finally:
            loopbus.profiling_ranges(previous)
    """
    previous = RANGES.on
    if enabled is not None:
        if not isinstance(enabled, bool):
            raise MisconfigurationError(
                f"profiling_ranges(enabled={enabled!r}) takes True (record the engine's "
                "phases as profiler ranges), False (do not) or nothing (read the setting)."
            )
        RANGES.on = enabled
    return previous
