"""``Module``: a ``torch.nn.Module`` with the steps and optimizers of a training run."""

from __future__ import annotations

import ast
import copy
import difflib
import inspect
import itertools
import linecache
import os
from collections.abc import Iterable, Iterator, Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import torch

from loopbus.events import DESTINATIONS
from loopbus.records._records import PutMixin
from loopbus.state._scope import Scope

from .._exceptions import CheckpointError, MisconfigurationError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ._trainer_view import TrainerView

__all__ = ["Hparams", "Module", "check_hparams"]

M = TypeVar("M", bound="Module")

_PLAIN = (type(None), bool, int, float, str)


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


class Hparams(Mapping[str, Any]):
    """The hyperparameters kept by :meth:`Module.save_hyperparameters`: a read-only
    mapping whose keys read as attributes too (``hparams.lr`` is ``hparams["lr"]``; a key
    named like a mapping method, ``hparams["items"]``, reads with brackets only). It
    compares equal to a dict with the same items; it can be copied and pickled."""

    __slots__ = ("_owner", "_values")
    _owner: str
    _values: dict[str, Any]

    def __init__(self, values: Mapping[str, Any] | None = None, owner: str = "Module") -> None:
        object.__setattr__(self, "_values", dict(values or {}))
        object.__setattr__(self, "_owner", owner)

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __contains__(self, name: object) -> bool:
        return name in self._values

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        if name.startswith("__"):  # copy, pickle and friends probing for a hook
            raise AttributeError(name)
        owner = object.__getattribute__(self, "_owner")
        if not values:
            raise AttributeError(
                f"{owner}.hparams has no {name!r}: it is empty. Call "
                f"self.save_hyperparameters() in {owner}.__init__ to keep its arguments."
            )
        close = difflib.get_close_matches(name, list(values), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise AttributeError(
            f"{owner}.hparams has no {name!r}{hint}; it holds {sorted(values)!r}."
        )

    def __setattr__(self, name: str, value: Any) -> NoReturn:
        raise AttributeError(
            f"{self._owner}.hparams is read-only (it holds the arguments "
            f"save_hyperparameters() kept, as checkpoints save them); keep {name!r} as an "
            f"attribute of the module instead: self.{name} = ..."
        )

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"{self._owner}.hparams is read-only; {name!r} cannot be deleted.")

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *(k for k in self._values if k.isidentifier())})

    def __repr__(self) -> str:
        return f"Hparams({self._values!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._values, self._owner))


# -- Lightning's self.log and self.log_dict: errors that show the put line to write instead
_LOG_OPTIONS = (  # Lightning's, in the order of its positional parameters
    "prog_bar",
    "logger",
    "on_step",
    "on_epoch",
    "reduce_fx",
    "enable_graph",
    "sync_dist",
    "sync_dist_group",
    "add_dataloader_idx",
    "batch_size",
    "metric_attribute",
    "rank_zero_only",
)
_LOG_DICT_OPTIONS = tuple(o for o in _LOG_OPTIONS if o != "metric_attribute")
_MISSING: Any = object()


