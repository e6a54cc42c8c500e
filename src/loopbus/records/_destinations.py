"""Where put records may go: the destination roles (the standard ones and those plugins
register), and the ``destinations`` argument of ``put`` checked and normalised to a
sorted tuple, cached for the eager ``put`` and uncached for compiled code.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..events import DESTINATIONS
from ._checks import described

__all__ = ["ALL", "checked_destinations", "normalize_destinations", "register_destination"]

#: Every standard destination: where a record put with ``destinations=None`` goes.
ALL: tuple[str, ...] = DESTINATIONS
_DEST_CACHE: dict[Any, tuple[str, ...]] = {None: ALL}
_KNOWN_ROLES: set[str] = set(DESTINATIONS)


def register_destination(role: str) -> None:
    """Allow ``role`` as a put destination (plugins with a role of their own call this)."""
    if not isinstance(role, str) or not role:
        raise ValueError(
            f"a destination role must be a non-empty str, got {described(role)}"
        )
    _KNOWN_ROLES.add(role)


def normalize_destinations(destinations: Any) -> tuple[str, ...]:
    """``destinations`` checked and sorted, remembered for the next put that passes the
    same (hashable) value."""
    try:
        return _DEST_CACHE[destinations]
    except (KeyError, TypeError):
        pass
    result = checked_destinations(destinations)
    try:
        _DEST_CACHE[destinations] = result
    except TypeError:
        pass
    return result


def checked_destinations(destinations: Any) -> tuple[str, ...]:
    """``destinations`` checked and sorted (not cached: what compiled code calls)."""
    items: Iterable[Any] = (destinations,) if isinstance(destinations, str) else destinations
    try:
        result = tuple(sorted(set(items)))
    except TypeError:
        raise TypeError(
            f"put() destinations must be a str or a collection of str from {DESTINATIONS}, "
            f"got {described(destinations)}."
        ) from None
    for role in result:
        if role not in _KNOWN_ROLES:
            raise ValueError(
                f"put() got unknown destination {described(role)}; known destinations are "
                f"{sorted(_KNOWN_ROLES)}."
            )
    if not result:
        raise ValueError(
            "put() destinations is empty, so the record would go nowhere; name at least one "
            f"of {DESTINATIONS} or leave destinations=None for all of them."
        )
    return result
