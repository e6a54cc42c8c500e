"""``Plugin``: the base of everything that subscribes to a trainer's events."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from loopbus.records._records import PutMixin

from .._exceptions import MisconfigurationError
from .._validate import check_choice, check_int

if TYPE_CHECKING:
    from anyio.abc import TaskGroup

    from loopbus.step._trainer_view import TrainerView

__all__ = ["Delivery", "Plugin"]

_LIFECYCLE = ("setup", "start", "stop", "teardown", "state_dict", "load_state_dict", "prepare_fit")
_ARGUMENTS = {"prepare_fit": "trainer, module, train_data"}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Delivery:
    """How a plugin's handlers are subscribed, declared once per class
    (``delivery = Delivery(mode="queued", ranks="zero")``) or per instance:

    * ``destination``: the role its :class:`PutRecord` handlers play (``"callbacks"``,
      ``"loggers"``, ``"progress_bar"``, ``"external"`` or a registered one);
    * ``mode``, ``buffer``, ``overflow``: the default delivery of its handlers
      (``@on(..., mode=...)`` overrides them): ``"inline"`` (called in the publisher's
      flow) or ``"queued"`` (a task of its own behind a queue of ``buffer`` items, which
      ``"block"`` the publisher or ``"drop"`` the newest when full);
    * ``priority``: the order of inline handlers of one event (higher first);
    * ``ranks``: on which processes of a distributed run it acts, ``"all"`` or
      ``"zero"`` (rank 0 only; on the others the trainer neither sets it up nor
      subscribes it, and its state is still part of every checkpoint).
    """

    destination: str = "callbacks"
    mode: Literal["inline", "queued"] = "inline"
    buffer: int = 1024
    overflow: Literal["block", "drop"] = "block"
    priority: int = 0
    ranks: Literal["all", "zero"] = "all"

    def __post_init__(self) -> None:
        if not isinstance(self.destination, str) or not self.destination:
            raise MisconfigurationError(
                f"Delivery(destination=...) is the name of a destination such as "
                f"'callbacks' or 'loggers', got {self.destination!r}."
            )
        check_choice("mode", self.mode, ("inline", "queued"), owner="Delivery")
        check_int("buffer", self.buffer, minimum=0, owner="Delivery")
        check_choice("overflow", self.overflow, ("block", "drop"), owner="Delivery")
        check_int("priority", self.priority, minimum=None, owner="Delivery")
        check_choice("ranks", self.ranks, ("all", "zero"), owner="Delivery")

    def replace(self, **changes: Any) -> Delivery:
        """This delivery with ``changes``."""
        return dataclasses.replace(self, **changes)


#: The names delivery settings had as plugin class attributes before ``Delivery``.
_OLD_NAMES = ("destination", "mode", "buffer", "overflow", "priority", "ranks")
_OLD_VALUES: dict[str, Any] = {
    "destination": lambda v: isinstance(v, str),
    "mode": lambda v: v in ("inline", "queued"),
    "buffer": lambda v: type(v) is int,
    "overflow": lambda v: v in ("block", "drop"),
    "priority": lambda v: type(v) is int,
    "ranks": lambda v: v in ("all", "zero"),
}


class _Deprecated:
    """``plugin.mode`` and the other old names, read from ``plugin.delivery`` with a
    warning. A non-data descriptor: a subclass's own attribute of that name (an option
    such as ``EarlyStopping.mode``) shadows it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        warnings.warn(
            f"Plugin.{self.name} is deprecated; read plugin.delivery.{self.name} "
            f"(declare delivery = Delivery({self.name}=...)).",
            DeprecationWarning,
            stacklevel=2,
        )
        target = owner if obj is None else obj
        return getattr(target.delivery, self.name)


