"""``Module``: a ``torch.nn.Module`` with the steps and optimizers of a training run."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .._exceptions import MisconfigurationError
from ._records import PutMixin
from ._scope import Scope

if TYPE_CHECKING:
    from ._trainer import Trainer

__all__ = ["Module"]


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
