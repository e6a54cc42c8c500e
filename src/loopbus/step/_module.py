"""``Module``: a ``torch.nn.Module`` with the steps and optimizers of a training run."""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Iterable, Mapping
from types import FrameType, MappingProxyType
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from loopbus.records._records import PutMixin
from loopbus.state._scope import Scope

from .._exceptions import CheckpointError, MisconfigurationError

if TYPE_CHECKING:
    # The public type, for the public signatures (as a user's module names it).
    from loopbus import Trainer

__all__ = ["Module", "check_hparams"]

M = TypeVar("M", bound="Module")

_PLAIN = (type(None), bool, int, float, str)
_NO_HPARAMS: Mapping[str, Any] = MappingProxyType({})


def _plain_problem(value: Any, where: str) -> str | None:
    """Where ``value`` holds something other than None/bool/int/float/str and lists,
    tuples and str-keyed dicts of those (None if nowhere)."""
    if isinstance(value, _PLAIN):
        return None
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            problem = _plain_problem(item, f"{where}[{index}]")
            if problem:
                return problem
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"{where} has the key {key!r}, which is not a str"
            problem = _plain_problem(item, f"{where}[{key!r}]")
            if problem:
                return problem
        return None
    return f"{where} is a {type(value).__name__}"


def check_hparams(hparams: Mapping[str, Any], owner: str) -> dict[str, Any]:
    """A deep copy of ``hparams`` after checking that it holds plain values only."""
    for name, value in hparams.items():
        problem = _plain_problem(value, repr(name))
        if problem:
            raise MisconfigurationError(
                f"{owner}.save_hyperparameters() keeps plain values only (None, bool, int, "
                f"float, str, and lists, tuples and dicts of those), so that checkpoints "
                f"load weights-only; argument {problem}. Leave it out with "
                f"save_hyperparameters(ignore=[{name!r}]) or name the ones to keep."
            )
    return copy.deepcopy(dict(hparams))


def _frame_arguments(frame: FrameType) -> dict[str, Any]:
    """The arguments of the function running in ``frame``, as it received them (but for
    the first, ``self``): named ones, ``*args`` under its name, ``**kwargs`` merged."""
    code = frame.f_code
    local = frame.f_locals
    count = code.co_argcount + code.co_kwonlyargcount
    names = list(code.co_varnames[:count])
    var_args = var_kwargs = None
    if code.co_flags & inspect.CO_VARARGS:
        var_args = code.co_varnames[count]
        count += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        var_kwargs = code.co_varnames[count]
    args: dict[str, Any] = {}
    for name in names[1:]:  # not self
        if name in local:
            args[name] = local[name]
    if var_args is not None and local.get(var_args):
        args[var_args] = local[var_args]
    if var_kwargs is not None:
        args.update(local.get(var_kwargs) or {})
    return args


