"""What ``Trainer(compile=...)`` compiles, and what it keeps eager.

Two shapes, chosen once per stage:

* the **steps** (the default): the module's ``training_step`` (and the evaluation
  steps) compiled whole, through :func:`compiled`; the optimizer step too where it can
  be (:func:`optimizer_step_for`);
* a **target** (``compile={"target": "forward"}`` or a submodule's name): only that
  module's call is compiled (as ``nn.Module.compile`` would); the steps, their ``put`` and their
  metric updates run eagerly.

Either way the torchmetrics metrics of the module run eagerly: :func:`prepare_compiled`
wraps each metric's ``update``, ``forward``, ``compute`` and ``reset`` in
``torch.compiler.disable`` on the instance, and :func:`restore_compiled` undoes that
(and a target's compilation) when the stage ends, so the user's module is left as it
was. A metric keeps Python counters and list states that compiled code would guard on
(one compilation per step until torch's limit), and reads package metadata that the
compiler cannot trace.
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch

from loopbus.state._scope import Scope
from loopbus.step._params import has_sharded_parameters

from .._exceptions import MisconfigurationError

__all__ = [
    "compile_target",
    "compiled",
    "optimizer_step_for",
    "prepare_compiled",
    "restore_compiled",
]

StepFn = Callable[[Any, Scope], Any]

#: The ``torch.compile`` keyword arguments of ``Trainer(compile={...})``.
_TORCH_KEYS = ("backend", "mode", "fullgraph", "dynamic", "options")
#: The methods of a metric that run eagerly inside compiled code.
_METRIC_METHODS = ("update", "forward", "compute", "reset")
_MISSING = object()
_disable: Callable[[Callable[..., Any]], Callable[..., Any]] = torch.compiler.disable
#: What to undo when a module's stage ends (see :func:`restore_compiled`).
_UNDO: weakref.WeakKeyDictionary[torch.nn.Module, list[Callable[[], None]]] = (
    weakref.WeakKeyDictionary()
)


class TracedPuts(Protocol):
    """What a compiled step asks of the recorder: run it so that what its puts hand out
    joins the pending records when it returns."""

    def run_compiled(self, fn: StepFn, batch: Any, ctx: Scope) -> Any: ...


class _Schedulers(Protocol):
    @property
    def configured(self) -> bool: ...


def compile_target(options: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The modules ``options`` compiles (``"forward"``: the module itself; dotted names:
    its submodules); empty when it compiles the steps (or nothing)."""
    return () if options is None else tuple(options.get("target", ()))


def _torch_options(
    options: Mapping[str, Any], keys: tuple[str, ...] = _TORCH_KEYS
) -> dict[str, Any]:
    return {k: v for k, v in options.items() if k in keys}


def compiled(fn: StepFn, options: Mapping[str, Any] | None, records: TracedPuts) -> StepFn:
    """``fn`` compiled by ``torch.compile(fn, **options)``, run through
    ``records.run_compiled`` (its puts are collected apart, then pending); ``fn`` itself
    when ``options`` is None (eager) or names a target (the steps then run eagerly and
    call the compiled target). The module itself is not wrapped, so its state dict keeps
    its own keys (no ``_orig_mod.``): checkpoints load either way."""
    if options is None or compile_target(options):
        return fn
    return functools.partial(records.run_compiled, torch.compile(fn, **_torch_options(options)))


def prepare_compiled(module: torch.nn.Module, options: Mapping[str, Any] | None) -> None:
    """Before a compiled stage: the module's metrics made eager and its target (if any)
    compiled; :func:`restore_compiled` undoes both. Nothing when ``options`` is None."""
    if options is None:
        return
    restore_compiled(module)  # a stage that ended without its cleanup
    undo = _UNDO[module] = []
    targets = [_submodule(module, name) for name in compile_target(options)]
    undo.extend(_compile_forward(target, options) for target in targets)
    metric_types = _metric_types()
    if metric_types:
        for sub in module.modules():
            if isinstance(sub, metric_types):
                undo.extend(_keep_eager(sub))


def _compile_forward(module: torch.nn.Module, options: Mapping[str, Any]) -> Callable[[], None]:
    """Give ``module`` (this instance only) a compiled ``forward``: a call of its own
    ``forward`` through a function of this file, compiled. torch's compiler skips frames
    that start in torch's own modules, so compiling ``nn.Linear.forward`` or
    ``nn.Module.compile`` would leave a torch layer (``nn.Linear``, ``nn.Sequential``)
    eager. Returns what puts the instance back as it was."""
    own = vars(module).get("forward", _NONE)
    forward = module.forward

    def call(*args: Any, **kwargs: Any) -> Any:
        return forward(*args, **kwargs)

    module.forward = torch.compile(call, **_torch_options(options))

    def restore() -> None:
        if own is _NONE:
            del module.forward
        else:
            module.forward = own

    return restore


#: No instance attribute of that name.
_NONE = object()