def _call_in(frame: FrameType | None, method: str) -> tuple[str, ast.Call] | None:
    """The source text and syntax tree of the call that ``frame`` is making, the caller's
    ``self.log(...)`` expression (``method`` named), or None where it cannot be read."""
    if frame is None:
        return None
    try:
        first, last, start, end = list(frame.f_code.co_positions())[frame.f_lasti // 2]
        if first is None or last is None or start is None or end is None:
            return None
        filename = frame.f_code.co_filename
        lines = [linecache.getline(filename, n).encode() for n in range(first, last + 1)]
        lines[-1] = lines[-1][:end]  # offsets count UTF-8 bytes
        lines[0] = lines[0][start:]
        text = b"".join(lines).decode()
        node = ast.parse(text, mode="eval").body
    except (IndexError, SyntaxError, ValueError):  # UnicodeDecodeError is a ValueError
        return None
    if not isinstance(node, ast.Call) or getattr(node.func, "attr", None) != method:
        return None
    return text, node


def _argument(call: tuple[str, ast.Call] | None, index: int, keyword: str) -> ast.expr | None:
    """The expression passed as argument ``index`` (or as ``keyword=``) in ``call``."""
    if call is None:
        return None
    args, keywords = call[1].args, call[1].keywords
    if any(isinstance(a, ast.Starred) for a in args[: index + 1]):
        return None
    if index < len(args):
        return args[index]
    return next((k.value for k in keywords if k.arg == keyword), None)


def _shown(call: tuple[str, ast.Call] | None, node: ast.expr | None, value: Any) -> str:
    """How the put line writes an argument: its source text, else the value when short."""
    text = ast.get_source_segment(call[0], node) if call and node else None
    if text is not None:
        return text
    if isinstance(value, str):
        return _quoted(value)
    if isinstance(value, (bool, int, float)) and len(repr(value)) < 32:
        return repr(value)
    return "value"


def _quoted(key: Any) -> str:
    """``key`` as a literal, in double quotes like the examples (``repr`` where needed)."""
    if isinstance(key, str) and key.isprintable() and '"' not in key and "\\" not in key:
        return f'"{key}"'
    return repr(key)


def _log_options(
    args: tuple[Any, ...], kwargs: dict[str, Any], names: tuple[str, ...]
) -> dict[str, Any]:
    """Lightning's options of a log call, by name (positional ones named in order)."""
    return {**dict(zip(names, args, strict=False)), **kwargs}


def _destinations_argument(options: Mapping[str, Any]) -> str:
    """``, destinations=(...)`` for ``prog_bar=False`` / ``logger=False`` ("" for all)."""
    dropped = {"progress_bar": options.get("prog_bar") is False}
    dropped["loggers"] = options.get("logger") is False
    roles = [role for role in DESTINATIONS if not dropped.get(role)]
    if len(roles) == len(DESTINATIONS):
        return ""
    return ", destinations=(" + ", ".join(f'"{role}"' for role in roles) + ")"


def _put_lines(
    call: tuple[str, ast.Call] | None,
    node: ast.expr | None,
    values: Any,
    holder: str,
    destinations: str,
) -> list[str]:
    """One ``self.put(key, ...)`` line per item of ``values`` (three, then "..."): the
    value's source where ``node`` is a dict display, else ``holder[key]``."""
    if not isinstance(values, Mapping):
        return []
    shown: dict[Any, ast.expr] = {}
    if isinstance(node, ast.Dict):
        for key, value in zip(node.keys, node.values, strict=True):
            if isinstance(key, ast.Constant):
                shown.setdefault(key.value, value)
    lines = []
    for key in itertools.islice(values, 3):
        text = _shown(call, shown[key], _MISSING) if key in shown else f"{holder}[{_quoted(key)}]"
        lines.append(f"    self.put({_quoted(key)}, {text}{destinations})")
    if len(values) > 3:
        lines.append("    ...")
    return lines


def _log_advice(name: str, options: Mapping[str, Any]) -> str:
    """What a put does not do that Lightning's log did, and where to do it instead."""
    event = "TrainEpochCompleted"
    if "val" in name:
        event = "ValidationCompleted"
    elif "test" in name:
        event = "TestCompleted"
    reduced = " (torchmetrics also reduces across ranks, as sync_dist=True did)"
    return (
        "Records are not aggregated: a put is one value at the current step. For a value "
        "over the epoch (on_epoch=True), update a torchmetrics metric in the step "
        "(self.metric.update(...)) and put what it computes in an epoch-end handler"
        f"{reduced if options.get('sync_dist') else ''}:\n"
        f"    @loopbus.on(loopbus.events.{event})\n"
        "    def put_epoch_metrics(self, event):\n"
        f"        self.put({name}, self.metric.compute())\n"
        "        self.metric.reset()\n"
        "put sends a record to every destination by default "
        f"({', '.join(_quoted(d) for d in DESTINATIONS)}); prog_bar= and logger= become "
        'destinations=: leave out "progress_bar" for prog_bar=False and "loggers" for '
        "logger=False."
    )


def _run_counter_is_read_only(module: Module, name: str) -> str:
    return (
        f"{type(module).__name__}.{name} is read-only: it is the running trainer's "
        f"{name} (the trainer counts it, and a resume restores it); keep a count of your "
        "own under another name."
    )


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
        self.__dict__["_loopbus_hparams"] = Hparams(check_hparams(kept, owner), owner)

    @property
    def hparams(self) -> Hparams:
        """The hyperparameters kept by :meth:`save_hyperparameters`: a read-only
        :class:`Hparams` mapping, its keys readable as attributes (``self.hparams.lr``);
        empty if it was never called."""
        hparams: Hparams | None = self.__dict__.get("_loopbus_hparams")
        return hparams if hparams is not None else Hparams({}, type(self).__name__)

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

    def configure_model(self, mesh: DeviceMesh) -> None:
        """Split the module's layers over the ``"tp"`` dimension of ``mesh`` (a named
        ``DeviceMesh``), e.g. with ``torch.distributed.tensor.parallel.parallelize_module``.
        Only :class:`~loopbus.ModelParallelStrategy` calls it: once per module, when the
        first stage starts, after the module is on its device and initialised and before
        ``configure_optimizers``; it then shards the module over the data-parallel
        dimensions. Does nothing by default."""

    def configure_optimizers(self) -> Any:
        """Return an optimizer; a list of them; ``(optimizers, schedulers)``; or a dict
        ``{"optimizer": opt, "lr_scheduler": sched_or_config}`` (or a list of such dicts).
        A scheduler config is ``{"scheduler": s, "interval": "epoch"|"step",
        "frequency": 1, "monitor": "val/loss"}`` (``monitor`` for ReduceLROnPlateau)."""
        raise MisconfigurationError(
            f"{type(self).__name__} must define configure_optimizers(self) returning an "
            "optimizer, e.g. `return torch.optim.SGD(self.parameters(), lr=0.1)`."
        )

    # -- Lightning's log: an error that shows the put to write
    def log(self, name: Any, value: Any = _MISSING, *args: Any, **kwargs: Any) -> NoReturn:
        """Lightning's ``self.log`` is ``self.put`` here: it raises a
        :class:`MisconfigurationError` showing the put line for the arguments given (and
        where an ``on_epoch=True`` value is computed instead). Nothing is logged."""
        frame = inspect.currentframe()
        call = _call_in(frame.f_back if frame is not None else None, "log")
        del frame
        options = _log_options(args, kwargs, _LOG_OPTIONS)
        shown_name = _shown(call, _argument(call, 0, "name"), name)
        shown_value = _shown(call, _argument(call, 1, "value"), value)
        raise MisconfigurationError(
            f"{type(self).__name__}.log() is Lightning's; loopbus publishes a record with "
            f"put:\n    self.put({shown_name}, {shown_value}{_destinations_argument(options)})"
            f"\n{_log_advice(shown_name, options)}"
        )

    def log_dict(self, dictionary: Any, *args: Any, **kwargs: Any) -> NoReturn:
        """Lightning's ``self.log_dict`` is ``self.put_dict`` (or one ``self.put`` per
        item) here: it raises a :class:`MisconfigurationError` showing those lines for the
        arguments given. Nothing is logged."""
        frame = inspect.currentframe()
        call = _call_in(frame.f_back if frame is not None else None, "log_dict")
        del frame
        options = _log_options(args, kwargs, _LOG_DICT_OPTIONS)
        destinations = _destinations_argument(options)
        node = _argument(call, 0, "dictionary")
        source = _shown(call, node, None)
        holder = "values" if source == "value" else source
        lines = _put_lines(call, node, dictionary, holder, destinations)
        each = "\nor one put per item:\n" + "\n".join(lines) if lines else ""
        keys = list(dictionary) if isinstance(dictionary, Mapping) else []
        raise MisconfigurationError(
            f"{type(self).__name__}.log_dict() is Lightning's; loopbus publishes records "
            f"with put_dict (all of them or, when one is refused, none):\n"
            f"    self.put_dict({holder}{destinations}){each}\n"
            + _log_advice(_quoted(keys[0]) if keys else "name", options)
        )

    # -- access to the run
    def bind_trainer(self, trainer: TrainerView | None) -> None:
        """Attach the module to the trainer running it (None: detach). Called by the
        trainer when a stage starts and ends; :attr:`trainer` reads it."""
        # Its own attribute, set past nn.Module.__setattr__ (the trainer is no submodule).
        self.__dict__["_loopbus_trainer"] = trainer

    def __getstate__(self) -> Any:
        """What a copy or a pickle keeps: not the trainer running it (nor, see
        ``PutMixin.__getstate__``, the recorder): a copy made during a stage is
        detached."""
        state = super().__getstate__()
        if isinstance(state, dict) and "_loopbus_trainer" in state:
            state = {k: v for k, v in state.items() if k != "_loopbus_trainer"}
        return state

    @property
    def trainer(self) -> TrainerView:
        """The trainer running this module (a :class:`~loopbus.TrainerView` of it)."""
        trainer = self.__dict__.get("_loopbus_trainer")
        if trainer is None:
            raise RuntimeError(f"{type(self).__name__} is not attached to a running Trainer.")
        return trainer  # type: ignore[no-any-return]

    @property
    def device(self) -> torch.device:
        """The device of the module's first parameter (or buffer); the CPU for a module
        with neither. Read-only: move the module with ``.to(device)``."""
        for tensor in itertools.chain(self.parameters(), self.buffers()):
            return tensor.device
        return torch.device("cpu")

    @device.setter
    def device(self, value: Any) -> NoReturn:
        raise AttributeError(
            f"{type(self).__name__}.device is read-only: it is where the module's parameters "
            "are; move them with module.to(device), or keep yours under another name."
        )

    @property
    def current_epoch(self) -> int:
        """The trainer's ``current_epoch`` while a stage runs; 0 outside a stage."""
        trainer: TrainerView | None = self.__dict__.get("_loopbus_trainer")
        return 0 if trainer is None else trainer.current_epoch

    @current_epoch.setter
    def current_epoch(self, value: Any) -> NoReturn:
        raise AttributeError(_run_counter_is_read_only(self, "current_epoch"))

    @property
    def global_step(self) -> int:
        """The trainer's ``global_step`` (optimizer steps taken) while a stage runs; 0
        outside a stage."""
        trainer: TrainerView | None = self.__dict__.get("_loopbus_trainer")
        return 0 if trainer is None else trainer.global_step

    @global_step.setter
    def global_step(self, value: Any) -> NoReturn:
        raise AttributeError(_run_counter_is_read_only(self, "global_step"))

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
