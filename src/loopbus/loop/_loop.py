"""The Loop contract: Lightning's loop structure, async, with events, scopes and state.

``run()`` does, in order::

    if skip: return on_skip()                 -> RunSkipped
    reset()
    on_run_start(ctx, *args, **kwargs)        -> RunStarted
    while not done:                           (an iteration scope ``it``, emptied after each)
        on_advance_start(it)                  -> AdvanceStarted
        advance(it)
        on_advance_end(it)                    -> AdvanceCompleted
        (the iteration scope is dropped)
    output = on_run_end(ctx)                  -> RunCompleted(output=output)
    (the run scope is dropped)
    return output

Each hook publishes its event (the loop's own subclass of the generic one, see
``events``) after it returns. ``raise StopLoop`` from a hook ends the iterations early.

There is one iteration path. When a run's iterations start, the loop composes them
once: the hooks it calls (:meth:`Loop.iteration_hooks`: a hook with nothing to do in
this run, such as the base class's empty one, is left out), and what runs before
``done`` is read (:meth:`Loop.iteration_boundary`: the training loops' stop checks),
and one function that may stand in for ``on_advance_start`` and ``advance`` while nobody
receives ``AdvanceStarted`` (:meth:`Loop.iteration_shortcut`: the training loop's batch
fetch and step in one call).
``AdvanceStarted`` and ``AdvanceCompleted`` are built and delivered only when someone
subscribes. Without the leak check one iteration scope object serves every iteration of
a run (emptied after each). The iterations are a ``while True`` loop with a break, not
``while not done``: CPython 3.11 specializes a function's bytecode once it has been
entered or has jumped back a few times, and the conditional jump that ends a
``while <test>:`` loop does not count, so a run (one call) would interpret every
iteration unspecialized.
"""

from __future__ import annotations

import contextlib
import inspect
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Generic, NamedTuple, TypeVar

from loopbus.state._ranges import RANGES, in_range
from loopbus.state._scope import (
    LeakCheck,
    Scope,
    Suspect,
    TrackedScope,
    check_suspects,
    collect_suspects,
    leak_check_from_env,
    new_scope,
    plain_scope,
)

from .._exceptions import MisconfigurationError, StopLoop
from ..events import (
    AdvanceCompleted,
    AdvanceStarted,
    EventBus,
    LoopEvent,
    RunCompleted,
    RunSkipped,
    RunStarted,
)
from ._progress import Progress

if TYPE_CHECKING:
    from loopbus.step._trainer_view import TrainerView

__all__ = ["Loop", "LoopEvents"]

T = TypeVar("T")
#: An iteration hook, bound: ``hook(it)`` returns what is left to await, or None when
#: it has finished (a plain function that never waits returns None).
IterationHook = Callable[[Scope], Awaitable[None] | None]
#: ``on_advance_start`` (or None), ``advance``, ``on_advance_end`` (or None).
_Hooks = tuple[IterationHook | None, IterationHook, IterationHook | None]

_ASYNC_HOOKS = (
    "on_run_start",
    "on_advance_start",
    "advance",
    "on_advance_end",
    "on_run_end",
    "on_skip",
)


class LoopEvents(NamedTuple):
    """The event types a loop publishes from its hooks."""

    run_started: type[RunStarted] = RunStarted
    advance_started: type[AdvanceStarted] = AdvanceStarted
    advance_completed: type[AdvanceCompleted] = AdvanceCompleted
    run_completed: type[RunCompleted] = RunCompleted
    run_skipped: type[RunSkipped] = RunSkipped


def _snake(name: str) -> str:
    name = name[:-4] if name.endswith("Loop") and len(name) > 4 else name
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _labelled(hook: Any, label: str) -> Any:
    """``hook`` that first marks the iteration scope with the hook's name."""

    def call(it: TrackedScope) -> Awaitable[None] | None:
        it.enter_hook(label)
        return hook(it)  # type: ignore[no-any-return]

    return call


class _IterationChecker:
    """The leak check's per-iteration work (only built when the check is on)."""

    __slots__ = ("leak_check", "loop", "suspects")

    def __init__(self, loop: str, leak_check: LeakCheck) -> None:
        self.loop = loop
        self.leak_check = leak_check
        self.suspects: list[Suspect] = []

    def new_scope(self, parent: Scope) -> Scope:
        return new_scope(parent, True, self.loop)

    def iteration_done(self, it: Scope) -> None:
        # Verify the previous iteration's values now that the data source has moved on;
        # this one's are checked next time.
        found = collect_suspects(it)
        check_suspects(self.suspects, self.leak_check)
        self.suspects = found


