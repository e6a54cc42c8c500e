"""The learning-rate finder: a short training run whose learning rate grows from
``min_lr`` to ``max_lr``, one value per optimizer step, and the rate at which the
smoothed loss falls fastest.

:class:`LRFinder` is the plugin that runs the sweep inside a ``fit`` (it sets the rate
at each step, records the loss, stops when the loss diverges and puts the curve as
records); :func:`find_lr` runs it on a trainer of its own and then puts back everything
the sweep changed, so that ``find_lr`` followed by ``fit`` trains exactly as ``fit``
alone would with the suggested rate.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

from loopbus import (
    CustomEvent,
    Delivery,
    MisconfigurationError,
    Plugin,
    RngSnapshot,
    TrainerView,
    check_choice,
    check_int,
    on,
    run_or_return,
)
from loopbus.events import TrainBatchCompleted, TrainBatchStarted

if TYPE_CHECKING:
    from loopbus import Module

__all__ = ["LRFinder", "LRFinderPoint", "LRFinderResult", "find_lr", "steepest_descent"]

_log = logging.getLogger("loopbus")

_MODES = {
    "exponential": "the rate grows by the same factor every step",
    "linear": "the rate grows by the same amount every step",
}
_PLOT_FORMATS = (".png", ".svg", ".pdf")
#: How the suggestion reads the curve: the steepest drop of the smoothed loss per step
#: (loopbus's, fastai's), or per unit of learning rate (Lightning's, since 2.1).
_RULES = {
    "per_step": "the steepest drop of the smoothed loss per step of the sweep",
    "per_lr": "the steepest drop of the smoothed loss per unit of learning rate (Lightning's)",
}


def steepest_descent(
    losses: Sequence[float],
    skip_begin: int = 10,
    skip_end: int = 1,
    *,
    lrs: Sequence[float] | None = None,
) -> int | None:
    """The index of the most negative gradient of ``losses`` (``torch.gradient``: central
    differences, one-sided at the ends), leaving out the first ``skip_begin`` points and
    the last ``skip_end`` of the finite ones (the curve is cut at its first NaN or
    infinity). The gradient is per point (per step of the sweep) or, given the rates
    ``lrs`` of the points, per unit of learning rate (Lightning's rule). None when fewer
    than two points are left."""
    finite = next((i for i, v in enumerate(losses) if not math.isfinite(v)), len(losses))
    end = finite - skip_end
    if end - skip_begin < 2:
        return None
    window = torch.tensor(losses[skip_begin:end], dtype=torch.float64)
    if lrs is None:
        gradient = torch.gradient(window)[0]
    else:
        spacing = torch.tensor(lrs[skip_begin:end], dtype=torch.float64)
        gradient = torch.gradient(window, spacing=(spacing,))[0]
    return skip_begin + int(gradient.argmin())


class LRFinderPoint(CustomEvent, frozen=True, kw_only=True):
    """One point of the sweep, published after its step (with the records
    ``lr_find/lr`` and ``lr_find/loss`` of that step): its index, the rate the step ran
    with, the loss measured (averaged over micro-batches and ranks) and smoothed."""

    index: int
    lr: float
    loss: float
    raw_loss: float


@dataclass
class LRFinderResult:
    """What a sweep found: the rate of each step (``lrs``), the smoothed loss there
    (``losses``, as plotted and as the suggestion reads it), the loss as measured
    (``raw_losses``, averaged over the ranks), and the suggested rate (None when the
    sweep had too few points), read by ``rule``: ``"per_step"``, the steepest drop of the
    smoothed loss per step, or ``"per_lr"``, per unit of learning rate (Lightning's)."""

    lrs: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    raw_losses: list[float] = field(default_factory=list)
    mode: str = "exponential"
    skip_begin: int = 10
    skip_end: int = 1
    rule: str = "per_step"
    #: Why the sweep ended before ``num_training`` steps (the loss diverged), or None.
    early_stop_reason: str | None = None

    @property
    def suggestion_index(self) -> int | None:
        """The index (into ``lrs``) of the suggestion."""
        return self._steepest(self.skip_begin, self.skip_end, self.rule)

    @property
    def suggestion(self) -> float | None:
        """The rate at which the smoothed loss falls fastest, by :attr:`rule` (see
        :func:`steepest_descent`)."""
        index = self.suggestion_index
        return None if index is None else self.lrs[index]

    def suggest(
        self, skip_begin: int = 10, skip_end: int = 1, rule: str | None = None
    ) -> float | None:
        """The suggestion with other numbers of points left out at either end, or by
        another ``rule`` (``"per_step"`` or ``"per_lr"``; None: :attr:`rule`)."""
        index = self._steepest(skip_begin, skip_end, self.rule if rule is None else rule)
        return None if index is None else self.lrs[index]

    def _steepest(self, skip_begin: int, skip_end: int, rule: str) -> int | None:
        check_choice("rule", rule, _RULES, owner="LRFinderResult.suggest")
        lrs = self.lrs if rule == "per_lr" else None
        return steepest_descent(self.losses, skip_begin, skip_end, lrs=lrs)

    @property
    def stopped_early(self) -> bool:
        return self.early_stop_reason is not None

    def plot(self, path: str | Path, *, suggest: bool = True) -> Path:
        """Draw the smoothed loss against the rate (a log axis for an exponential
        sweep), the suggestion marked, into ``path`` (``.png``, ``.svg`` or ``.pdf``).
        Needs matplotlib (``pip install matplotlib``); uses no pyplot state."""
        target = Path(path)
        if target.suffix.lower() not in _PLOT_FORMATS:
            raise MisconfigurationError(
                f"LRFinderResult.plot writes {', '.join(_PLOT_FORMATS)} files, got {str(path)!r}: "
                "end the path with one of them."
            )
        try:
            from matplotlib.figure import Figure
        except ImportError:
            raise ModuleNotFoundError(
                "LRFinderResult.plot needs matplotlib, which is not installed. Install it "
                "with: pip install matplotlib (or read result.lrs and result.losses, also "
                "put as the records lr_find/lr and lr_find/loss)."
            ) from None
        figure = Figure(figsize=(6, 4))
        axes = figure.subplots()
        axes.plot(self.lrs, self.losses)
        if self.mode == "exponential":
            axes.set_xscale("log")
        axes.set_xlabel("learning rate")
        axes.set_ylabel("loss (smoothed)")
        index = self.suggestion_index
        if suggest and index is not None:
            lr, loss = self.lrs[index], self.losses[index]
            axes.plot(lr, loss, "o", color="red", label=f"suggestion: {lr:.3g}")
            axes.legend()
        figure.savefig(target, bbox_inches="tight")
        return target


class LRFinder(Plugin):
    """Sweeps the learning rate during ``fit``: before each optimizer step it sets every
    parameter group of every optimizer to the sweep's rate for that step, after it
    records the step's loss (what ``training_step`` returned, averaged over the
    micro-batches of an accumulation window and, in a distributed run, over the ranks),
    smooths it, puts ``lr_find/lr`` and ``lr_find/loss``, and asks the run to stop once
    ``num_training`` steps are done or the smoothed loss exceeds
    ``early_stop_threshold`` times the best so far (or is not finite).

    The result is :attr:`result`. Use :func:`find_lr`, which runs it on a trainer of its
    own and puts back the module, optimizers and random generators afterwards; added to
    your own ``Trainer`` it sweeps the run it is part of, which is then spent.
    """

    delivery = Delivery(priority=100)  # set the rate before other plugins read it

    def __init__(
        self,
        min_lr: float = 1e-8,
        max_lr: float = 1.0,
        num_training: int = 100,
        mode: Literal["exponential", "linear"] = "exponential",
        early_stop_threshold: float | None = 4.0,
        *,
        beta: float = 0.98,
        skip_begin: int = 10,
        skip_end: int = 1,
        rule: Literal["per_step", "per_lr"] = "per_step",
        destinations: str | Iterable[str] | None = None,
    ) -> None:
        _check_options(min_lr, max_lr, num_training, mode, early_stop_threshold, beta)
        check_choice("rule", rule, _RULES, owner="LRFinder")
        check_int("skip_begin", skip_begin, minimum=0, owner="LRFinder")
        check_int("skip_end", skip_end, minimum=0, owner="LRFinder")
        self.min_lr, self.max_lr = float(min_lr), float(max_lr)
        self.num_training = num_training
        self.mode = mode
        self.early_stop_threshold = early_stop_threshold
        self.beta = beta
        self.skip_begin, self.skip_end = skip_begin, skip_end
        self.rule = rule
        self.destinations = (destinations,) if isinstance(destinations, str) else destinations
        self.result = LRFinderResult(mode=mode, skip_begin=skip_begin, skip_end=skip_end, rule=rule)
        self._reset()

    def lr_at(self, index: int) -> float:
        """The rate of step ``index`` (0 to ``num_training - 1``): ``min_lr`` at the
        first, ``max_lr`` at the last."""
        fraction = min(index, self.num_training - 1) / (self.num_training - 1)
        if self.mode == "linear":
            return self.min_lr + fraction * (self.max_lr - self.min_lr)
        return self.min_lr * float((self.max_lr / self.min_lr) ** fraction)

    def _reset(self) -> None:
        self._trainer: TrainerView | None = None
        self._avg = 0.0
        self._best = math.inf
        self._lr = self.min_lr
        self._window: list[torch.Tensor] = []
        self._first_step: int | None = None
        self._last_step: int | None = None
        self._done = False

    def setup(self, trainer: TrainerView, stage: str) -> None:
        if stage == "fit":
            self._reset()
            self._trainer = trainer
            self.result = LRFinderResult(
                mode=self.mode, skip_begin=self.skip_begin, skip_end=self.skip_end, rule=self.rule
            )

    def teardown(self, trainer: TrainerView, stage: str) -> None:
        self._trainer = None
        self._window = []

    @on(TrainBatchStarted)
    def set_lr(self, event: TrainBatchStarted) -> None:
        trainer = self._trainer
        if trainer is None:
            return
        if self._first_step is None:
            self._first_step = self._last_step = event.step
        self._lr = self.lr_at(event.step - self._first_step)
        for optimizer in trainer.optimizers:
            for group in optimizer.param_groups:
                group["lr"] = self._lr

    @on(TrainBatchCompleted)
    async def record(self, event: TrainBatchCompleted) -> None:
        trainer = self._trainer
        if trainer is None or self._done:
            return
        loss = _loss_of(getattr(event.ctx, "output", None))
        if loss is not None:
            self._window.append(loss.detach().reshape(()).double())
        if event.step == self._last_step:
            return  # the accumulation window is still open
        self._last_step = event.step
        window, self._window = self._window, []
        raw = _mean_over_ranks(window, trainer)
        if raw is not None:
            point = self._add_point(trainer, raw)
            # Delivered now, after the point's records: they carry this step's number.
            await trainer.publish(point)

    def _add_point(self, trainer: TrainerView, raw: float) -> LRFinderPoint:
        """Smooth ``raw`` (exponential average with bias correction), keep and put the
        point, and stop the run when the sweep is complete or the loss diverged."""
        result = self.result
        n = len(result.lrs)
        self._avg = self.beta * self._avg + (1 - self.beta) * raw
        smoothed = self._avg / (1 - self.beta ** (n + 1))
        result.lrs.append(self._lr)
        result.losses.append(smoothed)
        result.raw_losses.append(raw)
        self.put("lr_find/lr", self._lr, destinations=self.destinations)
        self.put("lr_find/loss", smoothed, destinations=self.destinations)
        threshold = self.early_stop_threshold
        if not math.isfinite(smoothed):
            result.early_stop_reason = f"the loss is {smoothed} at lr={self._lr:.3g}"
        elif threshold is not None and n > 0 and smoothed > threshold * self._best:
            result.early_stop_reason = (
                f"the smoothed loss {smoothed:.4g} at lr={self._lr:.3g} exceeds "
                f"early_stop_threshold={threshold:g} times the best, {self._best:.4g}"
            )
        self._best = min(self._best, smoothed)
        if result.early_stop_reason is not None or n + 1 >= self.num_training:
            self._done = True
            trainer.request_stop(f"LRFinder: {result.early_stop_reason or 'the sweep is complete'}")
        return LRFinderPoint(index=n, lr=self._lr, loss=smoothed, raw_loss=raw)


def _check_options(
    min_lr: Any, max_lr: Any, num_training: Any, mode: Any, threshold: Any, beta: Any
) -> None:
    for name, value in (("min_lr", min_lr), ("max_lr", max_lr)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise MisconfigurationError(
                f"LRFinder({name}={value!r}): the learning rates of the sweep are positive "
                f"numbers; pass e.g. min_lr=1e-8, max_lr=1.0."
            )
        if not math.isfinite(value):
            raise MisconfigurationError(f"LRFinder({name}={value!r}) must be finite.")
    if min_lr >= max_lr:
        raise MisconfigurationError(
            f"LRFinder(min_lr={min_lr!r}, max_lr={max_lr!r}): the sweep goes up from min_lr "
            "to max_lr, so min_lr must be smaller than max_lr; swap them or lower min_lr."
        )
    if isinstance(num_training, bool) or not isinstance(num_training, int) or num_training < 2:
        raise MisconfigurationError(
            f"LRFinder(num_training={num_training!r}): the sweep needs at least 2 steps (an "
            "int; the default is 100) to have a slope to read."
        )
    check_choice("mode", mode, _MODES, owner="LRFinder")
    if threshold is not None and (
        isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 1
    ):
        raise MisconfigurationError(
            f"LRFinder(early_stop_threshold={threshold!r}): the sweep stops when the loss "
            "exceeds this many times its best, so it is a number above 1 (default 4.0), or "
            "None to never stop early."
        )
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 <= beta < 1:
        raise MisconfigurationError(
            f"LRFinder(beta={beta!r}): the smoothing factor is in [0, 1) (default 0.98; 0 "
            "does not smooth)."
        )


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss in what ``training_step`` returned (a tensor, or a mapping's ``"loss"``)."""
    if isinstance(output, dict):
        output = output.get("loss")
    return output if isinstance(output, torch.Tensor) else None


def _mean_over_ranks(window: list[torch.Tensor], trainer: TrainerView) -> float | None:
    """The mean of the window's losses over its micro-batches and every rank (one
    all-reduce of a sum and a count, on every rank, so that a rank whose step returned
    no loss takes part too); None when no rank had one."""
    if window:
        stacked = torch.stack(window)
        count = torch.tensor(float(len(window)), dtype=torch.float64, device=stacked.device)
        totals = torch.stack([stacked.sum(), count])
    else:
        device = _loss_device(trainer)
        totals = torch.zeros(2, dtype=torch.float64, device=device)
    if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    total, count = totals.tolist()
    return None if count == 0 else total / count


def _loss_device(trainer: TrainerView) -> torch.device:
    module = trainer.module
    for tensor in module.parameters() if module is not None else ():
        return tensor.device
    return torch.device("cpu")


# ---------------------------------------------------------------- the function form
def find_lr(
    trainer: TrainerView,
    module: Module,
    train_data: Any,
    *,
    min_lr: float = 1e-8,
    max_lr: float = 1.0,
    num_training: int = 100,
    mode: Literal["exponential", "linear"] = "exponential",
    early_stop_threshold: float | None = 4.0,
    update_attr: bool = False,
    attr_name: str = "",
    plugins: Iterable[Plugin] = (),
    rule: Literal["per_step", "per_lr"] = "per_step",
) -> Any:
    """Sweep the learning rate of ``module`` on ``train_data`` and return an
    :class:`LRFinderResult` (``.suggestion``, ``.lrs``, ``.losses``, ``.plot(path)``).

    The sweep runs ``fit`` on a trainer of its own, built from ``trainer``'s options and
    strategy with ``max_steps=num_training`` and the plugins ``[LRFinder(...), *plugins]``
    (pass a logger or a ``StreamServer`` there to see the sweep's records). Before it
    the module is put where ``fit`` puts it (moved to the device; sharded under FSDP) and
    its weights, buffers and gradients, ``trainer``'s optimizers and LR schedulers, the
    random generators (torch, CUDA, ``random``, NumPy) and the loader's generators and
    state are copied; after it, however it ended, they are put back, so ``find_lr``
    then ``fit`` trains exactly as ``fit`` alone with the suggested rate. ``trainer``
    itself runs nothing: its step, epoch, loops and records are untouched.

    ``rule`` is how the suggestion reads the curve: ``"per_step"``, the steepest drop of
    the smoothed loss per step of the sweep (per unit of log-rate for an exponential
    sweep), or ``"per_lr"``, per unit of learning rate, as Lightning reads it (which
    favours lower rates on an exponential sweep); ``result.suggest(rule=...)`` reads the
    other.

    ``update_attr=True`` sets ``module.lr`` (or ``module.learning_rate``, or
    ``attr_name``) to the suggestion, for ``configure_optimizers`` to read, and the rate
    of ``trainer``'s optimizers when it already configured them for this module.

    Like ``trainer.fit``: called from synchronous code it runs to completion and returns
    the result; called where an event loop runs it returns the awaitable
    (``result = await find_lr(trainer, module, data)``).
    """
    finder = LRFinder(min_lr, max_lr, num_training, mode, early_stop_threshold, rule=rule)
    attr = _target_attribute(trainer, module, update_attr, attr_name)
    extra = list(plugins)
    for plugin in extra:
        if not isinstance(plugin, Plugin):
            raise MisconfigurationError(
                f"find_lr(plugins=...) takes loopbus.Plugin instances, got {plugin!r}."
            )
    return run_or_return(
        functools.partial(_find_lr, trainer, module, train_data, finder, attr, extra)
    )


async def _find_lr(
    trainer: TrainerView,
    module: Module,
    train_data: Any,
    finder: LRFinder,
    attr: str | None,
    plugins: list[Plugin],
) -> LRFinderResult:
    precision = copy.deepcopy(trainer.precision)  # its grad scaler's state stays the run's
    trainer.strategy.prepare_module(module, trainer.options.device, precision)
    snapshot = _Snapshot(trainer, module, train_data)
    sweep = _sweep_trainer(trainer, finder, precision, plugins)
    try:
        await sweep.fit(module, train_data)
    finally:
        snapshot.restore()
    result = finder.result
    suggestion = result.suggestion
    if suggestion is None:
        _log.warning(
            "find_lr: no suggestion: the sweep has %d points, fewer than the %d left out at "
            "the ends plus 2 (stopped early: %s). Lower min_lr, raise num_training or "
            "early_stop_threshold, or read result.suggest(skip_begin=...).",
            len(result.lrs),
            result.skip_begin + result.skip_end,
            result.early_stop_reason or "no",
        )
    elif attr is not None:
        setattr(module, attr, suggestion)
        if trainer.module is module:
            for optimizer in trainer.optimizers:
                for group in optimizer.param_groups:
                    group["lr"] = suggestion
    return result


def _target_attribute(trainer: Any, module: Any, update_attr: bool, attr_name: str) -> str | None:
    """Check the call before anything runs; the attribute ``update_attr`` sets."""
    if not isinstance(trainer, TrainerView):
        raise MisconfigurationError(
            f"find_lr(trainer, module, train_data) needs a loopbus.Trainer first, got "
            f"{type(trainer).__name__}."
        )
    if trainer.stage is not None:
        raise MisconfigurationError(
            f"find_lr runs between stages, and trainer is running {trainer.stage!r}: call it "
            "before trainer.fit(...), not from inside a stage."
        )
    if not update_attr:
        return None
    names = [attr_name] if attr_name else ["lr", "learning_rate"]
    for name in names:
        if hasattr(module, name) and not callable(getattr(module, name)):
            return name
    hparams = getattr(module, "hparams", {})
    held = [name for name in names if name in hparams]
    if held:
        raise MisconfigurationError(
            f"find_lr(update_attr=True): {type(module).__name__}.hparams.{held[0]} is "
            "read-only. Keep the rate as an attribute too (self.lr = lr in __init__, read in "
            "configure_optimizers), or leave update_attr off and use result.suggestion."
        )
    raise MisconfigurationError(
        f"find_lr(update_attr=True) sets {' or '.join(f'module.{n}' for n in names)} to the "
        f"suggested rate, and {type(module).__name__} has no such attribute: add it (read "
        "it in configure_optimizers), name yours with attr_name=..., or leave update_attr "
        "off and use result.suggestion."
    )


def _sweep_trainer(
    trainer: TrainerView, finder: LRFinder, precision: Any, plugins: list[Plugin]
) -> TrainerView:
    """A trainer for the sweep: every option of ``trainer`` (and its strategy object),
    but ``num_training`` steps, eager steps (the sweep is not compiled yet, see
    ``docs/tuning.md``), no sanity check, no summary, no preemption handling and no dev
    run, with only the finder and ``plugins``."""
    options = trainer.options.replace(
        max_steps=finder.num_training,
        max_epochs=finder.num_training,
        compile=False,
        num_sanity_val_steps=0,
        enable_model_summary=False,
        preemption=False,
        fast_dev_run=False,
        strategy=trainer.strategy,
        root_dir=None,  # the sweep writes no run folder
    )
    # The class of the caller's trainer (a subclass stays one).
    return type(trainer)(**options.given, precision=precision, plugins=[finder, *plugins])


class _Snapshot:
    """What a sweep changes, copied before it and put back by :meth:`restore`: the
    module's tensors (in place, so every reference to them stays valid), gradients and
    train/eval modes; the trainer's optimizers and schedulers; the random generators;
    the loader's state and generators."""

    def __init__(self, trainer: TrainerView, module: Module, data: Any) -> None:
        with torch.no_grad():
            self.tensors = [(t, t.detach().clone()) for t in _module_tensors(module)]
            self.grads = [
                (p, None if p.grad is None else p.grad.detach().clone())
                for p in module.parameters()
            ]
        self.modes = [(m, m.training) for m in module.modules()]
        self.stateful: list[tuple[Any, Any]] = [
            (o, copy.deepcopy(o.state_dict())) for o in trainer.optimizers
        ]
        self.stateful += [
            (c.scheduler, copy.deepcopy(c.scheduler.state_dict()))
            for c in trainer.lr_scheduler_configs
        ]
        self.stateful += [(part, copy.deepcopy(part.state_dict())) for part in _data_parts(data)]
        self.rng = RngSnapshot(device=trainer.options.device, data=data)

    def restore(self) -> None:
        with torch.no_grad():
            for tensor, saved in self.tensors:
                tensor.copy_(saved)
        for param, grad in self.grads:
            param.grad = grad
        for submodule, training in self.modes:
            submodule.train(training)
        for part, state in self.stateful:
            part.load_state_dict(state)
        self.rng.restore()


def _module_tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _data_parts(data: Any) -> list[Any]:
    """The loader and its sampler, where they have a state (a stateful loader's position,
    a resumable sampler's)."""
    parts = [data, getattr(data, "sampler", None)]
    return [
        p
        for p in parts
        if p is not None and callable(getattr(p, "state_dict", None))
        and callable(getattr(p, "load_state_dict", None))
    ]