class Plugin(PutMixin):
    """A plugin is written exactly like user code: methods decorated with
    :func:`loopbus.on` are subscribed when a stage starts and removed when it ends.

    :attr:`delivery` (a :class:`Delivery`) declares how its handlers are subscribed:
    destination, inline or queued, buffer and overflow, priority, and on which ranks
    of a distributed run it acts (the built-in loggers, progress bar, model summary and
    stream server act on rank 0 only). ``writes_files`` declares that it
    writes files (checkpoints, logs): ``Trainer(fast_dev_run=...)`` leaves such plugins
    out. ``handles_preemption`` declares that it acts on ``PreemptionRequested`` (saves
    the run): with ``Trainer(preemption="auto")`` the trainer handles SIGTERM and SIGUSR1
    while such a plugin is active. A plugin is :class:`Stateful`: override ``state_dict``/``load_state_dict`` to
    be checkpointed (under :attr:`state_key`).
    """

    delivery: Delivery = Delivery()
    writes_files: ClassVar[bool] = False
    handles_preemption: ClassVar[bool] = False

    # The old names, for one release (see _Deprecated).
    destination: Any = _Deprecated("destination")
    mode: Any = _Deprecated("mode")
    buffer: Any = _Deprecated("buffer")
    overflow: Any = _Deprecated("overflow")
    priority: Any = _Deprecated("priority")
    ranks: Any = _Deprecated("ranks")

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        old = {
            name: cls.__dict__[name]
            for name in _OLD_NAMES
            if name in cls.__dict__ and _OLD_VALUES[name](cls.__dict__[name])
        }
        if old:
            if "delivery" in cls.__dict__:
                raise TypeError(
                    f"{cls.__name__} declares both delivery = Delivery(...) and the old "
                    f"class attributes {sorted(old)}; keep only delivery."
                )
            settings = ", ".join(f"{k}={v!r}" for k, v in old.items())
            warnings.warn(
                f"{cls.__name__}: plugin class attributes {sorted(old)} are deprecated and "
                f"will be removed in the next release; declare "
                f"delivery = Delivery({settings}) instead.",
                DeprecationWarning,
                stacklevel=2,
            )
            cls.delivery = cls.delivery.replace(**old)
        for name in _LIFECYCLE:
            attr = cls.__dict__.get(name)
            if attr is None:
                continue
            if getattr(attr, "__loopbus_on__", None):
                raise TypeError(
                    f"{cls.__name__}.{name} is a Plugin lifecycle hook, so it cannot also be an "
                    f"event handler; give the @on-decorated method another name."
                )
            if name in ("start", "stop", "prepare_fit") and not inspect.iscoroutinefunction(attr):
                raise TypeError(
                    f"{cls.__name__}.{name} overrides the lifecycle hook `async def {name}(self, "
                    f"{_ARGUMENTS.get(name, 'trainer, stage, ...')})` and must be `async def` "
                    "with that signature."
                )

    @property
    def state_key(self) -> str:
        """The key of this plugin's state in a checkpoint (its class name by default)."""
        return type(self).__qualname__

    def subscription_defaults(self) -> dict[str, Any]:
        d = self.delivery
        return {
            "destination": d.destination,
            "mode": d.mode,
            "buffer": d.buffer,
            "overflow": d.overflow,
            "priority": d.priority,
        }

    def setup(self, trainer: TrainerView, stage: str) -> None:
        """Called when a stage (``"fit"``, ``"validate"``, ...) starts, before any event."""

    async def start(self, trainer: TrainerView, stage: str, task_group: TaskGroup) -> None:
        """Called after ``setup`` inside the stage's task group, for plugins that run
        services (a server, a watcher). Tasks started in ``task_group`` must return after
        :meth:`stop`."""

    async def stop(self, trainer: TrainerView, stage: str) -> None:
        """Called at the end of the stage, after the last event and the queue drain."""

    def teardown(self, trainer: TrainerView, stage: str) -> None:
        """Called last, however the stage ended."""

    async def prepare_fit(self, trainer: TrainerView, module: Any, train_data: Any) -> Any:
        """Called by ``fit`` before its stage starts (no event published, nothing bound,
        moved or configured yet), in plugin order, for plugins that override it; returns
        the training data ``fit`` trains on: ``train_data`` itself, or a replacement (a
        loader rebuilt at another batch size). For tuning that runs before training."""
        return train_data

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        return None
