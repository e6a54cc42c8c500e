"""Batch-size finder: the largest batch that trains without running out of memory.

Each trial is a short ``fit`` (``steps_per_trial`` optimizer steps) of the module on a
trainer of its own, built with the run's options (device, precision, accumulation,
clipping, executor, compile, prefetch) and no plugins, on a loader rebuilt at the
trial's batch size. A trial that runs out of memory (CUDA's ``torch.OutOfMemoryError``
or the host allocator's failure) frees what it held and the search goes on smaller; any
other error ends the search unchanged. Afterwards the weights, the optimizers' and the
precision's state, the modules' train/eval modes and the random generators are as they
were before it, so training starts from the same state as without the search.
"""

from __future__ import annotations

import functools
import gc
import math
import re
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch.utils.data import DataLoader, IterableDataset

from loopbus import (
    MisconfigurationError,
    Plugin,
    RngSnapshot,
    TrainerView,
    check_choice,
    check_int,
    check_number,
    is_datamodule,
    on,
    prepare_datamodule,
    run_or_return,
)
from loopbus.events import FitStarted

__all__ = ["BatchSizeFinder", "find_batch_size", "is_out_of_memory"]

#: The name of the record that carries the batch size found.
RECORD = "batch_size_finder/batch_size"

_MODES = {
    "power": "double the batch size until a trial runs out of memory",
    "binsearch": "double until a trial runs out of memory, then bisect",
}

#: The host allocator's failure: "DefaultCPUAllocator: can't allocate memory: you tried
#: to allocate N bytes" (Linux, macOS) or "... not enough memory: ..." (Windows).
_HOST_OOM = re.compile(r"DefaultCPUAllocator: (?:can't allocate memory|not enough memory)")

LoaderFactory = Callable[[int], Iterable[Any]]


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure a smaller batch may avoid: CUDA's
    ``torch.OutOfMemoryError``, or the host allocator's ``RuntimeError``."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and _HOST_OOM.search(str(error)) is not None


# ------------------------------------------------------------------ loaders
def _rebuild(loader: DataLoader[Any], batch_size: int) -> DataLoader[Any]:
    """``loader`` again at ``batch_size``: the same dataset, sampler (so the same
    shuffling), collate function, workers and other options."""
    options: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "drop_last": loader.drop_last,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
    }
    if loader.num_workers > 0:
        options["prefetch_factor"] = loader.prefetch_factor
    if hasattr(loader, "in_order"):
        options["in_order"] = loader.in_order
    if not isinstance(loader.dataset, IterableDataset):
        options["sampler"] = loader.sampler
    return DataLoader(loader.dataset, batch_size=batch_size, **options)


def loader_factory(train_data: Any, loader: LoaderFactory | None = None) -> LoaderFactory:
    """How the training loader is made at a batch size: ``loader`` when given, else a
    ``torch.utils.data.DataLoader`` with a ``batch_size`` rebuilt with its options."""
    if loader is not None:
        if not callable(loader):
            raise MisconfigurationError(
                f"BatchSizeFinder(loader=...) takes a function of the batch size that returns "
                f"the training loader, got {type(loader).__name__}: write "
                "loader=lambda batch_size: DataLoader(dataset, batch_size=batch_size)."
            )
        return loader
    how = (
        "pass a function that builds the loader at a batch size: BatchSizeFinder(loader="
        "lambda batch_size: DataLoader(dataset, batch_size=batch_size, ...)) (or "
        "find_batch_size(..., loader=...))."
    )
    if type(train_data) is DataLoader:
        if train_data.batch_size is None:
            raise MisconfigurationError(
                "the batch-size finder cannot change the batch size of this DataLoader: it "
                "has no batch_size (it was given a batch_sampler, or batch_size=None); " + how
            )
        return functools.partial(_rebuild, train_data)
    if isinstance(train_data, DataLoader):
        raise MisconfigurationError(
            f"the batch-size finder rebuilds a torch DataLoader at each size, but "
            f"{type(train_data).__name__} is a subclass whose options it cannot copy; " + how
        )
    raise MisconfigurationError(
        f"the batch-size finder cannot rebuild {type(train_data).__name__} at another batch "
        "size (only a torch DataLoader with a batch_size); " + how
    )


def _sample_count(loader: Any) -> int | None:
    """The samples one epoch of ``loader`` holds (a DataLoader over a sized sampler):
    no batch needs to be larger."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset):
        return None
    try:
        return len(loader.sampler)  # type: ignore[arg-type]
    except TypeError:
        return None


# ------------------------------------------------------------------ state
def _to_host(value: Any) -> Any:
    """A copy of ``value`` with every tensor copied to the host."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {k: _to_host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_host(v) for v in value)
    return value


