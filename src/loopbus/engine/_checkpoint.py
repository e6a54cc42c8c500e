"""Checkpoints: the state of a run as plain tensors and Python primitives, written
atomically and read back without unpickling anything.

A checkpoint is one dict that ``torch.load(path, weights_only=True)`` reads::

    {
      "loopbus":       {"format": "loopbus.checkpoint", "format_version": 1,
                        "version": ..., "torch_version": ..., "created": <time.time()>,
                        "global_step": int, "epoch": int, "module_class": "pkg.Model"},
      "module":        module.state_dict(),
      "optimizers":    [{"class": "torch.optim.sgd.SGD", "state_dict": {...}}, ...],
      "lr_schedulers": [{"class": "...", "state_dict": {...}}, ...],
      "precision":     {"name": "32", "state_dict": {...}},      # the grad scaler
      "plugins":       {plugin.state_key: plugin.state_dict(), ...},
      "loops":         {"fit": ..., "validate": ..., "test": ..., "predict": ...},
      "data":          {"train": loader.state_dict()},  # empty unless the loader is stateful
      "rng":           {"python": ..., "torch": ..., "numpy": ..., "cuda": [...]},
      "grads":         {parameter name: gradient},       # empty unless mid-accumulation
      "records":       {name: {"value": ..., "step": ..., ...}},  # latest put records
    }

Collecting the state (:func:`trainer_state_dict`) and loading it back into a trainer
(:func:`load_trainer_state`, which checks every component first); the files themselves
are written and read by ``_checkpoint_io``, the generators handled by ``_rng``.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .._exceptions import CheckpointError
from ..events import PutRecord
from ._checkpoint_io import (
    FORMAT,
    FORMAT_VERSION,
    check_header,
    latest_checkpoint,
    load_checkpoint,
    newest,
    remove_checkpoint,
    remove_stale_temporaries,
    to_plain,
    write_checkpoint,
)
from ._plugin import Plugin
from ._rng import capture_rng, restore_rng, rng_preserved
from ._state import Stateful

if TYPE_CHECKING:
    from ._trainer import Trainer

__all__ = [
    "CheckpointMismatch",
    "latest_checkpoint",
    "load_checkpoint",
    "load_trainer_state",
    "remove_checkpoint",
    "remove_stale_temporaries",
    "resolve_last",
    "trainer_state_dict",
    "write_checkpoint",
]

COMPONENTS = (
    "module",
    "optimizers",
    "lr_schedulers",
    "precision",
    "plugins",
    "loops",
    "data",
    "rng",
    "grads",
    "records",
)


# ---------------------------------------------------------------- collecting state


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _is_stateful_plugin(plugin: Plugin) -> bool:
    return type(plugin).state_dict is not Plugin.state_dict


def plugin_states(trainer: Trainer) -> dict[str, Any]:
    states: dict[str, Any] = {}
    owners: dict[str, Plugin] = {}
    for plugin in trainer.plugins:
        if not _is_stateful_plugin(plugin):
            continue
        key = plugin.state_key
        if key in owners:
            raise CheckpointError(
                f"two plugins would be saved under the same checkpoint key {key!r}: "
                f"{owners[key]!r} and {plugin!r}. Give one of them a distinct key by "
                "overriding its `state_key` property (for example including its options)."
            )
        owners[key] = plugin
        state = plugin.state_dict()
        if not isinstance(state, dict):
            raise CheckpointError(
                f"{type(plugin).__name__}.state_dict() returned {type(state).__name__}; it "
                "must return a dict of tensors and Python primitives."
            )
        states[key] = state
    return states


def stateful_plugins(trainer: Trainer) -> dict[str, Plugin]:
    return {p.state_key: p for p in trainer.plugins if _is_stateful_plugin(p)}


def _records(trainer: Trainer) -> dict[str, Any]:
    return {
        name: {
            "value": record.value,
            "step": record.step,
            "epoch": record.epoch,
            "time": record.time,
            "source": record.source,
            "destinations": list(record.destinations),
        }
        for name, record in trainer.recorder.latest_records().items()
    }


def trainer_state_dict(trainer: Trainer, *, to_host: bool = False) -> dict[str, Any]:
    """The checkpoint dict of ``trainer``'s run (see the module docstring). Without
    ``to_host`` tensors are the live ones (as ``nn.Module.state_dict`` returns them);
    with it, copies in host memory that later training steps do not touch."""
    module = trainer.module
    if module is None:
        raise CheckpointError(
            "the trainer has no module yet, so there is no run state to save; a checkpoint "
            "can be taken once fit (or another stage) has started."
        )
    data = getattr(trainer, "_train_data", None)
    rng = capture_rng()
    with rng_preserved():  # taking the state must not move the generators (a loader may)
        state = _collect(trainer, module, data, rng)
    return to_plain(state, copy=to_host, where="checkpoint")  # type: ignore[no-any-return]


def _collect(trainer: Trainer, module: Any, data: Any, rng: dict[str, Any]) -> dict[str, Any]:
    import loopbus

    return {
        "loopbus": {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "version": loopbus.__version__,
            "torch_version": str(torch.__version__),
            "created": time.time(),
            "global_step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "module_class": _qualname(type(module)),
        },
        "module": module.state_dict(),
        "optimizers": [
            {"class": _qualname(type(opt)), "state_dict": opt.state_dict()}
            for opt in trainer.optimizers
        ],
        "lr_schedulers": [
            {"class": _qualname(type(c.scheduler)), "state_dict": c.scheduler.state_dict()}
            for c in trainer.lr_scheduler_configs
        ],
        "precision": {
            "name": str(trainer.precision.name),
            "state_dict": trainer.precision.state_dict(),
        },
        "plugins": plugin_states(trainer),
        "loops": {name: loop.state_dict() for name, loop in trainer.loops.items()},
        "data": (
            {"train": trainer.fit_loop.epoch_loop.loader_state(data)}
            if isinstance(data, Stateful)
            else {}
        ),
        "rng": rng,
        "grads": {name: p.grad for name, p in module.named_parameters() if p.grad is not None},
        "records": _records(trainer),
    }


# ---------------------------------------------------------------- loading into a trainer


@dataclass(frozen=True)
class CheckpointMismatch:
    """What a checkpoint and the current run disagree on, by component.

    ``missing``: present in this run, absent from the checkpoint; ``unexpected``: in the
    checkpoint, absent from this run; ``mismatched``: in both but incompatible (shapes,
    classes, counts). Truthy when there is anything to report. Returned by
    ``Trainer.load_state_dict(state, strict=False)``; with ``strict=True`` any entry is an
    error instead.
    """

    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    mismatched: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.missing or self.unexpected or self.mismatched)

    def __str__(self) -> str:
        if not self:
            return "everything matched"
        lines = []
        for title, items in (
            ("missing from the checkpoint", self.missing),
            ("in the checkpoint but not in this run", self.unexpected),
            ("incompatible", self.mismatched),
        ):
            lines += [f"  - {title}: {item}" for item in items]
        return "\n".join(lines)


class _Report:
    def __init__(self) -> None:
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.mismatched: list[str] = []
        self.skip: set[str] = set()

    def add(self, kind: str, component: str, message: str, *, skip: bool = True) -> None:
        getattr(self, kind).append(f"{component}: {message}")
        if skip:
            self.skip.add(component)

    def result(self) -> CheckpointMismatch:
        return CheckpointMismatch(
            tuple(self.missing), tuple(self.unexpected), tuple(self.mismatched)
        )


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_module(
    trainer: Trainer, saved: Any, report: _Report, changed: list[str]
) -> dict[str, Any]:
    module = trainer.module
    assert module is not None
    name = type(module).__name__
    current = module.state_dict()
    if not isinstance(saved, dict):
        report.add("mismatched", "module", f"the checkpoint holds {type(saved).__name__}")
        return {}
    missing = [k for k in current if k not in saved]
    unexpected = [k for k in saved if k not in current]
    shapes = []
    loadable = {}
    for key, value in saved.items():
        if key not in current:
            continue
        mine = current[key]
        if isinstance(value, torch.Tensor) and isinstance(mine, torch.Tensor):
            if value.shape != mine.shape:
                shapes.append(
                    f"{key!r} has shape {tuple(value.shape)} in the checkpoint but "
                    f"{tuple(mine.shape)} in {name}"
                )
                changed.append(key)
                continue
        loadable[key] = value
    if missing:
        report.add("missing", "module", f"{name} has {_listing(missing)}", skip=False)
    if unexpected:
        report.add("unexpected", "module", f"{_listing(unexpected)} (not in {name})", skip=False)
    for line in shapes:
        report.add("mismatched", "module", line, skip=False)
    return loadable


def _check_list(component: str, saved: Any, current: list[Any], report: _Report, what: str) -> None:
    if not isinstance(saved, list):
        report.add("mismatched", component, f"the checkpoint holds {type(saved).__name__}")
        return
    if len(saved) != len(current):
        hint = ""
        if not current and component == "optimizers":
            hint = (
                " (optimizers are configured when fit starts: resume with "
                "trainer.fit(module, data, ckpt_path=...))"
            )
        kind = "missing" if len(current) > len(saved) else "unexpected"
        report.add(
            kind,
            component,
            f"the checkpoint has {len(saved)} {what}, this run {len(current)}{hint}",
        )
        return
    for index, (entry, obj) in enumerate(zip(saved, current, strict=True)):
        where = f"{component}[{index}]"
        if not isinstance(entry, dict) or "state_dict" not in entry:
            report.add("mismatched", component, f"{where} is not a saved {what[:-1]}")
            continue
        cls = _qualname(type(obj))
        if entry.get("class") != cls:
            report.add(
                "mismatched",
                component,
                f"{where} is a {entry.get('class')} in the checkpoint but a {cls} in this run",
            )
            continue
        if component == "optimizers":
            groups = entry["state_dict"].get("param_groups", [])
            mine = obj.param_groups
            if len(groups) != len(mine):
                report.add(
                    "mismatched",
                    component,
                    f"{where} has {len(groups)} parameter groups in the checkpoint but "
                    f"{len(mine)} in this run",
                )
                continue
            for g, (a, b) in enumerate(zip(groups, mine, strict=True)):
                if len(a.get("params", ())) != len(b["params"]):
                    report.add(
                        "mismatched",
                        component,
                        f"{where} parameter group {g} has {len(a.get('params', ()))} "
                        f"parameters in the checkpoint but {len(b['params'])} in this run",
                    )
                    break


def _loop_shape(loop: Any) -> dict[str, Any]:
    return {name: _loop_shape(child) for name, child in loop.children.items()}


def _saved_loop_shape(state: Any) -> Any:
    if not isinstance(state, dict) or not isinstance(state.get("loops"), dict):
        return None
    return {name: _saved_loop_shape(child) for name, child in state["loops"].items()}


def _check_components(trainer: Trainer, state: dict[str, Any], report: _Report) -> dict[str, Any]:
    """Compare ``state`` with the trainer; returns the module entries that can load."""
    for component in COMPONENTS:
        if component not in state:
            report.add("missing", component, "the checkpoint has no such component")
    loadable: dict[str, Any] = {}
    changed: list[str] = []
    if "module" in state:
        loadable = _check_module(trainer, state["module"], report, changed)
    if "optimizers" in state:
        _check_list("optimizers", state["optimizers"], trainer.optimizers, report, "optimizers")
        if changed and "optimizers" not in report.skip:
            # Their state (momentum, moments) has the old shapes of those parameters.
            assert trainer.module is not None
            params = dict(trainer.module.named_parameters())
            reshaped = {id(params[k]) for k in changed if k in params}
            for index, opt in enumerate(trainer.optimizers):
                names = [
                    k
                    for k in changed
                    if k in params
                    and any(
                        id(p) in reshaped and p is params[k]
                        for g in opt.param_groups
                        for p in g["params"]
                    )
                ]
                if names:
                    report.add(
                        "mismatched",
                        "optimizers",
                        f"optimizers[{index}] holds state for {_listing(names)}, whose shapes "
                        "changed",
                    )
    if "lr_schedulers" in state:
        scheds = [c.scheduler for c in trainer.lr_scheduler_configs]
        _check_list("lr_schedulers", state["lr_schedulers"], scheds, report, "schedulers")
    if "precision" in state:
        saved = state["precision"]
        saved_state = saved.get("state_dict") if isinstance(saved, dict) else None
        mine = trainer.precision.state_dict()
        if not isinstance(saved_state, dict):
            report.add("mismatched", "precision", "the checkpoint's entry is malformed")
        elif bool(saved_state) != bool(mine):
            if saved_state:
                report.add(
                    "unexpected",
                    "precision",
                    f"the checkpoint has precision state such as a grad scaler's (precision "
                    f"{saved.get('name')!r}) but this run's precision "
                    f"{trainer.precision.name!r} keeps none",
                )
            else:
                report.add(
                    "missing",
                    "precision",
                    f"this run's precision {trainer.precision.name!r} keeps state (a grad "
                    f"scaler's, say) but the checkpoint (precision {saved.get('name')!r}) "
                    "has none",
                )
    if "plugins" in state:
        saved_plugins = state["plugins"] if isinstance(state["plugins"], dict) else {}
        mine_plugins = stateful_plugins(trainer)
        for key in mine_plugins:
            if key not in saved_plugins:
                report.add(
                    "missing",
                    f"plugins[{key!r}]",
                    "this run has the plugin but the checkpoint has no state for it",
                )
        for key in saved_plugins:
            if key not in mine_plugins:
                report.add(
                    "unexpected",
                    f"plugins[{key!r}]",
                    "the checkpoint has state for it but no plugin of this run has that state_key",
                )
    if "loops" in state:
        saved_loops = state["loops"] if isinstance(state["loops"], dict) else {}
        for name, loop in trainer.loops.items():
            if name not in saved_loops:
                report.add("missing", f"loops[{name!r}]", "the checkpoint has no state for it")
            elif _saved_loop_shape(saved_loops[name]) != _loop_shape(loop):
                report.add(
                    "mismatched",
                    f"loops[{name!r}]",
                    f"the sub-loops differ: saved {_saved_loop_shape(saved_loops[name])}, "
                    f"present {_loop_shape(loop)}",
                )
    if "data" in state:
        data = getattr(trainer, "_train_data", None)
        saved_data = state["data"] if isinstance(state["data"], dict) else {}
        stateful_now = isinstance(data, Stateful)
        if stateful_now and "train" not in saved_data:
            report.add(
                "missing",
                "data['train']",
                f"the training data ({type(data).__name__}) is stateful now but the "
                "checkpoint was taken with a loader that is not; with strict=False the "
                "resumed epoch skips its consumed batches instead",
            )
        elif not stateful_now and "train" in saved_data:
            report.add(
                "unexpected",
                "data['train']",
                "the checkpoint holds a stateful loader's position but the training data "
                f"({type(data).__name__}) is not stateful; pass the same kind of loader "
                "(torchdata's StatefulDataLoader), or strict=False to skip the consumed "
                "batches instead",
            )
    return loadable


def _wrap(component: str, source: str, exc: Exception) -> CheckpointError:
    return CheckpointError(f"cannot load {component} from {source}: {type(exc).__name__}: {exc}")


def load_trainer_state(
    trainer: Trainer, state: dict[str, Any], *, strict: bool = True, source: str | None = None
) -> CheckpointMismatch:
    """Load a checkpoint dict into ``trainer`` (see :meth:`Trainer.load_state_dict`)."""
    where = source or "the given state"
    check_header(state, where)
    module = trainer.module
    if module is None:
        raise CheckpointError(
            f"cannot load {where}: the trainer has no module yet. Resume with "
            "trainer.fit(module, data, ckpt_path=...), which loads the checkpoint once the "
            "module and its optimizers are set up."
        )
    report = _Report()
    loadable = _check_components(trainer, state, report)
    result = report.result()
    module_partial = any(
        line.startswith("module:")
        for line in (*result.missing, *result.unexpected, *result.mismatched)
    )
    if strict and result:
        raise CheckpointError(
            f"the checkpoint {where} does not match this run:\n{result}\nMake the run "
            "match the checkpoint (same model, optimizers, schedulers, plugins and kind of "
            "loader), or load what matches with strict=False."
        )
    skip = report.skip

    if "module" in state and "module" not in skip:
        try:
            if module_partial:
                module.load_state_dict(loadable, strict=False)
            else:
                module.load_state_dict(state["module"])
        except Exception as exc:
            raise _wrap("the module", where, exc) from exc
    if "optimizers" in state and "optimizers" not in skip:
        for index, (entry, opt) in enumerate(
            zip(state["optimizers"], trainer.optimizers, strict=True)
        ):
            try:
                opt.load_state_dict(entry["state_dict"])
            except Exception as exc:
                raise _wrap(f"optimizers[{index}]", where, exc) from exc
            if state["loopbus"].get("global_step"):
                # It has stepped before: a scheduler stepping before its first step in this
                # process must not warn that the order is wrong (torch tracks it this way).
                opt._opt_called = True  # type: ignore[attr-defined]
    if "lr_schedulers" in state and "lr_schedulers" not in skip:
        for index, (entry, config) in enumerate(
            zip(state["lr_schedulers"], trainer.lr_scheduler_configs, strict=True)
        ):
            try:
                config.scheduler.load_state_dict(entry["state_dict"])
            except Exception as exc:
                raise _wrap(f"lr_schedulers[{index}]", where, exc) from exc
    if "precision" in state and "precision" not in skip:
        try:
            trainer.precision.load_state_dict(state["precision"]["state_dict"])
        except Exception as exc:
            raise _wrap("precision", where, exc) from exc
    if "plugins" in state:
        for key, plugin in stateful_plugins(trainer).items():
            component = f"plugins[{key!r}]"
            if component in skip or key not in state["plugins"]:
                continue
            try:
                plugin.load_state_dict(state["plugins"][key])
            except Exception as exc:
                raise _wrap(component, where, exc) from exc
    if "loops" in state:
        for name, loop in trainer.loops.items():
            component = f"loops[{name!r}]"
            if component in skip:
                continue
            try:
                loop.load_state_dict(state["loops"][name])
            except Exception as exc:
                raise _wrap(component, where, exc) from exc
    epoch_loop = trainer.fit_loop.epoch_loop
    epoch_loop._loader_restored = False
    data = getattr(trainer, "_train_data", None)
    saved_data = state.get("data")
    if (
        isinstance(saved_data, dict)
        and "train" in saved_data
        and "data['train']" not in skip
        and isinstance(data, Stateful)
    ):
        try:
            data.load_state_dict(saved_data["train"])
            # Loaders such as StatefulDataLoader build the restored iterator lazily, and
            # building one draws from torch's generator: do it now, without moving the
            # generators, so the epoch's iter(data) draws exactly what the original did.
            with rng_preserved():
                data.state_dict()
        except Exception as exc:
            raise _wrap("data['train'] (the training loader's position)", where, exc) from exc
        epoch_loop._loader_restored = True
    grads = state.get("grads")
    if isinstance(grads, dict) and "module" not in skip:
        for name, param in module.named_parameters():
            saved_grad = grads.get(name)
            if isinstance(saved_grad, torch.Tensor) and saved_grad.shape == param.shape:
                param.grad = saved_grad.to(device=param.device, dtype=param.dtype)
            else:
                param.grad = None
    records = state.get("records")
    if isinstance(records, dict):
        latest = trainer.recorder.latest
        for name, r in records.items():
            try:
                latest[name] = PutRecord(
                    name=name,
                    value=r["value"],
                    step=int(r["step"]),
                    epoch=int(r["epoch"]),
                    time=float(r["time"]),
                    source=str(r["source"]),
                    destinations=tuple(r["destinations"]),
                )
            except (KeyError, TypeError, ValueError):
                continue
    rng = state.get("rng")
    if isinstance(rng, dict):
        restore_rng(rng)
        # Applied again where the run resumes, so that what runs in between (FitStarted
        # handlers, say) does not shift the generators.
        trainer._resume_rng = rng
    return result


def resolve_last(trainer: Trainer) -> Path | None:
    """The checkpoint ``ckpt_path="last"`` means: the newest of those the trainer's
    plugins report through ``last_checkpoint_path()``; None (with a warning) if none has
    written one yet."""
    providers = [p for p in trainer.plugins if callable(getattr(p, "last_checkpoint_path", None))]
    if not providers:
        from .._exceptions import MisconfigurationError

        raise MisconfigurationError(
            "ckpt_path='last' needs a plugin that knows where checkpoints are written, such "
            "as loopbus.plugins.Checkpoint(dirpath), among the trainer's plugins; add one or "
            "pass the path of a checkpoint (or of its directory)."
        )
    found = []
    for plugin in providers:
        path = plugin.last_checkpoint_path()  # type: ignore[attr-defined]
        if path is not None:
            found.append(Path(os.fspath(path)))
    if not found:
        where = ", ".join(str(getattr(p, "dirpath", None) or type(p).__name__) for p in providers)
        warnings.warn(
            f"ckpt_path='last' but no checkpoint has been written yet (looked in {where}); "
            "training starts from the beginning.",
            UserWarning,
            stacklevel=4,
        )
        return None
    return newest(found) if len(found) > 1 else found[0]
