"""The parts of a stage's life that are not the loops: how it ends (closing events, the
queues drained, plugins stopped), how its failure is named, and ``fit``'s sanity check.
Functions of their inputs; the trainer calls them."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import anyio
from anyio.abc import TaskGroup

from loopbus.checkpoint._load import read_for_resume
from loopbus.checkpoint._parts import CheckpointMismatch
from loopbus.checkpoint._rng_state import RngSnapshot
from loopbus.distributed._strategy import Strategy
from loopbus.loop._loop import Loop
from loopbus.loop._loops import SanityCheckLoop
from loopbus.records._recorder import Recorder
from loopbus.step._module import Module

from ..events import EventBus, ExceptionRaised, Subscription, Teardown
from ._assembly import StageParts, active_plugins
from ._plugin import Plugin
from ._saving import checkpoint_writers, resolve_resume_path

__all__ = [
    "classify",
    "collapse",
    "finish_stage",
    "prepared_fit",
    "resume_from",
    "running_stage",
    "sanity_check",
    "subscribed",
]


@contextmanager
def subscribed(
    trainer: Any,
    stage: str,
    plugins: Iterable[Plugin],
    module: Module,
    *,
    bus: EventBus,
    recorder: Recorder,
) -> Iterator[None]:
    """The stage's subscribers for its duration: each plugin bound to the recorder, set
    up (``setup(trainer, stage)``) and subscribed in order, then the module's handlers;
    at the end every subscription is cancelled and the plugins that were set up are torn
    down in reverse order (those set up before a failing ``setup`` too)."""
    subscriptions: list[Subscription] = []
    set_up: list[Plugin] = []
    try:
        for plugin in plugins:
            plugin.bind_recorder(recorder, type(plugin).__name__)
            plugin.setup(trainer, stage)
            set_up.append(plugin)
            subscriptions += bus.subscribe_methods(
                plugin, owner=type(plugin).__name__, **plugin.subscription_defaults()
            )
        subscriptions += bus.subscribe_methods(module, owner=type(module).__name__)
        yield
    finally:
        for sub in subscriptions:
            sub.unsubscribe()
        for plugin in reversed(set_up):
            plugin.teardown(trainer, stage)
            plugin.bind_recorder(None)


def collapse(group: BaseExceptionGroup[Any]) -> BaseException | None:
    """The one meaningful exception in a task group's group, if there is exactly one."""
    cancelled = anyio.get_cancelled_exc_class()
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for sub in exc.exceptions:
                walk(sub)
        else:
            leaves.append(exc)

    walk(group)
    meaningful = [e for e in leaves if not isinstance(e, cancelled)]
    if len(meaningful) == 1:
        return meaningful[0]
    if not meaningful and leaves:
        return leaves[0]
    return None


def classify(exc: BaseException, bus: EventBus) -> tuple[str, BaseException | None]:
    """How a stage that raised ``exc`` ended: ``("cancelled", None)``, or ``("failed",
    error)`` (a handler's failure that cancelled the stage is the error)."""
    if isinstance(exc, anyio.get_cancelled_exc_class()):
        if bus.failure is not None:
            return "failed", bus.failure
        return "cancelled", None
    return "failed", exc


async def finish_stage(
    parts: StageParts,
    reason: str,
    failure: BaseException | None,
    stop_plugins: Iterable[Callable[[], Awaitable[None]]],
) -> None:
    """Fire the closing events, drain the queues, stop the plugins (``stop_plugins``,
    in order) and tear the loops down. A completed or stopped stage delivers what is
    pending and waits for every queued subscriber; a failed or cancelled one drops what
    is pending and waits at most the ``drain_timeout_s`` option."""
    stage, bus, recorder, state = parts.stage, parts.bus, parts.recorder, parts.state
    assert stage is not None
    errors: list[BaseException] = []
    ended_well = reason in ("completed", "stopped")

    async def attempt(step: Callable[[], Awaitable[Any]]) -> None:
        try:
            await step()
        except Exception as exc:
            errors.append(exc)

    async def settle_records() -> None:
        if ended_well:
            await attempt(recorder.flush)
        else:
            recorder.discard_pending()

    if failure is not None:
        await attempt(lambda: bus.publish(ExceptionRaised(stage=stage, error=failure)))
    await settle_records()
    teardown = Teardown(stage=stage, reason=reason, step=state.step, epoch=state.epoch)
    await attempt(lambda: bus.publish(teardown))
    await settle_records()  # what Teardown's handlers put or published
    await bus.drain(None if ended_well else parts.options.responsiveness.drain_timeout_s)
    late = bus.failure
    if failure is None and late is not None:
        # A queued handler failed while its queue drained: tell the inline handlers.
        await attempt(lambda: bus.publish(ExceptionRaised(stage=stage, error=late)))
    for stop in stop_plugins:
        await attempt(stop)
    for loop in parts.loops.values():
        loop.teardown_tree()
    if errors:
        # Every error is reported: the first raised (unless the stage failed already),
        # each other one in a note on it.
        first = failure if failure is not None else errors[0]
        for err in errors:
            if err is not first:
                first.add_note(f"while tearing down, also: {type(err).__name__}: {err}")
        if failure is None:
            raise first


@asynccontextmanager
async def running_stage(
    parts: StageParts,
    start: Callable[[Plugin, TaskGroup], Awaitable[None]],
    stop: Callable[[Plugin], Awaitable[None]],
) -> AsyncIterator[None]:
    """A stage's task group: the bus's queued subscribers and the active plugins'
    services (``start(plugin, task_group)``, in order) run in it while the stage does;
    however it ends, :func:`finish_stage` runs, shielded, with the plugins that started
    stopped in reverse order. A task group's group of one error is raised as that error.
    The preemption signals are handled while it runs (see :class:`Preemption`); a stage
    that ended well after one raises :class:`~loopbus.Preempted`."""
    with parts.preemption.handling(parts.active):
        async with _task_group(parts, start, stop):
            yield
    parts.preemption.check()


