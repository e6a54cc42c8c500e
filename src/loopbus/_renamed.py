"""Renamed options: the old name of an option stays a deprecated alias for a while.

Times in seconds carry their unit in their name (``yield_interval_s``). An old name
still works: its value is taken as the new option's, with a ``DeprecationWarning`` that
names the new one, once per process for each old name (``Trainer(yield_interval=...)``
and ``trainer.yield_interval`` are two old names). Passing an old name together with
its new one is a :class:`MisconfigurationError` that names both.

This module imports nothing from loopbus but the exceptions, so every layer may use it.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Collection, Mapping
from typing import Any

from ._exceptions import MisconfigurationError

__all__ = ["RENAMED", "renamed_keywords", "warn_once"]

#: Old name -> new name, for the renamed keywords of the strategies (``DDPStrategy``,
#: ``FSDPStrategy``), the default of :func:`renamed_keywords`. The ``Trainer``'s renamed
#: options are declared with the options themselves (``renamed_from``, listed by
#: ``TrainerOptions.declarations()``) and passed as ``renames``.
RENAMED: Mapping[str, str] = {
    "process_group_timeout": "process_group_timeout_s",
    "stop_check_interval": "stop_check_interval_s",
}

#: The old names that warned already in this process (``Trainer(yield_interval=)``,
#: ``Trainer.yield_interval``, ...): each warns once.
_WARNED: set[str] = set()


def warn_once(key: str, message: str) -> None:
    """Warn ``message`` (a ``DeprecationWarning``, pointing at the first caller outside
    loopbus) unless ``key`` warned already in this process."""
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(message, DeprecationWarning, stacklevel=_caller_level())


def _caller_level() -> int:
    """The ``stacklevel`` (as seen from :func:`warn_once`) of the first frame that is
    not loopbus's own: the user's call, however deep inside loopbus the warning is."""
    frame = sys._getframe(1)  # warn_once's frame: stacklevel 1
    level = 1
    while frame.f_back is not None and _ours(frame.f_globals.get("__name__", "")):
        frame = frame.f_back
        level += 1
    return level


def _ours(module: str) -> bool:
    return module.partition(".")[0] == "loopbus"


def renamed_keywords(
    owner: str,
    passed: Mapping[str, Any],
    *,
    takes: Collection[str],
    given: Collection[str],
    renames: Mapping[str, str] = RENAMED,
) -> dict[str, Any]:
    """The values ``passed`` to ``owner(...)`` under old names, keyed by their new names.

    ``takes`` are the options ``owner`` has, ``given`` those the call passed by their
    new names, ``renames`` the old names (old -> new; default: the strategies'). Each old
    name warns once; one passed with its new name raises a
    :class:`MisconfigurationError`; a name that is no old name of an option of
    ``owner`` raises the ``TypeError`` Python raises for an unexpected keyword."""
    values: dict[str, Any] = {}
    for old, value in passed.items():
        new = renames.get(old)
        if new is None or new not in takes:
            raise TypeError(f"{owner}() got an unexpected keyword argument {old!r}")
        if new in given:
            raise MisconfigurationError(
                f"{owner}() got both {old}= and {new}=: {old} is the deprecated name of "
                f"{new}; pass {new}= only."
            )
        warn_once(
            f"{owner}({old}=)",
            f"{owner}({old}=...) is deprecated: the option is now {new} (the same value, "
            f"in seconds); pass {new}=... instead.",
        )
        values[new] = value
    return values
