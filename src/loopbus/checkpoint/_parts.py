"""Checkpoints composed from a registry of :class:`Stateful` parts.

At stage start the trainer builds one ``dict[str, Stateful]`` (see
:meth:`Trainer.stateful_parts`); a save is handed it in a :class:`CheckpointRegistry`.
A checkpoint is that registry's state dicts under the same keys, next to a header, in
one dict that ``torch.load(path, weights_only=True)`` reads::

    {
      "loopbus":          {"format": "loopbus.checkpoint", "format_version": 2,
                           "version": ..., "torch_version": ..., "created": <time.time()>,
                           "global_step": int, "epoch": int, "module_class": "pkg.Model",
                           "parts": [key, ...], "config": {...}},  # the run's, if any
      "run":              {"step": int, "epoch": int},
      "module":           module.state_dict(),
      "hparams":          {"values": module.hparams},  # save_hyperparameters()
      "optimizers/0":     {"class": "torch.optim.sgd.SGD", "state_dict": {...}},
      "lr_schedulers/0":  {"class": "...", "state_dict": {...}},
      "precision":        {"name": "32", "state_dict": {...}},
      "loops/fit":        {"progress": ..., "state": ..., "loops": {...}}, ...
      "plugins/<key>":    plugin.state_dict(), ...
      "data/train":       {"position": loader.state_dict(),  # only when the loader is
                           "generators": [...]},              # stateful (position None:
                                                              # a new epoch is next)
      "rng":              {"python": ..., "torch": ..., "numpy": ..., "cuda": [...]},
      "grads":            {parameter name: gradient},  # empty unless mid-accumulation
      "records":          {name: {"value": ..., "step": ..., ...}},
      "user/<name>":      obj.state_dict(), ...     # Trainer.register_stateful(name, obj)
    }

Save, the compatibility check and load iterate the registry; nothing here is written
per component. A part may explain its own incompatibility with
``explain_mismatch(saved) -> list[Problem]`` and load what still matches with
``load_matching(saved)`` (used with ``strict=False``); any other ``Stateful`` is checked
for presence only, and an error from its ``load_state_dict`` names its key.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from loopbus.state._runstate import ResumePlan
from loopbus.state._stateful import Problem
from loopbus.step._params import has_sharded_parameters, own_class

from .._exceptions import CheckpointError
from .._version import __version__
from ._format import FORMAT, FORMAT_VERSION, check_header
from ._registry import CheckpointRegistry
from ._rng_state import (
    capture_rng,
    loader_generator_states,
    restore_loader_generators,
    restore_rng,
    rng_preserved,
    set_sampler_epoch,
)
from ._write import to_plain

__all__ = [
    "CheckpointMismatch",
    "GradsPart",
    "HparamsPart",
    "LoaderPart",
    "LoopPart",
    "ModulePart",
    "OptimizerPart",
    "PrecisionPart",
    "Problem",
    "RngPart",
    "SchedulerPart",
    "collect_state",
    "load_state",
    "qualname",
]


def qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


# ---------------------------------------------------------------- adapters
# Parts for objects whose own state_dict is torch's (module, optimizers, schedulers) or
# that need a word about how they load (loops, loader, generators, gradients).


class ModulePart:
    """The module's weights; explains missing, unexpected and reshaped entries. A full
    state dict loads into a sharded module too (each rank keeps its shards of it)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return self.module.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._load(state, strict=True)

    def _load(self, state: dict[str, Any], *, strict: bool) -> None:
        if has_sharded_parameters(self.module.parameters()):
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                set_model_state_dict,
            )

            options = StateDictOptions(full_state_dict=True, strict=strict)
            set_model_state_dict(self.module, state, options=options)
        else:
            self.module.load_state_dict(state, strict=strict)

    def _matching(self, saved: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
        current = self.module.state_dict()
        name = own_class(self.module).__name__
        loadable, reshaped = {}, []
        for key, value in saved.items():
            mine = current.get(key)
            if mine is None:
                continue
            if (
                isinstance(value, torch.Tensor)
                and isinstance(mine, torch.Tensor)
                and value.shape != mine.shape
            ):
                reshaped.append(
                    f"{key!r} has shape {tuple(value.shape)} in the checkpoint but "
                    f"{tuple(mine.shape)} in {name}"
                )
                continue
            loadable[key] = value
        return loadable, reshaped

    def explain_mismatch(self, saved: Any) -> list[Problem]:
        if not isinstance(saved, Mapping):
            return [Problem("mismatched", f"the checkpoint holds {type(saved).__name__}")]
        name = own_class(self.module).__name__
        current = self.module.state_dict()
        problems = []
        missing = [k for k in current if k not in saved]
        unexpected = [k for k in saved if k not in current]
        if missing:
            problems.append(Problem("missing", f"{name} has {_listing(missing)}", False))
        if unexpected:
            problems.append(Problem("unexpected", f"{_listing(unexpected)} (not in {name})", False))
        problems += [Problem("mismatched", line, False) for line in self._matching(saved)[1]]
        return problems

    def load_matching(self, saved: dict[str, Any]) -> None:
        self._load(self._matching(saved)[0], strict=False)


class HparamsPart:
    """The module's hyperparameters (:attr:`Module.hparams`): plain values, for
    ``Module.load_from_checkpoint`` and for reading. A resumed run keeps the arguments
    its module was built with (loading changes nothing)."""

    #: Checkpoints written before this part existed lack it: that is no mismatch.
    optional = True

    def __init__(self, module: Any) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return {"values": dict(getattr(self.module, "hparams", {}))}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


class _ClassedPart:
    """An optimizer or scheduler, saved with its class so a swap is explained."""

    what = "object"

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def state_dict(self) -> dict[str, Any]:
        return {"class": qualname(type(self.obj)), "state_dict": self.obj.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.obj.load_state_dict(state["state_dict"])

    def explain_mismatch(self, saved: Any) -> list[Problem]:
        if not isinstance(saved, Mapping) or not isinstance(saved.get("state_dict"), Mapping):
            return [Problem("mismatched", f"the checkpoint's entry is not a saved {self.what}")]
        cls = qualname(type(self.obj))
        if saved.get("class") != cls:
            return [
                Problem(
                    "mismatched",
                    f"a {saved.get('class')} in the checkpoint but a {cls} in this run",
                )
            ]
        return []


class OptimizerPart(_ClassedPart):
    """An optimizer; explains changed parameter groups and reshaped parameters."""

    what = "optimizer"

    def explain_mismatch(self, saved: Any) -> list[Problem]:
        problems = super().explain_mismatch(saved)
        if problems:
            return problems
        state = saved["state_dict"]
        groups = state.get("param_groups", [])
        mine = self.obj.param_groups
        if len(groups) != len(mine):
            return [
                Problem(
                    "mismatched",
                    f"{len(groups)} parameter groups in the checkpoint but {len(mine)} in this run",
                )
            ]
        params: list[torch.Tensor] = []
        for g, (a, b) in enumerate(zip(groups, mine, strict=True)):
            if len(a.get("params", ())) != len(b["params"]):
                return [
                    Problem(
                        "mismatched",
                        f"parameter group {g} has {len(a.get('params', ()))} parameters in "
                        f"the checkpoint but {len(b['params'])} in this run",
                    )
                ]
            params += list(b["params"])
        # Per-parameter state (momentum, moments) must have the parameters' shapes.
        reshaped = []
        ids = [i for a in groups for i in a.get("params", ())]
        for index, param in zip(ids, params, strict=True):
            per_param = state.get("state", {}).get(index, {})
            for key, value in per_param.items():
                if (
                    isinstance(value, torch.Tensor)
                    and value.dim() > 0
                    and value.shape != param.shape
                ):
                    reshaped.append(f"{key} of parameter {index}")
                    break
        if reshaped:
            return [
                Problem(
                    "mismatched",
                    f"holds state for parameters whose shapes changed: {_listing(reshaped)}",
                )
            ]
        return []


class SchedulerPart(_ClassedPart):
    what = "scheduler"


class PrecisionPart:
    """The precision's state (a grad scaler's), saved with the precision's name."""

    def __init__(self, precision: Any) -> None:
        self.precision = precision

    def state_dict(self) -> dict[str, Any]:
        return {"name": str(self.precision.name), "state_dict": self.precision.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.precision.load_state_dict(state["state_dict"])

    def explain_mismatch(self, saved: Any) -> list[Problem]:
        saved_state = saved.get("state_dict") if isinstance(saved, Mapping) else None
        if not isinstance(saved_state, Mapping):
            return [Problem("mismatched", "the checkpoint's entry is malformed")]
        mine = self.precision.state_dict()
        if bool(saved_state) == bool(mine):
            return []
        if saved_state:
            return [
                Problem(
                    "unexpected",
                    "the checkpoint has precision state such as a grad scaler's (precision "
                    f"{saved.get('name')!r}) but this run's precision "
                    f"{self.precision.name!r} keeps none",
                )
            ]
        return [
            Problem(
                "missing",
                f"this run's precision {self.precision.name!r} keeps state (a grad scaler's, "
                f"say) but the checkpoint (precision {saved.get('name')!r}) has none",
            )
        ]


def _loop_shape(loop: Any) -> dict[str, Any]:
    return {name: _loop_shape(child) for name, child in loop.children.items()}


def _saved_loop_shape(state: Any) -> Any:
    if not isinstance(state, Mapping) or not isinstance(state.get("loops"), Mapping):
        return None
    return {name: _saved_loop_shape(child) for name, child in state["loops"].items()}


def _inside_epoch(loop: Any, saved: Any) -> bool:
    if not isinstance(saved, Mapping):
        return False
    if loop.saved_inside_epoch(saved):
        return True
    loops = saved.get("loops")
    return isinstance(loops, Mapping) and any(
        _inside_epoch(child, loops.get(name)) for name, child in loop.children.items()
    )


class LoopPart:
    """A root loop and its sub-loops; explains a changed loop tree."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop

    def state_dict(self) -> dict[str, Any]:
        return self.loop.state_dict()  # type: ignore[no-any-return]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loop.load_state_dict(state)

    def saved_inside_epoch(self, saved: Any) -> bool:
        """Whether the loop state ``saved`` was taken inside an epoch, as a loop of the
        tree reads its own saved state (``Loop.saved_inside_epoch``)."""
        return _inside_epoch(self.loop, saved)

    def explain_mismatch(self, saved: Any) -> list[Problem]:
        if _saved_loop_shape(saved) != _loop_shape(self.loop):
            return [
                Problem(
                    "mismatched",
                    f"the sub-loops differ: saved {_saved_loop_shape(saved)}, present "
                    f"{_loop_shape(self.loop)}",
                )
            ]
        return []


class LoaderPart:
    """A stateful training loader: its position as of the last batch trained on
    (``position()``, from the batch source; never a batch fetched ahead) and the
    states of the ``torch.Generator`` objects it shuffles with. Between epochs, after
    an epoch that ended before the loader ran out (``fresh()``), the position is None:
    the next epoch starts from its beginning, so the loader is not repositioned.
    ``epoch()`` is the epoch being resumed (the run part loads first): a sampler whose
    order depends on it (``DistributedSampler``) is set to it before the restored
    iterator is built."""

    def __init__(
        self,
        loader: Any,
        position: Callable[[], dict[str, Any] | None],
        fresh: Callable[[], bool],
        epoch: Callable[[], int],
    ) -> None:
        self.loader = loader
        self.position = position
        self.fresh = fresh
        self.epoch = epoch

    def state_dict(self) -> dict[str, Any]:
        position = self.position()
        if position is None and not self.fresh():
            position = self.loader.state_dict()
        # Taken after the position: taking that may build the iterator, which draws.
        return {"position": position, "generators": loader_generator_states(self.loader)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["position"] is None:
            # Saved between epochs after one cut short: a new epoch starts afresh.
            restore_loader_generators(self.loader, state.get("generators"))
            return
        set_sampler_epoch(self.loader, self.epoch())
        self.loader.load_state_dict(state["position"])
        # Loaders such as StatefulDataLoader build the restored iterator lazily, and
        # building one draws from torch's generator: do it now, without moving the
        # global generators, so the epoch's iter(loader) draws exactly what the
        # original did.
        with rng_preserved():
            self.loader.state_dict()
        # The position alone leaves the loader's own generator one draw behind the
        # interrupted run (see restore_loader_generators): set it as it was.
        restore_loader_generators(self.loader, state.get("generators"))

    def explain_mismatch(self, saved: Any) -> list[Problem]:
        # A mapping, or None (saved between epochs after one cut short).
        if not isinstance(saved, Mapping) or not isinstance(
            saved.get("position", False), Mapping | None
        ):
            return [Problem("mismatched", "the checkpoint's entry is not a loader position")]
        return []


class RngPart:
    """The global random generators (Python, NumPy, torch CPU and CUDA).

    Given a distributed strategy, the state holds every rank's generators (gathered
    when saving, so saving is then collective) under ``"ranks"``, and each rank loads
    its own; a single-process state is the generators themselves."""

    def __init__(self, strategy: Any = None) -> None:
        self.strategy = strategy

    def state_dict(self) -> dict[str, Any]:
        strategy = self.strategy
        if strategy is None or not strategy.distributed:
            return capture_rng()
        return {"ranks": strategy.all_gather_object(to_plain(capture_rng(), copy=True))}

    def own(self, state: dict[str, Any]) -> dict[str, Any]:
        """This rank's generators in a saved state (of either form)."""
        ranks = state.get("ranks")
        if ranks is None:
            return state
        strategy = self.strategy
        rank = 0 if strategy is None else strategy.global_rank
        if rank >= len(ranks):
            raise CheckpointError(
                f"the checkpoint holds the generators of {len(ranks)} ranks; this is rank "
                f"{rank}: resume with the world size the checkpoint was taken with."
            )
        return ranks[rank]  # type: ignore[no-any-return]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        restore_rng(self.own(state))


class GradsPart:
    """Gradients held mid-accumulation (empty between optimizer steps)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        return {n: p.grad for n, p in self.module.named_parameters() if p.grad is not None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, param in self.module.named_parameters():
            saved = state.get(name)
            if isinstance(saved, torch.Tensor) and saved.shape == param.shape:
                param.grad = saved.to(device=param.device, dtype=param.dtype)
            else:
                param.grad = None


# ---------------------------------------------------------------- saving


def collect_state(registry: CheckpointRegistry, *, to_host: bool = False) -> dict[str, Any]:
    """The checkpoint dict of the ``registry``'s parts, under a header (the module's
    class, how far the run is). Without ``to_host`` tensors are the live ones; with it,
    host copies later steps don't touch."""
    parts = registry.parts
    state: dict[str, Any] = {
        "loopbus": {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "version": __version__,
            "torch_version": str(torch.__version__),
            "created": time.time(),
            "global_step": registry.global_step,
            "epoch": registry.epoch,
            "module_class": qualname(own_class(registry.module)),
            "parts": list(parts),
        }
    }
    if registry.config is not None:
        state["loopbus"]["config"] = dict(registry.config)
    # Taking the state must not move the generators (a loader's state_dict may draw).
    with rng_preserved():
        for key, part in parts.items():
            value = part.state_dict()
            if not isinstance(value, dict):
                raise CheckpointError(
                    f"{type(part).__name__}.state_dict() (checkpoint part {key!r}) returned "
                    f"{type(value).__name__}; it must return a dict of tensors and Python "
                    "primitives."
                )
            state[key] = value
    return to_plain(state, copy=to_host, where="checkpoint")  # type: ignore[no-any-return]


# ---------------------------------------------------------------- loading


@dataclass(frozen=True)
class CheckpointMismatch:
    """What a checkpoint and the current run disagree on, by part.

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


# What a part missing on one side usually means, by key.
_MISSING_HINTS = {
    "data/train": (
        " (the training data is stateful now, but the checkpoint was taken with a loader "
        "that is not; with strict=False the resumed epoch skips its consumed batches "
        "instead)"
    ),
    "optimizers/0": (
        " (optimizers are configured when fit starts: resume with "
        "trainer.fit(module, data, ckpt_path=...))"
    ),
}
_UNEXPECTED_HINTS = {
    "data/train": (
        " (the checkpoint holds a stateful loader's position, but the training data is "
        "not stateful: pass the same kind of loader, torchdata's StatefulDataLoader, or "
        "strict=False to skip the consumed batches instead)"
    ),
}


def _check(
    parts: Mapping[str, Any], state: Mapping[str, Any]
) -> tuple[CheckpointMismatch, set[str], set[str]]:
    """Compare; returns the report, the keys to leave alone and those to load partially."""
    missing: list[str] = []
    unexpected: list[str] = []
    mismatched: list[str] = []
    skip: set[str] = set()
    partial: set[str] = set()
    lists = {"missing": missing, "unexpected": unexpected, "mismatched": mismatched}
    for key, part in parts.items():
        if key not in state:
            skip.add(key)
            if getattr(part, "optional", False):
                continue  # a part older checkpoints lack, with nothing to restore
            missing.append(
                f"{key}: this run has it but the checkpoint has no state for it"
                + _MISSING_HINTS.get(key, "")
            )
            continue
        explain = getattr(part, "explain_mismatch", None)
        if explain is None:
            continue
        for problem in explain(state[key]):
            lists[problem.kind].append(f"{key}: {problem.message}")
            (skip if problem.skip else partial).add(key)
    unexpected += [
        f"{key}: the checkpoint has state for it but this run has no such part"
        + _UNEXPECTED_HINTS.get(key, "")
        for key in state
        if key != "loopbus" and key not in parts
    ]
    return CheckpointMismatch(tuple(missing), tuple(unexpected), tuple(mismatched)), skip, partial


def load_state(
    parts: Mapping[str, Any],
    state: dict[str, Any],
    *,
    strict: bool = True,
    source: str | None = None,
) -> tuple[CheckpointMismatch, ResumePlan]:
    """Load a checkpoint dict into the parts of a registry; return what did not match
    and the plan the loops resume from. Checks every part before loading any."""
    where = source or "the given state"
    header = check_header(state, where)
    result, skip, partial = _check(parts, state)
    if strict and result:
        raise CheckpointError(
            f"the checkpoint {where} does not match this run:\n{result}\nMake the run match "
            "the checkpoint (same model, optimizers, schedulers, plugins, registered objects "
            "and kind of loader), or load what matches with strict=False."
        )
    for key, part in parts.items():
        if key in skip:
            continue
        try:
            if key in partial:
                part.load_matching(state[key])
            else:
                part.load_state_dict(state[key])
        except Exception as exc:
            raise CheckpointError(
                f"cannot load {key} ({type(part).__name__}) from {where}: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    run = state.get("run") if "run" not in skip else None
    rng = state.get("rng") if "rng" not in skip else None
    plan = ResumePlan(
        step=int(run["step"]) if isinstance(run, Mapping) else int(header.get("global_step", 0)),
        epoch=int(run["epoch"]) if isinstance(run, Mapping) else int(header.get("epoch", 0)),
        rng=_own_rng(parts.get("rng"), rng) if isinstance(rng, dict) else None,
        loader_restored="data/train" in parts and "data/train" not in skip,
        sampler_positioned="data/sampler" in parts and "data/sampler" not in skip,
        source=where,
        created=_created(header),
    )
    return result, plan


def _created(header: Mapping[str, Any]) -> float | None:
    created = header.get("created")
    if isinstance(created, (int, float)) and not isinstance(created, bool):
        return float(created)
    return None


def _own_rng(part: Any, state: dict[str, Any]) -> dict[str, Any]:
    own = getattr(part, "own", None)
    return own(state) if callable(own) else state
