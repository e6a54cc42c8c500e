"""How a stage is called: ``loopbus.run`` (a stage from synchronous code, via
``anyio.run``), the stage methods that run to completion when called with no event loop
running (:func:`stage_method`), and the answers to Lightning's argument names."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

import anyio
import sniffio

__all__ = ["lightning_arguments", "run", "run_or_return", "running_library", "stage_method"]

T = TypeVar("T")
P = ParamSpec("P")


def running_library() -> str | None:
    """The async library whose event loop runs in this thread ("asyncio", "trio"), or
    None when none does (plain synchronous code, a worker thread)."""
    try:
        return sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        pass
    import asyncio

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return None
    return "asyncio"


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
        raise TypeError(
            f"loopbus.run() needs an async function such as trainer.fit, got {func!r}. "
            "Called from synchronous code, trainer.fit(module, data) runs the stage itself "
            "and returns its result: call it directly, or pass the function and its "
            "arguments: loopbus.run(trainer.fit, module, data)."
        )
    library = running_library()
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


def stage_method(method: Callable[P, Coroutine[Any, Any, T]]) -> Callable[P, Any]:
    """A stage method (``fit``, ``validate``, ``test``, ``predict``) that works from both
    kinds of code: called while an event loop runs in this thread (async code, a
    notebook, ``loopbus.run``, a task group) it returns the coroutine to await, as an
    ``async def`` does; called from synchronous code it runs the stage to completion in
    a new asyncio event loop (as ``loopbus.run`` does) and returns its result."""

    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        return run_or_return(functools.partial(method, *args, **kwargs))

    return call


def run_or_return(start: Callable[[], Coroutine[Any, Any, T]]) -> Any:
    """``start()``'s coroutine, to await, while an event loop runs in this thread (async
    code, a notebook, ``loopbus.run``); with none running (synchronous code), its result,
    run to completion in a new asyncio event loop. What the stage methods do, for tools
    that run stages (``find_lr``, ``find_batch_size``)::

        return loopbus.run_or_return(functools.partial(search, trainer, module, data))
    """
    if running_library() is not None:
        return start()
    return anyio.run(start)


#: Lightning's argument names, and what to write instead.
_LIGHTNING = {
    "model": "the module is the first argument: trainer.{stage}(module, ...)",
    "train_dataloaders": "the training loader is `train_data`: trainer.fit(module, train_data, val_data)",
    "val_dataloaders": "the validation loader is `val_data`: trainer.fit(module, train_data, val_data)",
    "dataloaders": "the loader is `data`: trainer.{stage}(module, data)",
    "verbose": "the results table is the ProgressBar plugin's option: ProgressBar(results_table=False)",
    "return_predictions": "predict always returns the outputs",
    "weights_only": "ckpt_path loads a checkpoint's tensors only and never unpickles code",
}


def lightning_arguments(stage: str, given: dict[str, Any]) -> TypeError:
    """The error for keyword arguments a stage method does not take: Lightning's names
    answered with loopbus's way, anything else named as unknown."""
    lines = []
    for name in given:
        hint = _LIGHTNING.get(name)
        if hint is not None:
            lines.append(f"`{name}` is Lightning's name; {hint.format(stage=stage)}.")
        else:
            lines.append(f"`{name}` is not an argument of {stage}().")
    return TypeError(f"trainer.{stage}() got unexpected arguments: " + " ".join(lines))