def restore_compiled(module: torch.nn.Module) -> None:
    """Undo what :func:`prepare_compiled` did to ``module`` (nothing if it did nothing)."""
    for undo in reversed(_UNDO.pop(module, [])):
        undo()


def _metric_types() -> tuple[type, ...]:
    """torchmetrics' ``Metric`` and ``MetricCollection``, if torchmetrics is imported (a
    module holding a metric has imported it)."""
    package = sys.modules.get("torchmetrics")
    found = (getattr(package, "Metric", None), getattr(package, "MetricCollection", None))
    return tuple(t for t in found if isinstance(t, type))


def _keep_eager(metric: torch.nn.Module) -> list[Callable[[], None]]:
    """Wrap ``metric``'s methods in ``torch.compiler.disable`` on the instance; the
    functions that put back what the instance held."""
    undo: list[Callable[[], None]] = []
    for name in _METRIC_METHODS:
        previous = metric.__dict__.get(name, _MISSING)
        wrapper = _disable(getattr(metric, name))
        setattr(metric, name, wrapper)
        undo.append(functools.partial(_put_back, metric, name, wrapper, previous))
    return undo


def _put_back(metric: torch.nn.Module, name: str, wrapper: Any, previous: Any) -> None:
    if metric.__dict__.get(name) is not wrapper:
        return  # replaced since: leave what the user put there
    if previous is _MISSING:
        delattr(metric, name)
    else:
        setattr(metric, name, previous)


def _submodule(module: torch.nn.Module, name: str) -> torch.nn.Module:
    """The module ``compile={"target": name}`` names (``"forward"``: ``module``)."""
    if name == "forward":
        return module
    try:
        return module.get_submodule(name)
    except AttributeError:
        pass
    names = [n for n, sub in module.named_modules() if n and not _is_metric(sub)]
    raise MisconfigurationError(
        f"compile={{'target': {name!r}}}: {type(module).__name__} has no submodule "
        f"{name!r}; the target is 'steps' (the default), 'forward' (the module's call) or "
        f"one of its submodules: {names}."
    )


def _is_metric(module: torch.nn.Module) -> bool:
    types = _metric_types()
    return bool(types) and isinstance(module, types)


def optimizer_step_for(
    optimizer: torch.optim.Optimizer,
    *,
    compile: Mapping[str, Any] | None,
    policy: bool | str,
    scaler: Any,
    schedulers: _Schedulers,
) -> Callable[[], Any]:
    """The function the training step calls for the optimizer's step: ``optimizer.step``,
    or (``compile`` given, ``policy`` ``"auto"`` or True) a function compiled with the
    step's ``backend``, ``mode`` and ``options`` that calls it. It stays eager where it
    cannot be compiled; with ``policy=True`` that raises, saying why. With a compile
    target, ``"auto"`` keeps it eager (only the target is compiled)."""
    step = optimizer.step
    if compile is None or policy is False or (policy == "auto" and compile_target(compile)):
        return step
    why, surprising, forcible = _optimizer_stays_eager(optimizer, scaler, schedulers)
    if why is not None and not (forcible and policy is True):
        if policy is True:
            raise MisconfigurationError(
                f"compile={{'optimizer': True}}: the optimizer step cannot be compiled: "
                f"{why}. Leave 'optimizer' out (or 'auto') to keep it eager."
            )
        if surprising:
            warnings.warn(f"the optimizer step stays eager: {why}.", UserWarning, stacklevel=2)
        return step
    options = _torch_options(compile, ("backend", "mode", "options"))

    def optimizer_step() -> Any:
        return step()

    return torch.compile(optimizer_step, **options)


def _optimizer_stays_eager(
    optimizer: torch.optim.Optimizer, scaler: Any, schedulers: _Schedulers
) -> tuple[str | None, bool, bool]:
    """Why ``"auto"`` keeps the optimizer step eager (None: it compiles it), whether
    that is worth a warning (a change to the user's code would compile it), and whether
    ``compile={"optimizer": True}`` compiles it anyway."""
    if scaler is not None:
        return (
            "the grad scaler ('16-mixed') reads its inf check on the host before the step; "
            "use 'bf16-mixed', which has no scaler",
            False,
            False,
        )
    if has_sharded_parameters(p for group in optimizer.param_groups for p in group["params"]):
        return "its parameters are DTensors (FSDP)", False, False
    if schedulers.configured and any(
        not isinstance(group.get("lr"), torch.Tensor) for group in optimizer.param_groups
    ):
        return (
            "its learning rate is a Python number that an LR scheduler changes, and "
            "compiled code would be compiled again at every change; build the optimizer "
            "with a tensor learning rate (lr=torch.tensor(0.01)) to compile it",
            True,
            False,
        )
    if not type(optimizer).__module__.startswith("torch.optim"):
        # torch's compiler knows torch's optimizers; another one (a library's fused or
        # 8-bit optimizer, a subclass) may call what it cannot trace.
        return f"{type(optimizer).__qualname__} is not one of torch.optim's", False, True
    return None, False, False
