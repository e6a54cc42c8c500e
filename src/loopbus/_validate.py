"""Checks for options, with one wording for the checks every constructor repeats.

Each check returns the value it accepted, so a constructor reads
``self.every = check_int("every", every, allow_none=True)``, and raises
:class:`MisconfigurationError` (a ``ValueError``) with a full sentence: the option,
the bad value and what to pass instead::

    Checkpoint(every_n_steps=...) must be an int >= 1, got 0; None turns it off.

``owner`` names the class or function the option belongs to (``"Checkpoint"`` above);
without it the sentence starts with the option's name. ``hint`` adds a clause on how to
fix it or what a special value means. ``error`` picks a subclass of
:class:`MisconfigurationError` to raise instead, such as :class:`SubscriptionError`.

This module imports nothing from loopbus but the exceptions, and nothing from torch, so
every layer may use it. Plugins reach these checks as ``loopbus.check_int`` and so on.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Literal, TypeVar, overload

from ._exceptions import MisconfigurationError

__all__ = ["check_choice", "check_int", "check_local_path", "check_number"]

T = TypeVar("T")


def _fail(
    subject: str,
    requirement: str,
    value: object,
    hint: str | None,
    error: type[MisconfigurationError],
) -> MisconfigurationError:
    tail = f"; {hint}." if hint else "."
    return error(f"{subject} must be {requirement}, got {value!r}{tail}")


def _subject(name: str, owner: str | None) -> str:
    return f"{owner}({name}=...)" if owner else name


def _bounds(
    minimum: float | None,
    maximum: float | None,
    exclusive_minimum: float | None = None,
) -> str:
    if exclusive_minimum is not None:
        if maximum is not None:
            return f" in ({exclusive_minimum}, {maximum}]"
        return f" > {exclusive_minimum}"
    if minimum is not None and maximum is not None:
        return f" from {minimum} to {maximum}"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


@overload
def check_int(
    name: str,
    value: object,
    *,
    minimum: int | None = ...,
    maximum: int | None = ...,
    allow_none: Literal[False] = ...,
    owner: str | None = ...,
    hint: str | None = ...,
    error: type[MisconfigurationError] = ...,
) -> int: ...


@overload
def check_int(
    name: str,
    value: object,
    *,
    minimum: int | None = ...,
    maximum: int | None = ...,
    allow_none: bool,
    owner: str | None = ...,
    hint: str | None = ...,
    error: type[MisconfigurationError] = ...,
) -> int | None: ...


def check_int(
    name: str,
    value: object,
    *,
    minimum: int | None = 1,
    maximum: int | None = None,
    allow_none: bool = False,
    owner: str | None = None,
    hint: str | None = None,
    error: type[MisconfigurationError] = MisconfigurationError,
) -> int | None:
    """Return ``value`` if it is an int in ``[minimum, maximum]`` (None: unbounded), or
    None when ``allow_none``; raise otherwise. A bool is not an int here."""
    if value is None and allow_none:
        return None
    if (
        isinstance(value, int)
        and not isinstance(value, bool)
        and (minimum is None or value >= minimum)
        and (maximum is None or value <= maximum)
    ):
        return value
    raise _fail(_subject(name, owner), f"an int{_bounds(minimum, maximum)}", value, hint, error)


@overload
def check_number(
    name: str,
    value: object,
    *,
    minimum: float | None = ...,
    exclusive_minimum: float | None = ...,
    maximum: float | None = ...,
    allow_none: Literal[False] = ...,
    owner: str | None = ...,
    what: str = ...,
    hint: str | None = ...,
    error: type[MisconfigurationError] = ...,
) -> float: ...


@overload
def check_number(
    name: str,
    value: object,
    *,
    minimum: float | None = ...,
    exclusive_minimum: float | None = ...,
    maximum: float | None = ...,
    allow_none: bool,
    owner: str | None = ...,
    what: str = ...,
    hint: str | None = ...,
    error: type[MisconfigurationError] = ...,
) -> float | None: ...


def check_number(
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    exclusive_minimum: float | None = None,
    maximum: float | None = None,
    allow_none: bool = False,
    owner: str | None = None,
    what: str = "a number",
    hint: str | None = None,
    error: type[MisconfigurationError] = MisconfigurationError,
) -> float | None:
    """Return ``float(value)`` if it is an int or float (not a bool, not NaN) that is
    ``>= minimum``, ``> exclusive_minimum`` and ``<= maximum`` (each None: unbounded), or
    None when ``allow_none``; raise otherwise. ``what`` names the kind of number in the
    message, for example ``"a number of seconds"``."""
    if value is None and allow_none:
        return None
    if (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and not math.isnan(value)
        and (minimum is None or value >= minimum)
        and (exclusive_minimum is None or value > exclusive_minimum)
        and (maximum is None or value <= maximum)
    ):
        return float(value)
    requirement = what + _bounds(minimum, maximum, exclusive_minimum)
    raise _fail(_subject(name, owner), requirement, value, hint, error)


def check_choice(
    name: str,
    value: object,
    choices: Mapping[T, str] | Iterable[T],
    *,
    owner: str | None = None,
    hint: str | None = None,
    error: type[MisconfigurationError] = MisconfigurationError,
) -> T:
    """Return the choice that ``value`` equals, if any; raise otherwise. A mapping's
    values describe its choices in the message: ``{"min": "lower is better", ...}``."""
    options = tuple(choices)
    for option in options:
        if value is option or value == option:
            return option
    if isinstance(choices, Mapping):
        described = [f"{option!r} ({choices[option]})" for option in options]
    else:
        described = [repr(option) for option in options]
    if len(described) > 1:
        requirement = f"{', '.join(described[:-1])} or {described[-1]}"
    else:
        requirement = "".join(described)
    raise _fail(_subject(name, owner), requirement, value, hint, error)


#: A URL's scheme: ``s3://``, ``gs://``, ``http://``, ``file://`` (not a Windows drive).
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://")

def check_local_path(name: str, value: T, *, owner: str | None = None) -> T:
    """``value`` as it is, unless it is a URL (``s3://bucket/run``, ``gs://``,
    ``http://``, ``file://``, ...): loopbus reads and writes local paths only for now, and
    a URL taken as a path would write into a local folder named ``s3:`` without a word.
    A mounted filesystem (NFS, a FUSE mount of a bucket) is a local path and works."""
    text: object = value
    if isinstance(value, os.PathLike):
        text = value.__fspath__()
    match = _URL.match(text) if isinstance(text, str) else None
    if match is None:
        return value
    scheme = match.group(1)
    subject = f"{owner}({name}={text!r})" if owner else f"{name}={text!r}"
    raise MisconfigurationError(
        f"{subject} is a URL ({scheme}://), but loopbus reads and writes local paths only "
        "for now: pass a local path (a mounted network filesystem or bucket mount works "
        f"as one) and copy the files to {scheme}:// afterwards."
    )
