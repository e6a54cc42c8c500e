"""The one error of the configuration commands: every problem found, each with its key."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from .._exceptions import LoopbusError

__all__ = ["ConfigError", "Problem", "did_you_mean"]


class Problem:
    """One thing wrong with a configuration: the key's full path (``trainer.max_epochs``;
    empty for the command line as a whole), what is wrong and how to fix it, and where
    the value came from (a file, the command line; None where nothing gave it)."""

    __slots__ = ("message", "path", "source")

    def __init__(self, path: str, message: str, source: str | None = None) -> None:
        self.path = path
        self.message = message
        self.source = source

    def __str__(self) -> str:
        where = f" ({self.source})" if self.source else ""
        return f"{self.path}{where}: {self.message}" if self.path else self.message + where

    def __repr__(self) -> str:
        return f"Problem({self.path!r}, {self.message!r}, {self.source!r})"


class ConfigError(LoopbusError):
    """Raised when a ``loopbus fit|validate|test|predict|sweep`` command line or one of
    its configuration files is wrong: ``problems`` lists each bad key with its full path,
    the bad value and the fix. Raised before the module or the data are built and before
    anything is written; the command exits with status 2."""

    def __init__(self, problems: Iterable[Problem]) -> None:
        self.problems = list(problems)
        count = len(self.problems)
        head = (
            "the configuration has 1 error"
            if count == 1
            else f"the configuration has {count} errors"
        )
        super().__init__(head + ":\n" + "\n".join(f"  {p}" for p in self.problems))


def did_you_mean(name: str, known: Iterable[str], *, listing: bool = True) -> str:
    """``"; did you mean 'x'?"`` for the closest of ``known`` to ``name``, else (with
    ``listing``) the list of what is known."""
    choices = sorted(set(known))
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    close = close or [c for c in choices if c.startswith(name)][:1]  # an abbreviation
    if close:
        return f"; did you mean {close[0]!r}?"
    if not listing:
        return ""
    shown = ", ".join(choices[:40]) + (", ..." if len(choices) > 40 else "")
    return f"; the keys here are: {shown}" if choices else ""
