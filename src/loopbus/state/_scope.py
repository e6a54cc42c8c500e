"""Scopes: per-run and per-iteration state that is dropped for you.

A loop's ``run()`` opens a run scope and each iteration an iteration scope whose parent
is the run scope. Hooks of one iteration share values through it (``ctx.batch = ...``);
reading a name the scope lacks looks it up in the enclosing scopes. When the iteration
ends its scope is cleared, so nothing it held outlives it by accident.

Dropping a scope drops references. It never frees tensor storage by force: a tensor that
autograd or a view still holds stays valid.

With a leak check on (``leak_check="raise"`` or ``"warn"``), a dropped scope verifies
through weak references that what it held was freed, and names the value, the loop and
the hook that set it when something kept it alive.
"""

from __future__ import annotations

import gc
import os
import types
import warnings
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from .._exceptions import ScopeLeakError

__all__ = [
    "LeakCheck",
    "leak_check_from_env",
    "Scope",
    "TrackedScope",
    "check_suspects",
    "collect_suspects",
    "drop_scope",
    "new_scope",
]

LeakCheck = Literal["raise", "warn"] | None


def leak_check_from_env() -> LeakCheck:
    """The leak check ``LOOPBUS_LEAK_CHECK`` asks for ("raise" or "warn"), else None."""
    value = os.environ.get("LOOPBUS_LEAK_CHECK", "").strip().lower()
    if value in ("raise", "warn"):
        return value  # type: ignore[return-value]
    return None

_RESERVED = frozenset({"promote", "detach", "borrow", "get", "parent", "names"})


class Scope:
    """Shared state of one run or one iteration of a loop (the ``ctx`` of its hooks).

    * ``ctx.name = value`` stores a value for the rest of this scope.
    * ``ctx.name`` reads it, falling back to enclosing scopes.
    * ``ctx.promote("name")`` moves a value to the enclosing scope.
    * ``ctx.detach("name")`` removes a value from scope management and returns it.
    * ``ctx.borrow("name", value)`` stores a value owned elsewhere (a long-lived object);
      the leak check does not expect it to be freed.
    """

    __slots__ = ("__dict__", "__weakref__", "_borrowed", "_parent")

    _parent: Scope | None
    _borrowed: set[str] | None

    if TYPE_CHECKING:  # values are set dynamically: ``ctx.anything = value``

        def __setattr__(self, name: str, value: Any) -> None: ...

    def __getattr__(self, name: str) -> Any:
        # Only called when ``name`` is not in this scope: look outward.
        if name.startswith("_"):
            raise AttributeError(name)
        parent = self._parent
        while parent is not None:
            d = parent.__dict__
            if name in d:
                return d[name]
            parent = parent._parent
        raise AttributeError(
            f"ctx has no value {name!r} in this scope or the scopes around it. Set it in an "
            f"earlier hook (ctx.{name} = ...), or if it was set in an iteration that has "
            f"ended, promote it there with ctx.promote({name!r})."
        )

    @property
    def parent(self) -> Scope | None:
        """The enclosing scope (the run scope of an iteration scope), or None."""
        return self._parent

    def names(self) -> list[str]:
        """The names held by this scope itself (not by enclosing scopes)."""
        return list(self.__dict__)

    def __contains__(self, name: str) -> bool:
        scope: Scope | None = self
        while scope is not None:
            if name in scope.__dict__:
                return True
            scope = scope._parent
        return False

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.__dict__))

    def get(self, name: str, default: Any = None) -> Any:
        """``ctx.name`` if set here or in an enclosing scope, else ``default``."""
        scope: Scope | None = self
        while scope is not None:
            d = scope.__dict__
            if name in d:
                return d[name]
            scope = scope._parent
        return default

    def promote(self, name: str) -> Any:
        """Move ``name`` to the enclosing scope, so it lives as long as that scope."""
        parent = self._parent
        if parent is None:
            raise ValueError(
                f"cannot promote {name!r}: this is the outermost scope. Use "
                f"ctx.detach({name!r}) to take the value out of scope management."
            )
        value = self._pop(name, "promote")
        parent._store(name, value, self._origin_of(name))
        return value

    def detach(self, name: str) -> Any:
        """Remove ``name`` from the scope and return it; the caller now owns it."""
        return self._pop(name, "detach")

    def borrow(self, name: str, value: Any) -> None:
        """Store a value whose lifetime is managed elsewhere (exempt from the leak check)."""
        self.__dict__[name] = value
        if self._borrowed is None:
            self._borrowed = set()
        self._borrowed.add(name)

    def __repr__(self) -> str:
        return f"<Scope {sorted(self.__dict__)}>"

    # -- internals shared with TrackedScope
    def _pop(self, name: str, action: str) -> Any:
        try:
            value = self.__dict__.pop(name)
        except KeyError:
            raise KeyError(
                f"cannot {action} {name!r}: it is not set in this scope "
                f"(names here: {sorted(self.__dict__)})."
            ) from None
        if self._borrowed is not None:
            self._borrowed.discard(name)
        return value

    def _origin_of(self, name: str) -> tuple[str, str] | None:
        return None

    def _store(self, name: str, value: Any, origin: tuple[str, str] | None) -> None:
        self.__dict__[name] = value


