"""DataModules: an object that makes a stage's loaders, with Lightning's methods
(``prepare_data``, ``setup(stage)``, ``train_dataloader``, ``val_dataloader``,
``test_dataloader``, ``predict_dataloader``, ``teardown(stage)``, and optionally
``state_dict``/``load_state_dict``). Any object with them is one: a
``LightningDataModule`` works unchanged, without Lightning being imported here.

:func:`prepare_datamodule` runs what comes before a stage (``prepare_data`` on one process
per node, a barrier, ``setup`` on every process) and returns the stage's loaders;
:func:`close_datamodule` runs ``teardown``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .._exceptions import MisconfigurationError

__all__ = [
    "LOADER_METHODS",
    "close_datamodule",
    "implements",
    "is_datamodule",
    "prepare_datamodule",
    "stateful_datamodule",
]

#: The loaders each stage takes from a DataModule, in the order the stage takes them.
LOADER_METHODS: dict[str, tuple[str, ...]] = {
    "fit": ("train_dataloader", "val_dataloader"),
    "validate": ("val_dataloader",),
    "test": ("test_dataloader",),
    "predict": ("predict_dataloader",),
}
_ALL_LOADERS = ("train_dataloader", "val_dataloader", "test_dataloader", "predict_dataloader")
#: The packages whose base classes define every loader method only to raise: a method
#: found there is not implemented by the DataModule.
_BASES = ("lightning.", "pytorch_lightning.", "lightning_fabric.")


def is_datamodule(obj: Any) -> bool:
    """Whether ``obj`` is a DataModule: it has ``setup`` and at least one loader method
    (a loader has neither: ``DataLoader``, a list of batches)."""
    if obj is None or isinstance(obj, type):
        return False
    kind = type(obj)
    return callable(getattr(kind, "setup", None)) and any(
        callable(getattr(kind, name, None)) for name in _ALL_LOADERS
    )


def implements(datamodule: Any, method: str) -> bool:
    """Whether ``datamodule`` implements ``method`` itself: defined by its class or a
    base of it other than Lightning's (whose loader methods only raise)."""
    for cls in type(datamodule).__mro__:
        if method in cls.__dict__:
            return callable(cls.__dict__[method]) and not cls.__module__.startswith(_BASES)
    return False


def prepare_datamodule(
    datamodule: Any,
    stage: str = "fit",
    *,
    trainer: Any = None,
    wanted: Callable[[str], bool] | None = None,
) -> tuple[Any, ...]:
    """Ready ``datamodule`` for ``stage`` (``"fit"``, ``"validate"``, ``"test"`` or
    ``"predict"``) as the trainer's stage does, and return the stage's loaders
    (:data:`LOADER_METHODS`: fit's training and validation loaders, one for the others;
    None for one it does not implement or ``wanted`` declines).

    ``prepare_data()`` runs on one process per node (local rank 0 of ``trainer``'s
    strategy; without a trainer, this process), or on one in all (global rank 0) when
    the DataModule says ``prepare_data_per_node = False``, as in Lightning; then every
    process waits (the strategy's barrier) and runs ``setup(stage)``. A DataModule with
    a ``trainer`` attribute (Lightning's) gets ``trainer`` there, as Lightning sets it.
    Raises :class:`MisconfigurationError` when the stage's first loader is missing or its
    method returns None."""
    if stage not in LOADER_METHODS:
        raise MisconfigurationError(
            f"prepare_datamodule(stage={stage!r}): the stages are {list(LOADER_METHODS)}."
        )
    strategy = getattr(trainer, "strategy", None)
    first = LOADER_METHODS[stage][0]
    name = type(datamodule).__name__
    if not implements(datamodule, first):
        raise MisconfigurationError(
            f"{stage} takes its data from {name}.{first}(), which {name} does not define; "
            f"define it, or pass the loader: trainer.{stage}(module, data)."
        )
    if trainer is not None and hasattr(datamodule, "trainer"):
        datamodule.trainer = trainer
    if getattr(datamodule, "prepare_data_per_node", True):
        preparing = strategy is None or strategy.local_rank == 0
    else:
        preparing = strategy is None or strategy.is_global_zero
    if preparing and implements(datamodule, "prepare_data"):
        datamodule.prepare_data()
    if strategy is not None:
        strategy.barrier()
    datamodule.setup(stage)
    loaders: list[Any] = []
    for method in LOADER_METHODS[stage]:
        if not implements(datamodule, method) or (wanted is not None and not wanted(method)):
            loaders.append(None)
            continue
        loader = getattr(datamodule, method)()
        if loader is None and method == first:
            raise MisconfigurationError(
                f"{name}.{method}() returned None; it must return the loader {stage} runs "
                "on (a DataLoader or another iterable of batches)."
            )
        loaders.append(loader)
    return tuple(loaders)


def close_datamodule(datamodule: Any, stage: str) -> None:
    """``datamodule.teardown(stage)``, when it defines one."""
    if implements(datamodule, "teardown"):
        datamodule.teardown(stage)


def stateful_datamodule(datamodule: Any) -> bool:
    """Whether ``datamodule`` saves state with checkpoints: it defines both
    ``state_dict`` and ``load_state_dict`` (Lightning's base defines them to save
    nothing, so a ``LightningDataModule`` that does not override them saves nothing)."""
    return implements(datamodule, "state_dict") and implements(datamodule, "load_state_dict")
