"""``Plugin``: the base of everything that subscribes to a trainer's events."""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from ._records import PutMixin

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from ._trainer import Trainer

__all__ = ["Plugin"]

_LIFECYCLE = ("setup", "start", "stop", "teardown", "state_dict", "load_state_dict")


class Plugin(PutMixin):
    """A plugin is written exactly like user code: methods decorated with
    :func:`loopbus.on` are subscribed when a stage starts and removed when it ends.

    Class attributes declare how: ``destination`` is the role its :class:`PutRecord`
    handlers play (``"callbacks"``, ``"loggers"``, ``"progress_bar"``, ``"external"``);
    ``mode``, ``buffer`` and ``overflow`` are the default delivery for its handlers
    (``@on(..., mode=...)`` overrides them); ``priority`` orders inline handlers (higher
    first). ``ranks`` says on which processes of a distributed (DDP) run it acts:
    ``"all"`` (the default) or ``"zero"`` (rank 0 only: the built-in loggers, progress bar
    and stream server); on the other ranks the trainer neither sets it up nor subscribes
    it (its state is still part of every checkpoint). ``writes_files`` declares that it
    writes files (checkpoints, logs): ``Trainer(fast_dev_run=...)`` leaves such plugins
    out. A plugin is :class:`Stateful`: override ``state_dict``/``load_state_dict`` to
    be checkpointed (under :attr:`state_key`).
    """

    destination: ClassVar[str] = "callbacks"
    mode: ClassVar[Literal["inline", "queued"]] = "inline"
    buffer: ClassVar[int] = 1024
    overflow: ClassVar[Literal["block", "drop"]] = "block"
    priority: ClassVar[int] = 0
    ranks: ClassVar[Literal["all", "zero"]] = "all"
    writes_files: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in _LIFECYCLE:
            attr = cls.__dict__.get(name)
            if attr is None:
                continue
            if getattr(attr, "__loopbus_on__", None):
                raise TypeError(
                    f"{cls.__name__}.{name} is a Plugin lifecycle hook, so it cannot also be an "
                    f"event handler; give the @on-decorated method another name."
                )
            if name in ("start", "stop") and not inspect.iscoroutinefunction(attr):
                raise TypeError(
                    f"{cls.__name__}.{name} overrides the lifecycle hook `async def {name}(self, "
                    "trainer, stage, ...)` and must be `async def` with that signature."
                )

    @property
    def state_key(self) -> str:
        """The key of this plugin's state in a checkpoint (its class name by default)."""
        return type(self).__qualname__

    def subscription_defaults(self) -> dict[str, Any]:
        return {
            "destination": self.destination,
            "mode": self.mode,
            "buffer": self.buffer,
            "overflow": self.overflow,
            "priority": self.priority,
        }

    def setup(self, trainer: Trainer, stage: str) -> None:
        """Called when a stage (``"fit"``, ``"validate"``, ...) starts, before any event."""

    async def start(self, trainer: Trainer, stage: str, task_group: TaskGroup) -> None:
        """Called after ``setup`` inside the stage's task group, for plugins that run
        services (a server, a watcher). Tasks started in ``task_group`` must return after
        :meth:`stop`."""

    async def stop(self, trainer: Trainer, stage: str) -> None:
        """Called at the end of the stage, after the last event and the queue drain."""

    def teardown(self, trainer: Trainer, stage: str) -> None:
        """Called last, however the stage ended."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None