def plain_scope(parent: Scope | None) -> Scope:
    """An untracked scope inside ``parent`` (the hot path: no leak check)."""
    scope = Scope()
    scope._parent = parent
    scope._borrowed = None
    return scope


def new_scope(parent: Scope | None, tracked: bool, loop: str = "") -> Scope:
    scope: Scope = TrackedScope(loop) if tracked else Scope()
    scope._parent = parent
    scope._borrowed = None
    return scope


class TrackedScope(Scope):
    """A scope that remembers which loop and hook set each value (leak-check mode)."""

    __slots__ = ("_hook", "_loop", "_origins")

    _loop: str
    _hook: str
    _origins: dict[str, tuple[str, str]]

    def __init__(self, loop: str = "") -> None:
        object.__setattr__(self, "_loop", loop)
        object.__setattr__(self, "_hook", "")
        object.__setattr__(self, "_origins", {})

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_"):
            object.__setattr__(self, name, value)
            return
        if name in _RESERVED:
            raise AttributeError(
                f"ctx.{name} is a Scope method; store your value under another name."
            )
        self.__dict__[name] = value
        self._origins[name] = (self._loop, self._hook)

    def enter_hook(self, hook: str) -> None:
        """Name the hook that runs now: values set from here on are traced to it."""
        object.__setattr__(self, "_hook", hook)

    def _origin_of(self, name: str) -> tuple[str, str] | None:
        return self._origins.pop(name, None)

    def _store(self, name: str, value: Any, origin: tuple[str, str] | None) -> None:
        self.__dict__[name] = value
        self._origins[name] = origin or (self._loop, self._hook)


def _weak_targets(name: str, value: Any, depth: int = 0) -> Iterator[tuple[str, Any]]:
    """(label, object) pairs of what can be tracked weakly inside ``value``."""
    if depth > 3:
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _weak_targets(f"{name}[{i}]", item, depth + 1)
        if isinstance(value, tuple):
            return
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _weak_targets(f"{name}[{key!r}]", item, depth + 1)
    if isinstance(value, (str, bytes, int, float, bool, type(None), type)):
        return
    yield name, value