class Loop(Generic[T]):
    """Base class of every loop. Subclasses implement :attr:`done` and :meth:`advance`
    and may override any other hook; they get events, scopes and state for free.

    Hooks are ``async def``. Sub-loops are attributes holding :class:`Loop` instances;
    they form a tree, share the bus and trainer, and are saved with their parent.
    """

    #: Event types published by the hooks; override with the loop's own subclasses.
    events: LoopEvents = LoopEvents()
    #: The loop's name in events and errors; defaults to the snake-cased class name.
    name: str = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for hook in _ASYNC_HOOKS:
            fn = cls.__dict__.get(hook)
            if fn is not None and not inspect.iscoroutinefunction(fn):
                raise TypeError(
                    f"{cls.__name__}.{hook} must be `async def` (loop hooks are awaited); "
                    f"write `async def {hook}(self, ...)`."
                )
        for prop in ("done", "skip"):
            attr = cls.__dict__.get(prop)
            if inspect.isfunction(attr):
                raise TypeError(
                    f"{cls.__name__}.{prop} must be a property (or a plain attribute), not a "
                    f"method: put @property above `def {prop}(self)`."
                )
        if not cls.__dict__.get("name"):
            cls.name = _snake(cls.__name__)

    def __init__(self) -> None:
        self.progress = Progress()
        self._restarting = False
        self._trainer: TrainerView | None = None
        # What the running stage gives the loop (the built-in loops' LoopHost).
        self._host: Any = None
        self.bus: EventBus | None = None
        self.leak_check: LeakCheck = leak_check_from_env()
        #: The scope of the current run (cleared, so empty, once the run has ended).
        self.run_ctx: Any = None

    # ------------------------------------------------------------ tree
    @property
    def children(self) -> dict[str, Loop[Any]]:
        """The direct sub-loops, by attribute name."""
        return {k: v for k, v in vars(self).items() if isinstance(v, Loop)}

    def attach(
        self,
        *,
        bus: EventBus | None = None,
        trainer: TrainerView | None = None,
        leak_check: LeakCheck | str = "inherit",
        host: Any = None,
    ) -> None:
        """Connect this loop and its sub-loops to a bus (and trainer); ``host`` is what a
        stage gives its loops when it starts (see ``LoopHost``)."""
        if bus is not None:
            self.bus = bus
        if trainer is not None:
            self._trainer = trainer
        if leak_check != "inherit":
            self.leak_check = leak_check  # type: ignore[assignment]
        if host is not None:
            self._host = host
        for child in self.children.values():
            child.attach(
                bus=self.bus, trainer=self._trainer, leak_check=self.leak_check, host=self._host
            )

    @property
    def trainer(self) -> TrainerView:
        if self._trainer is None:
            raise RuntimeError(f"the loop {self.name!r} is not attached to a Trainer.")
        return self._trainer

    @property
    def restarting(self) -> bool:
        """Whether the loop's state was just loaded and it is resuming mid-way."""
        return self._restarting

    @restarting.setter
    def restarting(self, value: bool) -> None:
        self._restarting = value
        for child in self.children.values():
            child.restarting = value

    def connect(self, **loops: Loop[Any]) -> None:
        """Attach sub-loops by name (``loop.connect(val_loop=MyValLoop())``)."""
        for name, loop in loops.items():
            if not isinstance(loop, Loop):
                raise TypeError(f"connect({name}=...) needs a Loop instance, got {loop!r}.")
            setattr(self, name, loop)
            loop.attach(
                bus=self.bus, trainer=self._trainer, leak_check=self.leak_check, host=self._host
            )

    def replace(self, **loops: Loop[Any] | type[Loop[Any]]) -> None:
        """Replace sub-loops by instance, or by class with the same ``__init__`` signature
        (the new loop is built from the old one's attributes of the same names). The old
        loop's own sub-loops are connected to the new one."""
        new: dict[str, Loop[Any]] = {}
        for name, replacement in loops.items():
            old = getattr(self, name, None)
            if not isinstance(old, Loop):
                raise MisconfigurationError(
                    f"{type(self).__name__} has no sub-loop {name!r} to replace; its sub-loops "
                    f"are {sorted(self.children)}."
                )
            loop = _replacement(type(self).__name__, name, old, replacement)
            grandchildren = old.children
            if grandchildren:
                loop.connect(**grandchildren)
            new[name] = loop
        self.connect(**new)

    # ------------------------------------------------------------ contract
    @property
    def done(self) -> bool:
        """True when the loop should stop iterating."""
        raise NotImplementedError(f"{type(self).__name__} must define the `done` property.")

    @property
    def skip(self) -> bool:
        """True to return from :meth:`run` at once, through :meth:`on_skip`."""
        return False

    def reset(self) -> None:
        """Prepare a new run: reset the current progress, or when restarting roll back
        the iteration that was in flight when the state was saved."""
        if self._restarting:
            self.progress.reset_on_restart()
        else:
            self.progress.reset()

    async def on_skip(self) -> Any:
        """Called instead of the run when :attr:`skip` is true; returns ``run``'s output."""
        return None

    async def on_run_start(self, ctx: Scope, *args: Any, **kwargs: Any) -> None:
        """First hook of a run; receives ``run``'s arguments."""

    async def on_advance_start(self, ctx: Scope) -> None:
        """Before each :meth:`advance`."""

    async def advance(self, ctx: Scope) -> None:
        """One iteration of the loop."""
        raise NotImplementedError(f"{type(self).__name__} must implement `async def advance`.")

    async def on_advance_end(self, ctx: Scope) -> None:
        """After each :meth:`advance`."""

    async def on_run_end(self, ctx: Scope) -> Any:
        """Last hook of a run; its return value is ``run``'s."""
        return None

    def teardown(self) -> None:
        """Release resources at the end of a stage (called for the whole tree)."""

    def teardown_tree(self) -> None:
        for child in self.children.values():
            child.teardown_tree()
        self.teardown()

    # ------------------------------------------------------------ events
    def make_event(self, event_type: type[LoopEvent], ctx: Scope | None, **fields: Any) -> Any:
        """Build the event a hook publishes. Override to add fields of your own events."""
        trainer = self._trainer
        if trainer is not None:
            fields.setdefault("step", trainer.global_step)
            fields.setdefault("epoch", trainer.current_epoch)
        return event_type(loop=self.name, ctx=ctx, **fields)

    def _ensure_bus(self) -> EventBus:
        if self.bus is None:
            self.attach(bus=EventBus())
        assert self.bus is not None
        return self.bus

    # ------------------------------------------------------------ running
    async def run(self, *args: Any, parent_ctx: Scope | None = None, **kwargs: Any) -> Any:
        """Run the loop (see the module docstring for the order of hooks and events)."""
        bus = self.bus if self.bus is not None else self._ensure_bus()
        table = bus.table
        deliver = bus.deliver
        events = self.events
        if self.skip:
            return await self._skip_run(bus)
        self.reset()
        # The iteration path is chosen here, once per run: with the leak check the hooks
        # are labelled (so a leak names the hook that set the value) and every scope is
        # verified; without it nothing per iteration pays for the option.
        leak_check = self.leak_check
        tracked = leak_check is not None
        ctx = new_scope(parent_ctx, tracked, self.name)
        self.run_ctx = ctx
        ok = False
        try:
            if isinstance(ctx, TrackedScope):
                ctx.enter_hook("on_run_start")
            await self.on_run_start(ctx, *args, **kwargs)
            entries = table[events.run_started]
            if entries:
                await deliver(
                    entries,
                    self.make_event(
                        events.run_started, ctx, iteration=self.progress.current.completed
                    ),
                )
            suspects = await self._iterate(ctx, leak_check)
            if self._restarting:
                self.restarting = False
            if isinstance(ctx, TrackedScope):
                ctx.enter_hook("on_run_end")
            output = await self.on_run_end(ctx)
            entries = table[events.run_completed]
            if entries:
                await deliver(
                    entries,
                    self.make_event(
                        events.run_completed,
                        ctx,
                        iteration=self.progress.current.completed,
                        output=output,
                    ),
                )
            ok = True
            return output
        finally:
            if ok and tracked:
                check_suspects(suspects + collect_suspects(ctx), leak_check)
            else:
                ctx.__dict__.clear()

    async def _skip_run(self, bus: EventBus) -> Any:
        """A run that ``skip`` said not to do: ``on_skip`` and ``RunSkipped`` only."""
        output = await self.on_skip()
        event_type = self.events.run_skipped
        entries = bus.table[event_type]
        if entries:
            await bus.deliver(entries, self.make_event(event_type, None, output=output))
        return output

    def iteration_hooks(self) -> _Hooks:
        """The hooks each iteration of this run calls: ``on_advance_start``, ``advance``
        and ``on_advance_end``, asked once when the run's iterations start (after
        :meth:`on_run_start`). Either end is None where it has nothing to do in this run
        (by default: where the class keeps :class:`Loop`'s empty hook). A loop that
        overrides this leaves out only hooks that would do nothing, and may give a plain
        function for a hook that does the same work without waiting: what it returns,
        if not None, is awaited (the built-in loops give their batch fetch and their
        inline training step so)."""
        cls = type(self)
        start = None if cls.on_advance_start is Loop.on_advance_start else self.on_advance_start
        end = None if cls.on_advance_end is Loop.on_advance_end else self.on_advance_end
        return start, self.advance, end

    def iteration_shortcut(self) -> IterationHook | None:
        """One plain function that does what ``on_advance_start`` and then ``advance``
        do, or None (the default). Asked once per run, after :meth:`iteration_hooks`;
        an iteration calls it in their place while nobody subscribes to the loop's
        ``AdvanceStarted`` (otherwise the two hooks run, with the event between them).
        The training loop fetches its batch and runs its step so."""
        return None

    def iteration_boundary(self) -> Callable[[], None] | None:
        """What runs at every boundary between iterations (and before the first), right
        before :attr:`done` is read, or None (the default). Asked once per run, with
        :meth:`iteration_hooks`. The training loops run their stop control's check here,
        so that ``done`` only reads."""
        return None

    async def _iterate(self, ctx: Scope, leak_check: LeakCheck) -> list[Suspect]:
        """The iterations of a run. Without the leak check (the hot path) one iteration
        scope is reused, emptied after each iteration. With it, each hook labels the
        scope with its name first (so a leak names the hook that set the value), and each
        iteration's values are verified one iteration later (once the data source has
        moved on), the last ones by ``run``."""
        hooks = self.iteration_hooks()
        if leak_check is None:
            await self._iterations(ctx, hooks, None, None)
            return []
        checker = _IterationChecker(self.name, leak_check)
        names = ("on_advance_start", "advance", "on_advance_end")
        labelled = tuple(
            None if hook is None else _labelled(hook, name)
            for hook, name in zip(hooks, names, strict=True)
        )
        await self._iterations(ctx, labelled, checker.new_scope, checker)  # type: ignore[arg-type]
        return checker.suspects

    async def _iterations(
        self, ctx: Scope, hooks: _Hooks, make_scope: Any, checker: _IterationChecker | None
    ) -> None:
        """The iterations of a run. ``make_scope(ctx)`` makes each iteration's scope
        (None: one plain scope, reused). The bus is looked up at every iteration: a
        subscription made during one counts from the next (one made during the iteration
        still gets its ``AdvanceCompleted``)."""
        start, advance, end = hooks
        shortcut = self.iteration_shortcut() if checker is None else None  # (leak check: None)
        done = _getter(type(self), "done")  # read without a property lookup
        boundary = self.iteration_boundary()
        adv_started, adv_completed = self.events.advance_started, self.events.advance_completed
        table = self.bus.table.keep(adv_started, adv_completed)  # type: ignore[union-attr]
        deliver = self.bus.deliver  # type: ignore[union-attr]
        total, current = self.progress.total, self.progress.current
        reused = plain_scope(ctx) if make_scope is None else None
        clear = None if reused is None else reused.__dict__.clear
        with contextlib.suppress(StopLoop):
            if boundary is not None:
                boundary()
            while True:  # (not ``while not done``: see the module's docstring)
                if self.done if done is None else done(self):
                    break
                it = reused if reused is not None else make_scope(ctx)
                try:
                    total.ready += 1
                    current.ready += 1
                    if shortcut is not None and not table[adv_started]:
                        run = shortcut  # does what ``start`` and ``advance`` do
                    else:
                        if start is not None and (wait := start(it)) is not None:
                            await wait
                        if table[adv_started]:
                            event = self.make_event(adv_started, it, iteration=current.ready - 1)
                            await deliver(table[adv_started], event)
                        run = advance
                    total.started += 1
                    current.started += 1
                    if (wait := run(it)) is not None:
                        await wait
                    total.processed += 1
                    current.processed += 1
                    if end is not None and (wait := end(it)) is not None:
                        await wait
                    total.completed += 1
                    current.completed += 1
                    if table[adv_completed]:
                        event = self.make_event(adv_completed, it, iteration=current.ready - 1)
                        await deliver(table[adv_completed], event)
                except StopLoop:
                    _iteration_ended(it, checker)
                    break
                except BaseException:
                    it.__dict__.clear()
                    raise
                clear() if clear is not None else checker.iteration_done(it)  # type: ignore[union-attr]
                if self._restarting:
                    self.restarting = False
                if boundary is not None:  # (a profiler range while profiling_ranges is on)
                    boundary() if not RANGES.on else in_range("loopbus.boundary", boundary)

    # ------------------------------------------------------------ state
    def on_save_checkpoint(self) -> dict[str, Any]:
        """Extra state of this loop (beyond progress and sub-loops)."""
        return {}

    def on_load_checkpoint(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`on_save_checkpoint` returned."""

    def saved_inside_epoch(self, state: Mapping[str, Any]) -> bool:
        """Whether this loop's own saved ``state`` says it was taken inside an epoch."""
        return False

    def state_dict(self) -> dict[str, Any]:
        """Progress, extra state and every sub-loop's state, as plain Python values."""
        return {
            "progress": self.progress.state_dict(),
            "state": self.on_save_checkpoint(),
            "loops": {name: child.state_dict() for name, child in self.children.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the loop (and its sub-loops) will resume."""
        missing = {"progress", "state", "loops"} - set(state)
        if missing:
            raise KeyError(
                f"state of loop {self.name!r} lacks {sorted(missing)}; was it saved by "
                "Loop.state_dict()?"
            )
        children = self.children
        unknown = set(state["loops"]) - set(children)
        absent = set(children) - set(state["loops"])
        if unknown or absent:
            raise KeyError(
                f"state of loop {self.name!r} does not match its sub-loops: saved "
                f"{sorted(state['loops'])}, present {sorted(children)}."
            )
        self.progress.load_state_dict(state["progress"])
        self.on_load_checkpoint(state["state"])
        for name, child in children.items():
            child.load_state_dict(state["loops"][name])
        self._restarting = True

    def __repr__(self) -> str:
        kids = ", ".join(f"{k}={type(v).__name__}" for k, v in self.children.items())
        return f"{type(self).__name__}(name={self.name!r}{', ' + kids if kids else ''})"


def _getter(cls: type, name: str) -> Callable[[Any], Any] | None:
    """The getter of the property ``name`` of ``cls`` (None: a plain attribute)."""
    attr = inspect.getattr_static(cls, name, None)
    return attr.fget if type(attr) is property else None


def _iteration_ended(it: Scope, checker: _IterationChecker | None) -> None:
    """An iteration that ended (normally or by ``StopLoop``): its values are verified
    (the leak check), or its scope emptied for the next."""
    if checker is None:
        it.__dict__.clear()
    else:
        checker.iteration_done(it)


def _replacement(
    owner: str, name: str, old: Loop[Any], replacement: Loop[Any] | type[Loop[Any]]
) -> Loop[Any]:
    """The loop that replaces ``old`` (the sub-loop ``name`` of a loop of class ``owner``):
    ``replacement`` itself, or an instance of that class built from ``old``'s attributes
    named like its ``__init__`` parameters."""
    if isinstance(replacement, type):
        if not issubclass(replacement, Loop):
            raise TypeError(f"replace({name}=...) needs a Loop class, got {replacement!r}.")
        old_params = inspect.signature(type(old).__init__).parameters
        new_params = inspect.signature(replacement.__init__).parameters
        if list(old_params) != list(new_params):
            raise MisconfigurationError(
                f"{owner}.replace({name}={replacement.__name__}) needs "
                f"the same __init__ signature as {type(old).__name__}: "
                f"{list(old_params)[1:]} != {list(new_params)[1:]}. Pass an instance "
                "instead."
            )
        kwargs = {p: getattr(old, p) for p in old_params if p != "self"}
        return replacement(**kwargs)
    if isinstance(replacement, Loop):
        return replacement
    raise TypeError(f"replace({name}=...) needs a Loop class or instance, got {replacement!r}.")
