"""Batch sources: what hands a loop its batches, one ahead, and keeps the position of a
stateful loader as of the last batch handed out.

* :class:`BatchSource` fetches inline, on the loop's thread (``Trainer(prefetch=0)``);
* :class:`ThreadedBatchSource` has a worker thread fetch up to ``depth`` batches ahead
  (``Trainer(prefetch=N)``);
* :class:`MovingSource` moves each batch to a device as the loop takes it (on the
  compute stream);
* ``CudaBatchSource`` (in ``_device``) copies batches to a CUDA device ahead of the step,
  on a side stream.

Which of these a stage uses is chosen once, when the stage starts, by a
:class:`Sources` built from the trainer's options; the loops call :meth:`Sources.open`
and never ask which kind they got.
"""

from __future__ import annotations

import math
import queue
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from .._exceptions import MisconfigurationError
from ._device import move_batch

__all__ = [
    "BatchSource",
    "MovingSource",
    "Source",
    "Sources",
    "ThreadedBatchSource",
    "batch_limit",
    "skip_consumed",
]

_UNSET: Any = object()
_END: Any = object()


class Source(Protocol):
    """What a loop asks of its batch source."""

    def has_next(self) -> bool:
        """Whether a batch is left (fetching it if needed)."""

    def look_ahead(self) -> bool:
        """Inside an iteration: whether a batch follows the one in flight."""

    def take(self) -> Any:
        """The next batch (``has_next`` returned True)."""

    def position(self) -> dict[str, Any] | None:
        """The loader's position as of the last batch handed out (None: untracked)."""

    def exhausted(self) -> bool:
        """Whether the data is known to have run out."""

    def close(self) -> None:
        """Release what the source holds (a worker thread, batches copied ahead)."""


class BatchSource:
    """Hands a loop its batches: one ahead, lazily, so ``done`` can tell whether one is
    left, and keeps the position of a stateful loader as of the last batch handed out.

    * :meth:`has_next` (``done``, between iterations) fetches the batch the next
      iteration trains on, after the previous iteration's events (a checkpoint saved at
      ``TrainBatchCompleted`` sees the loader right after the batch it trained on).
    * :meth:`look_ahead` (inside an iteration: is the batch in flight the last one?)
      fetches too, but first records the loader's position, since the batch it fetches
      has not been trained on.
    * :meth:`position` is the loader state a checkpoint saves: the recorded one while
      a batch fetched ahead is waiting, else the loader's own.
    """

    __slots__ = ("__weakref__", "_pending", "_recorded", "iterator", "loader", "next")

    def __init__(self, iterator: Iterator[Any], loader: Any = None) -> None:
        self.iterator = iterator
        #: The stateful loader whose position is tracked, or None.
        self.loader = loader
        self.next: Any = _UNSET
        self._recorded: dict[str, Any] | None = None
        self._pending: dict[str, Any] | None = None

    def exhausted(self) -> bool:
        """Whether the iterator is known to have run out (a look-ahead found its end)."""
        return self.next is _END

    def close(self) -> None:
        """Release what the source holds (nothing to stop for an inline source)."""

    def has_next(self) -> bool:
        if self.next is _UNSET:
            self.next = next(self.iterator, _END)
        return self.next is not _END

    def look_ahead(self) -> bool:
        """Whether a batch follows the one in flight (fetching it if needed)."""
        if self.next is _UNSET and self.loader is not None:
            self._recorded = self.loader.state_dict()
        return self.has_next()

    def take(self) -> Any:
        """The next batch (``has_next`` must have returned True)."""
        batch = self.next
        self.next = _UNSET
        self._recorded = None
        return batch

    def position(self) -> dict[str, Any] | None:
        """The loader's position as of the last batch handed out (None: untracked)."""
        if self._recorded is not None:
            return self._recorded
        return None if self.loader is None else self.loader.state_dict()


