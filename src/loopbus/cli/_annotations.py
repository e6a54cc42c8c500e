"""Values from a configuration file held against a type annotation: a number written
``3e-4`` (a string to YAML 1.1) read as the float it means, and whether a value can be
an argument of that type where the annotation is simple enough to tell.

Nothing here imports torch or the engine.
"""

from __future__ import annotations

import collections.abc
import os
import re
import types
import typing
from pathlib import PurePath
from typing import Any

__all__ = ["coerce", "describe", "fits"]

_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$|^[+-]?(inf|nan)$", re.I)
_SEQUENCES = (list, tuple, collections.abc.Sequence, collections.abc.Iterable)
_MAPPINGS = (dict, collections.abc.Mapping)
_PATHS = (PurePath, os.PathLike)


def _atoms(annotation: Any) -> list[Any]:
    """The members of a union (``int | None`` -> ``[int, NoneType]``), else ``[it]``."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return [atom for arg in typing.get_args(annotation) for atom in _atoms(arg)]
    if annotation is None:
        return [type(None)]
    return [annotation]


def coerce(value: Any, annotation: Any) -> Any:
    """``value`` as the annotation reads it: a string that is a number (``"3e-4"``, which
    YAML 1.1 leaves a string) becomes a float where the annotation takes floats and no
    strings; anything else is returned as it is."""
    if not isinstance(value, str) or annotation is None or isinstance(annotation, str):
        return value
    atoms = _atoms(annotation)
    takes_float = float in atoms
    takes_str = str in atoms or any(
        typing.get_origin(a) is typing.Literal and value in typing.get_args(a) for a in atoms
    )
    if takes_float and not takes_str and _FLOAT.match(value.strip()):
        return float(value)
    return value


def fits(value: Any, annotation: Any) -> bool | None:
    """Whether ``value`` (plain data from a file) can be an argument annotated
    ``annotation``: True, False, or None where the annotation is no simple type (a class
    of the user's, a callable, a forward reference) and only the callee can tell."""
    if annotation is None or isinstance(annotation, str):
        return None
    unknown = False
    for atom in _atoms(annotation):
        answer = _fits_atom(value, atom)
        if answer:
            return True
        unknown = unknown or answer is None
    return None if unknown else False


def _fits_atom(value: Any, atom: Any) -> bool | None:
    if atom is Any or atom is object:
        return True
    origin = typing.get_origin(atom)
    if origin is typing.Literal:
        return any(value == arg and type(value) is type(arg) for arg in typing.get_args(atom))
    kind = origin if origin is not None else atom
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is str:
        return isinstance(value, str)
    if kind in _PATHS or (isinstance(kind, type) and issubclass(kind, PurePath)):
        return isinstance(value, str)
    if kind in _MAPPINGS:
        return isinstance(value, dict)
    if kind in _SEQUENCES or kind is set or kind is frozenset:
        return isinstance(value, list)
    return None


def describe(annotation: Any) -> str:
    """An annotation as a reader writes it (``int | None``, ``float``)."""
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "").replace("NoneType", "None")
