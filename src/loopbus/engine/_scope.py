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
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, Literal

from .._exceptions import ScopeLeakError

__all__ = ["LeakCheck", "Scope", "TrackedScope", "drop_scope", "new_scope"]

LeakCheck = Literal["raise", "warn"] | None

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


def new_scope(parent: Scope | None, tracked: bool, loop: str = "") -> Scope:
    scope: Scope = TrackedScope() if tracked else Scope()
    scope._parent = parent
    scope._borrowed = None
    if tracked:
        object.__setattr__(scope, "_loop", loop)
        object.__setattr__(scope, "_hook", "")
        object.__setattr__(scope, "_origins", {})
    return scope


class TrackedScope(Scope):
    """A scope that remembers which loop and hook set each value (leak-check mode)."""

    __slots__ = ("_hook", "_loop", "_origins")

    _loop: str
    _hook: str
    _origins: dict[str, tuple[str, str]]

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


def _holders(obj: Any) -> str:
    """Best effort: describe who still refers to ``obj``."""
    found: list[str] = []
    for ref in gc.get_referrers(obj):
        if isinstance(ref, dict):
            for owner in gc.get_referrers(ref):
                if getattr(owner, "__dict__", None) is ref and not isinstance(owner, Scope):
                    for key, val in ref.items():
                        if val is obj:
                            found.append(f"{type(owner).__name__}.{key}")
                            break
        elif isinstance(ref, list):
            for owner in gc.get_referrers(ref):
                d = getattr(owner, "__dict__", None)
                if isinstance(d, dict):
                    for key, val in d.items():
                        if val is ref:
                            found.append(f"a list in {type(owner).__name__}.{key}")
                            break
        if len(found) >= 3:
            break
    return ", ".join(found) if found else "an unknown referrer"


def _weak_refs(scope: Scope) -> list[tuple[str, str, weakref.ref[Any]]]:
    borrowed = scope._borrowed or set()
    refs: list[tuple[str, str, weakref.ref[Any]]] = []
    for name, value in scope.__dict__.items():
        if name in borrowed:
            continue
        for label, target in _weak_targets(name, value):
            try:
                refs.append((name, label, weakref.ref(target)))
            except TypeError:
                continue
    return refs


def drop_scope(scope: Scope, leak_check: LeakCheck = None) -> None:
    """Clear ``scope``; with ``leak_check``, verify that what it held was freed."""
    if leak_check is None or not isinstance(scope, TrackedScope):
        scope.__dict__.clear()
        return
    refs = _weak_refs(scope)
    origins_copy = dict(scope._origins)
    scope._origins.clear()
    scope.__dict__.clear()
    alive = [(n, label, r) for n, label, r in refs if r() is not None]
    if not alive:
        return
    gc.collect()
    alive = [(n, label, r) for n, label, r in alive if r() is not None]
    if not alive:
        return
    lines = []
    for name, label, ref in alive:
        obj = ref()
        loop, hook = origins_copy.get(name, (scope._loop, "?"))
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