class ThreadedBatchSource(BatchSource):
    """A :class:`BatchSource` whose batches are fetched by a worker thread, up to
    ``depth`` ahead, while the steps run (``Trainer(prefetch=N)`` on CPU): loading that
    releases the GIL (file I/O, decoding in C, torch ops) overlaps with the step.

    The worker records a stateful loader's position right after fetching each batch,
    so :meth:`position` is that of the last batch handed out, never of one fetched
    ahead. Close it (the loops do, however the run ends) to stop the worker.
    """

    __slots__ = ("_closed", "_error", "_prepare", "_queue", "_thread")

    def __init__(
        self,
        iterator: Iterator[Any],
        loader: Any = None,
        depth: int = 1,
        prepare: Callable[[Any], Any] | None = None,
    ) -> None:
        super().__init__(iterator, loader)
        # Applied to every batch on the worker (pinning it for a device copy).
        self._prepare = prepare
        self._queue: queue.Queue[tuple[Any, Any]] = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._error: BaseException | None = None
        # The position before any batch, and the first batch, are taken here on the
        # calling thread: a shuffled loader draws its order from the global generators
        # at its first fetch, which must not race with the step's draws.
        if loader is not None:
            self._recorded = loader.state_dict()
        try:
            first = next(iterator)
            if prepare is not None:
                first = prepare(first)
        except StopIteration:
            first = _END
        self._queue.put((first, None if loader is None else loader.state_dict()))
        del first
        self._thread = threading.Thread(target=self._fetch, name="loopbus-prefetch", daemon=True)
        if self._queue.queue[0][0] is not _END:
            self._thread.start()

    def _fetch(self) -> None:
        put = self._queue.put
        closed = self._closed
        prepare = self._prepare
        try:
            for batch in self.iterator:
                if prepare is not None:
                    batch = prepare(batch)
                item = (batch, None if self.loader is None else self.loader.state_dict())
                while not closed.is_set():
                    try:
                        put(item, timeout=0.05)
                        break
                    except queue.Full:
                        continue
                else:
                    return
                del batch, item
        except BaseException as exc:  # handed to the consumer, raised there
            self._error = exc
        while not closed.is_set():
            try:
                put((_END, None), timeout=0.05)
                return
            except queue.Full:
                continue

    def has_next(self) -> bool:
        if self.next is _UNSET:
            batch, position = self._queue.get()
            if batch is _END and self._error is not None:
                error, self._error = self._error, None
                raise error
            self.next = batch
            self._pending = position
        return self.next is not _END

    def look_ahead(self) -> bool:
        return self.has_next()

    def take(self) -> Any:
        batch = self.next
        self.next = _UNSET
        self._recorded = self._pending
        self._pending = None
        return batch

    def position(self) -> dict[str, Any] | None:
        return self._recorded

    def close(self) -> None:
        """Stop the worker and wait for it (it finishes the fetch in progress)."""
        self._closed.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread.is_alive():
            self._thread.join()
        self.next = _END


class MovingSource:
    """Wraps a source: each batch moves to ``device`` (``non_blocking``) as the loop takes
    it, on the current (compute) stream. For a device without side-stream prefetch."""

    __slots__ = ("_device", "_inner")

    def __init__(self, inner: Source, device: torch.device) -> None:
        self._inner = inner
        self._device = device

    def has_next(self) -> bool:
        return self._inner.has_next()

    def look_ahead(self) -> bool:
        return self._inner.look_ahead()

    def take(self) -> Any:
        return move_batch(self._inner.take(), self._device)

    def position(self) -> dict[str, Any] | None:
        return self._inner.position()

    def exhausted(self) -> bool:
        return self._inner.exhausted()

    def close(self) -> None:
        self._inner.close()


class Sources:
    """How a stage's loops get their batches, chosen once from the trainer's options:
    ``prefetch`` batches fetched ahead by a worker thread (0: inline), ``prepare``
    applied to each batch on that worker (pinning it), and either ``device_source``
    (wraps the host source to copy batches to a device ahead of the step) or
    ``move_to`` (batches moved as the loop takes them) or neither (batches stay where
    the loader put them)."""

    __slots__ = ("device_source", "move_to", "prefetch", "prepare")

    def __init__(
        self,
        *,
        prefetch: int = 0,
        prepare: Callable[[Any], Any] | None = None,
        move_to: torch.device | None = None,
        device_source: Callable[..., Source] | None = None,
    ) -> None:
        self.prefetch = prefetch
        self.prepare = prepare
        self.move_to = move_to
        self.device_source = device_source

    def open(self, iterator: Iterator[Any], loader: Any = None) -> Source:
        """A source over ``iterator``; ``loader`` (a stateful loader, or None) is the one
        whose position is tracked."""
        source: Source
        if self.prefetch:
            source = ThreadedBatchSource(iterator, loader, self.prefetch, self.prepare)
        else:
            source = BatchSource(iterator, loader)
        if self.device_source is not None:
            return self.device_source(source, pin=self.prepare is None)
        if self.move_to is not None:
            return MovingSource(source, self.move_to)
        return source


def batch_limit(value: int | float | None, data: Any, option: str) -> float:
    """Number of batches allowed by ``limit_*_batches``: an int is a count, a float a
    fraction of ``len(data)``; None means no limit (inf)."""
    if value is None:
        return math.inf
    if isinstance(value, float):
        try:
            n = len(data)
        except TypeError:
            if value == 1.0:
                return math.inf
            raise MisconfigurationError(
                f"{option}={value!r} is a fraction, but the data has no len(); pass a "
                "number of batches (an int) instead."
            ) from None
        return float(int(n * value))
    return float(value)


def skip_consumed(iterator: Iterator[Any], consumed: int, warn: bool) -> None:
    """Drop the ``consumed`` batches a plain loader yields again on a mid-epoch resume."""
    if warn:
        warnings.warn(
            f"resuming mid-epoch by skipping the {consumed} batches this epoch "
            "already consumed, in the same (shuffled) order as before: the data "
            "loader is not stateful, so they are loaded again and dropped. Use "
            "torchdata.stateful_dataloader.StatefulDataLoader to resume in O(1).",
            UserWarning,
            stacklevel=5,
        )
    for _ in range(consumed):
        try:
            next(iterator)
        except StopIteration:
            break