def _holders(obj: Any, max_depth: int = 4) -> str:
    """Best effort: name the attributes that (through a few containers) keep ``obj``."""
    found: list[str] = []
    targets: list[Any] = [obj]
    seen = {id(obj), id(targets)}
    for depth in range(max_depth):
        following: list[Any] = []
        seen.add(id(following))
        for target in targets:
            for ref in gc.get_referrers(target):
                if id(ref) in seen or isinstance(ref, types.FrameType):
                    continue
                seen.add(id(ref))
                if isinstance(ref, dict):
                    mapping: dict[Any, Any] = ref
                    for owner in gc.get_referrers(mapping):
                        if getattr(owner, "__dict__", None) is mapping and not isinstance(
                            owner, Scope
                        ):
                            key = next((k for k, v in mapping.items() if v is target), "?")
                            via = f" (through {depth} container(s))" if depth else ""
                            found.append(f"{type(owner).__name__}.{key}{via}")
                    following.append(ref)
                elif isinstance(ref, (list, tuple, set, frozenset)):
                    following.append(ref)
                elif not isinstance(ref, Scope):
                    # Python >= 3.11 keeps attributes inline: the owner itself refers.
                    attrs = getattr(ref, "__dict__", None)
                    if isinstance(attrs, dict):
                        for key, val in attrs.items():
                            if val is target:
                                via = f" (through {depth} container(s))" if depth else ""
                                found.append(f"{type(ref).__name__}.{key}{via}")
        if found:
            break
        targets = following
    return ", ".join(found[:3]) if found else "an unknown referrer"


def _owned_outside(scope: Scope, name: str, value: Any) -> bool:
    """Whether an enclosing scope holds the same object under ``name`` (``ctx.x -= 1``
    in an iteration stores the run scope's value in the iteration scope too)."""
    parent = scope._parent
    while parent is not None:
        if parent.__dict__.get(name, _MISSING) is value:
            return True
        parent = parent._parent
    return False


_MISSING = object()


def _weak_refs(scope: Scope) -> list[tuple[str, str, weakref.ref[Any]]]:
    borrowed = scope._borrowed or set()
    refs: list[tuple[str, str, weakref.ref[Any]]] = []
    for name, value in scope.__dict__.items():
        if name in borrowed or _owned_outside(scope, name, value):
            continue
        for label, target in _weak_targets(name, value):
            try:
                refs.append((name, label, weakref.ref(target)))
            except TypeError:
                continue
    return refs


Suspect = tuple[str, str, "weakref.ref[Any]", tuple[str, str]]


def collect_suspects(scope: Scope) -> list[Suspect]:
    """Clear ``scope`` and return weak references to what it held that is still alive.

    Those are only suspects: a data source may legitimately hold the last batch until it
    is asked for the next one (a generator's frame does), so loops verify them one
    iteration later with :func:`check_suspects`.
    """
    if not isinstance(scope, TrackedScope):
        scope.__dict__.clear()
        return []
    refs = _weak_refs(scope)
    origins = dict(scope._origins)
    scope._origins.clear()
    scope.__dict__.clear()
    default = (scope._loop, "?")
    return [
        (name, label, ref, origins.get(name, default))
        for name, label, ref in refs
        if ref() is not None
    ]


def check_suspects(suspects: list[Suspect], leak_check: LeakCheck) -> None:
    """Raise (or warn) for the suspects that are still alive, after a garbage collection."""
    if leak_check is None or not suspects:
        return
    alive = [s for s in suspects if s[2]() is not None]
    if not alive:
        return
    gc.collect()
    alive = [s for s in alive if s[2]() is not None]
    if not alive:
        return
    lines = []
    for _name, label, ref, (loop, hook) in alive:
        obj = ref()
        what = type(obj).__name__
        shape = getattr(obj, "shape", None)
        if shape is not None:
            what += f" of shape {tuple(shape)}"
        lines.append(
            f"ctx.{label} ({what}), set by loop {loop!r} in {hook or 'run'}, is still alive "
            f"after its scope was dropped; held by {_holders(obj)}"
        )
        del obj
    message = (
        "scope leak: "
        + "; ".join(lines)
        + ". Drop that reference, or if the value must outlive the scope, "
        "use ctx.promote(name) or ctx.detach(name)."
    )
    if leak_check == "raise":
        raise ScopeLeakError(message)
    warnings.warn(message, ResourceWarning, stacklevel=3)


def drop_scope(scope: Scope, leak_check: LeakCheck = None) -> None:
    """Clear ``scope``; with ``leak_check``, verify at once that what it held was freed."""
    if leak_check is None or not isinstance(scope, TrackedScope):
        scope.__dict__.clear()
        return
    check_suspects(collect_suspects(scope), leak_check)