class Module(PutMixin, torch.nn.Module):
    """Subclass it, define ``training_step`` and ``configure_optimizers``, and hand it to
    :meth:`Trainer.fit`. Methods decorated with :func:`loopbus.on` are subscribed for the
    duration of each stage, like a plugin's.

    ``training_step`` returns the loss tensor, a mapping with a ``"loss"`` key, or None to
    skip the optimizer step for this batch. With ``automatic_optimization = False`` it does
    the backward and optimizer steps itself (``self.optimizers()``,
    ``self.manual_backward(loss)``).
    """

    #: Let the trainer run backward, clipping, optimizer and per-step scheduler steps.
    automatic_optimization: bool = True

    # -- hyperparameters
    def save_hyperparameters(self, *names: str, ignore: Iterable[str] = ()) -> None:
        """Keep the arguments of the ``__init__`` that calls it as :attr:`hparams`::

            class Net(Module):
                def __init__(self, hidden: int = 64, lr: float = 0.1) -> None:
                    super().__init__()
                    self.save_hyperparameters()  # {"hidden": 64, "lr": 0.1}

        ``save_hyperparameters("lr")`` keeps only the arguments named; ``ignore=[...]``
        leaves some out. Only plain values are kept (None, bool, int, float, str, and
        lists, tuples and str-keyed dicts of those): anything else (a tensor, a module)
        is refused, naming the argument. They go into every checkpoint, to the loggers,
        and :meth:`load_from_checkpoint` builds the module again from them.
        """
        owner = type(self).__name__
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is None:
            raise RuntimeError(
                f"{owner}.save_hyperparameters() cannot see its caller's arguments on this "
                "Python implementation (it needs frame introspection)."
            )
        try:
            args = _frame_arguments(caller)
        finally:
            del frame, caller
        ignored = {ignore} if isinstance(ignore, str) else set(ignore)
        unknown = [n for n in (*names, *ignored) if n not in args]
        if unknown:
            raise MisconfigurationError(
                f"{owner}.save_hyperparameters() got {unknown!r}, which are not arguments of "
                f"the __init__ that called it; its arguments are {sorted(args)!r}."
            )
        if names:
            args = {name: args[name] for name in names}
        kept = {name: value for name, value in args.items() if name not in ignored}
        self.__dict__["_loopbus_hparams"] = MappingProxyType(check_hparams(kept, owner))

    @property
    def hparams(self) -> Mapping[str, Any]:
        """The hyperparameters kept by :meth:`save_hyperparameters` (read-only; empty if
        it was never called)."""
        return self.__dict__.get("_loopbus_hparams", _NO_HPARAMS)  # type: ignore[no-any-return]

    @classmethod
    def load_from_checkpoint(
        cls: type[M], path: str | os.PathLike[str], /, **overrides: Any
    ) -> M:
        """Build the module again from a checkpoint: ``cls(**hparams | overrides)`` with
        the hyperparameters it holds, then load its weights (on the CPU). The file is read
        weights-only, like every checkpoint (see :func:`loopbus.load_checkpoint`)::

            model = Net.load_from_checkpoint("checkpoints/last.ckpt")
            model = Net.load_from_checkpoint(path, lr=0.01)  # one argument changed
        """
        from loopbus.checkpoint._load import load_checkpoint
        from loopbus.checkpoint._parts import ModulePart

        state = load_checkpoint(path)
        saved = state.get("hparams")
        hparams = saved.get("values", {}) if isinstance(saved, dict) else {}
        arguments = {**hparams, **overrides}
        signature = inspect.signature(cls)
        try:
            signature.bind(**arguments)
        except TypeError as exc:
            if not hparams:
                raise MisconfigurationError(
                    f"{path} holds no hyperparameters (call self.save_hyperparameters() in "
                    f"{cls.__name__}.__init__ to keep them in checkpoints) and "
                    f"{cls.__name__}{signature} cannot be built without them ({exc}); pass "
                    f"the arguments: {cls.__name__}.load_from_checkpoint(path, name=value, ...)."
                ) from exc
            raise MisconfigurationError(
                f"{cls.__name__}{signature} cannot be built from the hyperparameters in "
                f"{path} {hparams!r} and the overrides {overrides!r}: {exc}. Pass or "
                f"correct arguments as keywords of load_from_checkpoint."
            ) from exc
        module = cls(**arguments)
        weights = state.get("module")
        part = ModulePart(module)
        problems = part.explain_mismatch(weights)
        if problems:
            raise CheckpointError(
                f"the weights in {path} do not fit {cls.__name__}"
                f"({', '.join(f'{k}={v!r}' for k, v in arguments.items())}): "
                + "; ".join(p.message for p in problems)
            )
        assert isinstance(weights, dict)
        part.load_state_dict(weights)
        return module

    def training_step(self, batch: Any, ctx: Scope) -> Any:
        raise MisconfigurationError(
            f"{type(self).__name__} must define training_step(self, batch, ctx) to be fitted."
        )

    def validation_step(self, batch: Any, ctx: Scope) -> Any:
        raise MisconfigurationError(
            f"{type(self).__name__} must define validation_step(self, batch, ctx) to be "
            "validated; define it or do not pass validation data."
        )

    def test_step(self, batch: Any, ctx: Scope) -> Any:
        raise MisconfigurationError(
            f"{type(self).__name__} must define test_step(self, batch, ctx) to be tested."
        )

    def predict_step(self, batch: Any, ctx: Scope) -> Any:
        """Defaults to ``self(batch)``."""
        return self(batch)

    def configure_optimizers(self) -> Any:
        """Return an optimizer; a list of them; ``(optimizers, schedulers)``; or a dict
        ``{"optimizer": opt, "lr_scheduler": sched_or_config}`` (or a list of such dicts).
        A scheduler config is ``{"scheduler": s, "interval": "epoch"|"step",
        "frequency": 1, "monitor": "val/loss"}`` (``monitor`` for ReduceLROnPlateau)."""
        raise MisconfigurationError(
            f"{type(self).__name__} must define configure_optimizers(self) returning an "
            "optimizer, e.g. `return torch.optim.SGD(self.parameters(), lr=0.1)`."
        )

    # -- access to the run
    def bind_trainer(self, trainer: Trainer | None) -> None:
        """Attach the module to the trainer running it (None: detach). Called by the
        trainer when a stage starts and ends; :attr:`trainer` reads it."""
        # Its own attribute, set past nn.Module.__setattr__ (the trainer is no submodule).
        self.__dict__["_loopbus_trainer"] = trainer

    @property
    def trainer(self) -> Trainer:
        trainer = self.__dict__.get("_loopbus_trainer")
        if trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a running Trainer.")
        return trainer  # type: ignore[no-any-return]

    def optimizers(self) -> Any:
        """The configured optimizer, or the list of them when there are several."""
        opts = self.trainer.optimizers
        return opts[0] if len(opts) == 1 else list(opts)

    def lr_schedulers(self) -> Any:
        """The configured scheduler, the list of them, or None."""
        scheds = [c.scheduler for c in self.trainer.lr_scheduler_configs]
        if not scheds:
            return None
        return scheds[0] if len(scheds) == 1 else scheds

    def manual_backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()`` through the trainer's precision (grad scaling)."""
        self.trainer.precision.backward(loss, **kwargs)