class _Snapshot:
    """What the search changes, as it was before: the weights (on the host), the
    modules' modes, the random generators (Python, NumPy, torch, CUDA, the loader's), the
    precision's state (a grad scaler), and each optimizer and scheduler as first seen."""

    def __init__(self, trainer: TrainerView, module: torch.nn.Module, train_data: Any) -> None:
        self.weights = _to_host(module.state_dict())
        self.grads = [
            (p, None if p.grad is None else _to_host(p.grad)) for p in module.parameters()
        ]
        self.modes = [(m, m.training) for m in module.modules()]
        self.precision = _to_host(trainer.precision.state_dict())
        self.rng = RngSnapshot(device=trainer.options.device, data=train_data)
        self.parts: dict[int, tuple[weakref.ref[Any], dict[str, Any]]] = {}
        self.see(trainer)

    def see(self, trainer: TrainerView) -> None:
        """Remember the optimizers and schedulers of ``trainer`` not seen before."""
        parts: list[Any] = list(trainer.optimizers)
        parts += [config.scheduler for config in trainer.lr_scheduler_configs]
        for part in parts:
            if id(part) not in self.parts:
                self.parts[id(part)] = (weakref.ref(part), _to_host(part.state_dict()))

    def restore(self, trainer: TrainerView, module: torch.nn.Module) -> None:
        module.load_state_dict(self.weights)
        for param, grad in self.grads:
            param.grad = None if grad is None else grad.to(param.device)
        for m, training in self.modes:  # parents first: each ends with its own mode
            m.train(training)
        for ref, state in self.parts.values():
            part = ref()
            if part is not None:  # still used (a module that keeps its optimizer)
                part.load_state_dict(state)
        trainer.precision.load_state_dict(self.precision)
        self.rng.restore()


def _trial_options(trainer: TrainerView, steps: int) -> dict[str, Any]:
    """A trial trainer's keywords: every option of the run (and its strategy object and
    precision), but ``steps`` optimizer steps, no sanity check, no summary, no
    preemption handling, no dev run and no plugins."""
    options = trainer.options.replace(
        max_steps=steps,
        max_epochs=-1,
        num_sanity_val_steps=0,
        enable_model_summary=False,
        preemption=False,
        fast_dev_run=False,
        strategy=trainer.strategy,
        root_dir=None,  # a trial writes no run folder
    )
    return {**options.given, "plugins": [], "precision": trainer.precision}


