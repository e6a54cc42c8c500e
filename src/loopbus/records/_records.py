"""``put``: the front end through which modules and plugins hand metric records to the
trainer's recorder.

``put`` checks the name, value and destinations at the call site (see ``_checks``; each
distinct name once) and queues a typed entry (``_entries.PendingPut``) with the
recorder's pending records; nothing is converted or delivered there. The recorder
flushes them at step and hook boundaries (see ``_recorder``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from ._checks import (
    INT_MAX,
    INT_MIN,
    TENSOR_DTYPES,
    check_tensor,
    checked,
    coerce,
    described,
    int_out_of_range,
    validate_name,
)
from ._destinations import ALL, checked_destinations, normalize_destinations
from ._entries import PendingPut

if TYPE_CHECKING:
    from ._recorder import Recorder

__all__ = ["PutMixin"]

_Tensor = torch.Tensor

#: Names already validated (so that each distinct name is checked once). Cleared when
#: it grows this large, so names made up per step cannot grow it without bound.
_VALID_NAMES: set[str] = set()
_VALID_NAMES_LIMIT = 1 << 16


def _check_name(name: Any) -> None:
    """Raise unless ``name`` is a name every consumer can carry; remember it if it is."""
    validate_name(name)
    if len(_VALID_NAMES) >= _VALID_NAMES_LIMIT:
        _VALID_NAMES.clear()
    _VALID_NAMES.add(name)


class PutMixin:
    """Gives ``put`` and ``put_dict`` to modules and plugins.

    Where records go is bound explicitly: the trainer calls :meth:`bind_recorder` on the
    module and on each plugin when a stage starts (and with None when it ends)."""

    # (recorder, source): one attribute, so ``put`` reads it once (on an nn.Module each
    # attribute read passes through its __getattr__ hook).
    _loopbus_binding: tuple[Recorder | None, str] = (None, "")

    def bind_recorder(self, recorder: Recorder | None, source: str = "") -> None:
        """Send this object's ``put`` records to ``recorder`` with ``source`` as their
        source (None: outside a stage, where ``put`` raises). Called by the trainer when
        a stage starts and ends."""
        # Its own attributes, set past nn.Module.__setattr__ (not parameters or buffers).
        object.__setattr__(self, "_loopbus_binding", (recorder, source))

    def __getstate__(self) -> Any:
        """What a copy or a pickle keeps: everything but the stage's binding. A copy made
        during a stage (an averaged model, say) is not bound to its recorder: its ``put``
        raises until a trainer binds it, and the recorder is not copied along."""
        state = super().__getstate__()  # type: ignore[misc]
        if isinstance(state, dict) and "_loopbus_binding" in state:
            state = {k: v for k, v in state.items() if k != "_loopbus_binding"}
        return state

    def put(self, name: str, value: Any, destinations: Any = None) -> None:
        """Publish ``value`` under ``name`` to ``destinations`` (default: all of
        ``"callbacks"``, ``"loggers"``, ``"progress_bar"`` and ``"external"``).

        ``value`` is a Python number or a one-element tensor (detached here; it is read
        on the host later, off the step's critical path). Nothing is aggregated: use
        torchmetrics for running means and cross-rank reduction.

        What every consumer (loggers, the stream, the progress bar) can carry is checked
        here, and anything else raises here rather than in a consumer later: ``name`` is
        a non-empty str of at most 256 characters, valid Unicode (no lone surrogates),
        without control characters or line separators; an int is within
        ``[-2**63, 2**64 - 1]``; a tensor has one element and a bool, integer or
        floating-point dtype. NaN and infinite floats are fine.

        In a stage with ``Trainer(compile=...)`` put takes a path compiled code can trace
        without a graph break or a changing guard: the same checks, nothing remembered
        (they run once, when the step is traced), and during a step the entry appended
        to the recorder's step buffer (always empty when a step starts), which compiled
        code does after its graph has run (the tensors are the graph's outputs). The
        recorder moves them to the pending records when the step returns
        (:meth:`Recorder.run_compiled`), and the step boundary flushes them as in eager
        mode. Both paths run the same checks (``_checks.checked`` is the whole check;
        the eager path inlines its common cases and falls back to the same functions).
        """
        recorder, source = self._loopbus_binding
        if recorder is None or recorder.compiled:
            self._put_checked(recorder, name, value, destinations)
            return
        if type(name) is not str or name not in _VALID_NAMES:
            _check_name(name)
        cls = type(value)
        if cls is _Tensor or isinstance(value, _Tensor):
            # A 0-d tensor of a readable dtype passes at once (compressed sparse and mkldnn
            # layouts cannot be 0-d); any other tensor takes the whole check.
            if value.dim() or value.dtype not in TENSOR_DTYPES or value.is_meta:
                check_tensor(name, value)
            if value.requires_grad:
                # The same storage without the graph: what detach() gives a record that
                # is read and never differentiated, without a dispatch (half the cost).
                value = value.data
        elif cls is int:
            if not INT_MIN <= value <= INT_MAX:
                raise int_out_of_range(name, value)
        elif cls is not float and cls is not bool:
            value = coerce(name, value)
        destinations = ALL if destinations is None else normalize_destinations(destinations)
        recorder.enqueue(PendingPut(name, value, destinations, source))

    def _put_checked(
        self, recorder: Recorder | None, name: Any, value: Any, destinations: Any
    ) -> None:
        """``put`` with the whole check and nothing remembered: in a compiled stage (what
        compiled code traces), and outside a stage (where it raises after the checks)."""
        value = checked(name, value)
        routed = ALL if destinations is None else checked_destinations(destinations)
        if recorder is None:
            raise RuntimeError(
                f"{type(self).__name__}.put({name!r}, ...) was called outside a Trainer stage; "
                "call it from a step or an event handler while fit/validate/test/predict runs."
            )
        recorder.queue_put(name, value, routed, self._loopbus_binding[1])

    def put_dict(self, values: Mapping[str, Any], destinations: Any = None) -> None:
        """``put`` every item of ``values``: all of them, or (when one is refused) none."""
        if not isinstance(values, Mapping):
            raise TypeError(
                f"put_dict() needs a mapping of name -> value, got {described(values)}."
            )
        recorder, source = self._loopbus_binding
        if recorder is not None and recorder.compiled:
            # Every entry checked before any is queued: nothing reads the pending list
            # (whose length would be a guard of compiled code).
            entries = [
                (
                    name,
                    checked(name, value),
                    ALL if destinations is None else checked_destinations(destinations),
                    source,
                )
                for name, value in values.items()
            ]
            for entry in entries:
                recorder.queue_put(*entry)
            return
        mark = recorder.pending_count if recorder is not None else 0
        try:
            for name, value in values.items():
                self.put(name, value, destinations)
        except BaseException:
            if recorder is not None:
                recorder.retract(mark)  # the items put before the refused one
            raise

