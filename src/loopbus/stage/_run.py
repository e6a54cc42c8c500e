"""``loopbus.run``: a stage from synchronous code, via ``anyio.run``."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import sniffio

__all__ = ["run"]

T = TypeVar("T")


def run(
    func: Callable[..., Awaitable[T]],
    *args: Any,
    backend: str = "asyncio",
    backend_options: dict[str, Any] | None = None,
    **kwargs: Any,
) -> T:
    """Run ``await func(*args, **kwargs)`` in a new event loop and return its result::

        loopbus.run(trainer.fit, module, train_data, val_data)
        loopbus.run(trainer.fit, module, train_data, backend="trio")
    """
    if inspect.iscoroutine(func):
        func.close()
        raise TypeError(
            "loopbus.run() takes the coroutine function and its arguments, not a coroutine: "
            "write loopbus.run(trainer.fit, module, data), not loopbus.run(trainer.fit(module, data))."
        )
    if not callable(func):
        raise TypeError(f"loopbus.run() needs an async function such as trainer.fit, got {func!r}.")
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        library = None
    if library is None:
        try:
            import asyncio

            asyncio.get_running_loop()
            library = "asyncio"
        except RuntimeError:
            library = None
    if library is not None:
        owner = getattr(func, "__self__", None)
        name = getattr(func, "__name__", "fit")
        call = f"{type(owner).__name__.lower()}.{name}" if owner is not None else name
        raise RuntimeError(
            f"loopbus.run() was called while an {library} event loop is already running "
            "(a notebook, a web app, or other async code), and it cannot start a second one "
            f"in this thread. Await the stage instead: `await {call}(...)` rather than "
            f"`loopbus.run({call}, ...)`; in a notebook cell a top-level `await` works."
        )
    return anyio.run(
        functools.partial(func, *args, **kwargs), backend=backend, backend_options=backend_options
    )