def _free(device: torch.device, thorough: bool = True) -> None:
    """Release what a trial held (its trainer's reference cycles hold the optimizers'
    state; a failed trial's traceback, its activations): unreachable objects, then
    CUDA's cached blocks. A full collection takes a fraction of a second on a large
    heap; after a trial that fitted on the CPU the young generations do."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
    else:
        gc.collect(2 if thorough else 1)


# ------------------------------------------------------------------ the plugin
class BatchSizeFinder(Plugin):
    """Finds the largest batch size that trains without running out of memory, before
    ``fit`` trains, and trains at it::

        trainer = Trainer(max_epochs=10, plugins=[ProgressBar(), BatchSizeFinder("binsearch")])
        trainer.fit(module, DataLoader(dataset, batch_size=2, shuffle=True))

    ``mode="power"`` doubles the size from ``init_val`` until a trial runs out of memory
    and keeps the last size that fitted; ``"binsearch"`` then bisects between that size
    and the one that failed. At most ``max_trials`` trials of ``steps_per_trial``
    optimizer steps run. The size used is the largest that fitted less ``margin``
    (``floor(largest * (1 - margin))``, at least 1), published as the record
    ``batch_size_finder/batch_size`` when ``fit`` starts and kept as :attr:`batch_size`.

    The training loader is rebuilt at the size found: ``loader``, a function of the
    batch size that returns the loader, when given (``fit``'s training data is then
    replaced by its result); otherwise ``fit``'s training data must be a
    ``torch.utils.data.DataLoader`` with a ``batch_size`` (rebuilt with the same dataset,
    sampler and options).
    """

    def __init__(
        self,
        mode: Literal["power", "binsearch"] = "power",
        *,
        init_val: int = 2,
        max_trials: int = 25,
        steps_per_trial: int = 3,
        margin: float = 0.05,
        loader: LoaderFactory | None = None,
    ) -> None:
        owner = "BatchSizeFinder"
        check_choice("mode", mode, _MODES, owner=owner)
        check_int("init_val", init_val, minimum=1, owner=owner)
        check_int("max_trials", max_trials, minimum=1, owner=owner)
        check_int("steps_per_trial", steps_per_trial, minimum=1, owner=owner)
        check_number("margin", margin, minimum=0.0, owner=owner)
        if margin >= 1:
            raise MisconfigurationError(
                f"BatchSizeFinder(margin={margin!r}) is the fraction taken off the largest "
                "batch size that fitted; it must be at least 0 and below 1 (e.g. 0.05)."
            )
        if loader is not None:
            loader_factory(None, loader)  # checks it
        self.mode = mode
        self.init_val = init_val
        self.max_trials = max_trials
        self.steps_per_trial = steps_per_trial
        self.margin = float(margin)
        self.loader = loader
        #: The batch size found (after the margin), None before a search.
        self.batch_size: int | None = None
        #: The largest batch size that trained, before the margin.
        self.largest_fit: int | None = None
        #: Each trial of the last search, in order: (batch size, whether it fitted).
        self.trials: list[tuple[int, bool]] = []

    async def prepare_fit(self, trainer: TrainerView, module: Any, train_data: Any) -> Any:
        make = loader_factory(train_data, self.loader)
        if isinstance(trainer, TrainerView) and trainer.options.fast_dev_run:
            return train_data  # a quick check of the code, not a run to size
        size = await self.search(trainer, module, train_data)
        return make(size)

    @on(FitStarted)
    def _publish(self, event: FitStarted) -> None:
        if self.batch_size is not None:
            self.put(RECORD, self.batch_size)

    async def search(self, trainer: TrainerView, module: Any, train_data: Any = None) -> int:
        """Run the search for ``module`` on ``trainer`` (outside a stage) and return the
        batch size found; the weights, optimizers and generators are restored after it."""
        if not isinstance(trainer, TrainerView):
            raise MisconfigurationError(
                f"the batch-size finder needs a loopbus.Trainer, got {type(trainer).__name__}."
            )
        if trainer.stage is not None:
            raise RuntimeError(
                f"the batch-size finder runs before a stage, but {trainer.stage!r} is running."
            )
        if trainer.world_size > 1:
            raise MisconfigurationError(
                "the batch-size finder runs in one process only; find the size in a "
                "single-process run and pass it to the distributed one."
            )
        if not isinstance(module, torch.nn.Module):
            raise MisconfigurationError(
                f"the batch-size finder needs a loopbus.Module, got {type(module).__name__}."
            )
        if is_datamodule(train_data):  # readied as fit readies it; its loader
            train_data, _ = prepare_datamodule(
                train_data, "fit", trainer=trainer, wanted=lambda m: m == "train_dataloader"
            )
        make = loader_factory(train_data, self.loader)
        cap = _sample_count(train_data) if self.loader is None else _sample_count(make(1))
        snapshot = _Snapshot(trainer, module, train_data)
        self.trials = []
        try:
            largest = await self._bisect(
                functools.partial(self._trial, trainer, module, make, snapshot), cap
            )
        finally:
            _free(trainer.options.device)
            snapshot.restore(trainer, module)
        self.largest_fit = largest
        self.batch_size = max(1, math.floor(largest * (1 - self.margin) + 1e-9))
        return self.batch_size

    async def _trial(
        self,
        trainer: TrainerView,
        module: Any,
        make: LoaderFactory,
        snapshot: _Snapshot,
        size: int,
    ) -> bool:
        """One trial at ``size``: True if it trained, False if it ran out of memory."""
        fitted = await self._fit(trainer, module, make(size), snapshot)
        _free(trainer.options.device, thorough=not fitted)
        self.trials.append((size, fitted))
        return fitted

    async def _fit(
        self, trainer: TrainerView, module: Any, data: Any, snapshot: _Snapshot
    ) -> bool:
        trial = type(trainer)(**_trial_options(trainer, self.steps_per_trial))
        trial.subscribe(FitStarted, lambda event: snapshot.see(trial))
        try:
            await trial.fit(module, data)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            return False
        return True

    async def _bisect(self, attempt: Callable[[int], Any], cap: int | None) -> int:
        """The largest size that ``attempt`` reported as fitting, searched by the mode."""
        low, high = 0, None  # the largest size that fitted, the smallest that did not
        size = self.init_val if cap is None else max(1, min(self.init_val, cap))
        for _ in range(self.max_trials):
            if await attempt(size):
                low = size
            else:
                high = size
            if high is None:  # nothing failed yet: double, up to the samples there are
                if cap is not None and size >= cap:
                    break
                size = size * 2 if cap is None else min(size * 2, cap)
            elif low == 0:  # nothing fitted yet: halve
                size = high // 2
                if size < 1:
                    break
            elif self.mode == "power" or high - low <= 1:
                break
            else:
                size = (low + high) // 2
        if low == 0:
            raise RuntimeError(
                f"BatchSizeFinder: no batch size fitted in {len(self.trials)} trials (the "
                f"smallest tried, {min(s for s, _ in self.trials)}, ran out of memory); "
                "make the model or its inputs smaller, or train on a larger device."
            )
        return low


def find_batch_size(
    trainer: TrainerView,
    module: Any,
    train_data: Any = None,
    *,
    mode: Literal["power", "binsearch"] = "power",
    init_val: int = 2,
    max_trials: int = 25,
    steps_per_trial: int = 3,
    margin: float = 0.05,
    loader: LoaderFactory | None = None,
) -> Any:
    """The batch size :class:`BatchSizeFinder` would find, without training after it:
    ``await find_batch_size(trainer, module, train_loader)`` in async code; from
    synchronous code it runs to completion and returns the size. The options are the
    plugin's; build the loader at the size returned and pass it to ``fit``."""
    finder = BatchSizeFinder(
        mode,
        init_val=init_val,
        max_trials=max_trials,
        steps_per_trial=steps_per_trial,
        margin=margin,
        loader=loader,
    )
    return run_or_return(functools.partial(finder.search, trainer, module, train_data))