@asynccontextmanager
async def _task_group(
    parts: StageParts,
    start: Callable[[Plugin, TaskGroup], Awaitable[None]],
    stop: Callable[[Plugin], Awaitable[None]],
) -> AsyncIterator[None]:
    bus = parts.bus
    try:
        async with anyio.create_task_group() as tg:
            bus.start(tg)
            started: list[Plugin] = []
            reason, failure = "completed", None
            try:
                for plugin in parts.active:
                    await start(plugin, tg)
                    started.append(plugin)
                yield
                reason = "stopped" if parts.state.stop_requested else "completed"
            except BaseException as exc:
                reason, failure = classify(exc, bus)
                raise
            finally:
                with anyio.CancelScope(shield=True):
                    stops = [_bound(stop, p) for p in reversed(started)]
                    await finish_stage(parts, reason, failure, stops)
    except BaseExceptionGroup as group:
        single = collapse(group)
        if single is None:
            raise
        raise single from single.__cause__


def _bound(stop: Callable[[Plugin], Awaitable[None]], plugin: Plugin) -> Callable[[], Any]:
    return lambda: stop(plugin)


async def sanity_check(
    parts: StageParts,
    val_data: Any,
    resuming: bool,
    attach: Callable[[Loop[Any], EventBus], None],
) -> None:
    """Run ``options.num_sanity_val_steps`` validation batches (-1: all) before training,
    unless turned off, validation is (``limit_val_batches=0``), or the run resumes
    mid-epoch (``resuming``): unseen by the plugins (a bus of its own, with only the
    module's handlers), unrecorded (records dropped), and leaving the random generators
    as they were. ``attach(loop, bus)`` connects the loop to the trainer and the stage."""
    options, module, recorder, state = parts.options, parts.module, parts.recorder, parts.state
    steps = options.num_sanity_val_steps
    if not steps or options.limit_val_batches == 0 or resuming:
        return
    leak_check, drain_timeout = options.leak_check, options.drain_timeout_s
    await recorder.flush_pending()  # what was put before belongs to the run
    loop = SanityCheckLoop(math.inf if steps == -1 else steps)
    bus = EventBus()
    attach(loop, bus)
    loop.attach(leak_check=leak_check)
    subscriptions = bus.subscribe_methods(module, owner=type(module).__name__)
    rng = RngSnapshot()
    state.begin_sanity_check()
    try:
        async with bus.running(drain_timeout):
            await loop.run(val_data)
    except BaseException as exc:
        grouped = isinstance(exc, BaseExceptionGroup)
        error = collapse(exc) if isinstance(exc, BaseExceptionGroup) else exc
        if not isinstance(error, Exception):
            raise  # cancelled, or several failures
        error.add_note(
            f"raised during fit's sanity check (num_sanity_val_steps={steps}), before "
            "the first training step: validation_step or a validation handler fails."
        )
        if grouped:
            raise error from error.__cause__
        raise
    finally:
        state.end_sanity_check()
        for sub in subscriptions:
            sub.unsubscribe()
        loop.teardown_tree()
        recorder.discard_pending()
        rng.restore()


async def prepared_fit(
    trainer: Any, module: Module, train_data: Any, check: Callable[[Any, str], None]
) -> Any:
    """``fit``'s training data after the active plugins that override
    :meth:`Plugin.prepare_fit` (a batch-size finder) had their turn, in order, before
    the stage starts; each result checked with ``check``."""
    for plugin in active_plugins(trainer.plugins, trainer.options, trainer.strategy):
        if type(plugin).prepare_fit is not Plugin.prepare_fit:
            train_data = await plugin.prepare_fit(trainer, module, train_data)
            check(train_data, f"{type(plugin).__name__}.prepare_fit's train_data")
    return train_data


def default_resume(strategy: Strategy, plugins: list[Plugin]) -> str | None:
    """What ``fit`` without a ``ckpt_path`` resumes from: the strategy's choice (``"last"``
    for a fault-tolerant replica group that rejoins a run) when a plugin writes
    checkpoints to find it among; None (start afresh) otherwise."""
    path = strategy.resume_path()
    return path if path is not None and checkpoint_writers(plugins) else None


async def resume_from(
    ckpt_path: str | os.PathLike[str],
    strict: bool,
    plugins: list[Plugin],
    strategy: Strategy,
    parts: Mapping[str, Any],
    load: Callable[..., CheckpointMismatch],
) -> None:
    """``fit(..., ckpt_path=...)``: find the checkpoint (``"last"``: the plugins' newest;
    names resolved on rank 0 and broadcast), read it into ``parts`` (a file in a worker
    thread; a sharded checkpoint by every rank) and ``load(mismatch, plan)`` the result;
    warn about what did not match under ``strict=False``."""
    path = resolve_resume_path(ckpt_path, plugins, strategy)
    if path is None:
        return
    # A sharded checkpoint is read by every rank (DCP reshards); a file in a thread.
    mismatch = load(*await read_for_resume(parts, path, strategy.world_size, strict))
    if mismatch:
        warnings.warn(
            f"resumed from {path} with ckpt_strict=False; what did not match kept its "
            f"current state:\n{mismatch}",
            UserWarning,
            stacklevel=3,
        )
