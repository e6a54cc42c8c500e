from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from loopbus import Plugin, Scope, ScopeLeakError, Trainer, on
from loopbus.events import TrainBatchCompleted, TrainBatchStarted, TrainEpochStarted
from loopbus.state._scope import TrackedScope, drop_scope, new_scope
from tests.helpers import TinyModule, make_loader


# ---------------------------------------------------------------- Scope itself
def test_lookup_falls_back_to_enclosing_scopes() -> None:
    run = new_scope(None, tracked=False)
    it = new_scope(run, tracked=False)
    run.data = "run-level"
    it.batch = "it-level"
    assert it.data == "run-level"
    assert it.get("missing", 3) == 3
    assert "data" in it
    assert "batch" in it
    assert "nope" not in it
    assert it.parent is run
    with pytest.raises(AttributeError, match=r"ctx has no value 'nope'.*ctx.promote\('nope'\)"):
        _ = it.nope


def test_promote_and_detach() -> None:
    run = new_scope(None, tracked=True, loop="demo")
    it = new_scope(run, tracked=True, loop="demo")
    it.keep = [1]
    it.give = [2]
    it.promote("keep")
    given = it.detach("give")
    drop_scope(it, "raise")
    assert run.keep == [1]
    assert given == [2]
    with pytest.raises(KeyError, match=r"cannot detach 'x': it is not set"):
        it.detach("x")
    with pytest.raises(ValueError, match=r"outermost scope"):
        run.promote("keep")


def test_tracked_scope_refuses_method_names() -> None:
    ctx = new_scope(None, tracked=True)
    with pytest.raises(AttributeError, match=r"ctx.promote is a Scope method"):
        ctx.promote = 1  # type: ignore[method-assign]


def test_leak_check_names_value_loop_hook_and_holder() -> None:
    class Holder:
        def __init__(self) -> None:
            self.kept: list[Any] = []

    holder = Holder()
    ctx = new_scope(None, tracked=True, loop="train")
    assert isinstance(ctx, TrackedScope)
    ctx.enter_hook("advance")
    ctx.output = torch.ones(3)
    holder.kept.append(ctx.output)
    with pytest.raises(
        ScopeLeakError,
        match=r"ctx.output \(Tensor of shape \(3,\)\), set by loop 'train' in advance, is still "
        r"alive.*held by Holder.kept \(through 1 container\(s\)\)",
    ):
        drop_scope(ctx, "raise")


def test_leak_check_warn_mode_and_containers() -> None:
    keep: list[Any] = []
    ctx = new_scope(None, tracked=True, loop="custom")
    x, y = torch.zeros(2), torch.zeros(1)
    ctx.batch = (x, y)
    keep.append(x)
    del x, y
    with pytest.warns(ResourceWarning, match=r"ctx.batch\[0\]"):
        drop_scope(ctx, "warn")


def test_borrowed_values_are_not_checked() -> None:
    owner = [torch.zeros(2)]
    ctx = new_scope(None, tracked=True)
    ctx.borrow("weights", owner[0])
    drop_scope(ctx, "raise")  # no error: the scope does not own it
    assert ctx.names() == []


# ---------------------------------------------------------------- through the trainer
class Watcher(Plugin):
    """Takes weak references to what the scopes of a run held."""

    def __init__(self) -> None:
        self.refs: list[weakref.ref[Any]] = []

    @on(TrainEpochStarted)
    def epoch(self, event: TrainEpochStarted) -> None:
        self.refs.append(weakref.ref(event.ctx.source))
        self.refs.append(weakref.ref(event.ctx.source.iterator))

    @on(TrainBatchStarted)
    def batch(self, event: TrainBatchStarted) -> None:
        x, y = event.ctx.batch
        self.refs += [weakref.ref(x), weakref.ref(y)]

    @on(TrainBatchCompleted)
    def output(self, event: TrainBatchCompleted) -> None:
        self.refs.append(weakref.ref(event.ctx.output))


async def test_batch_outputs_and_iterator_are_garbage_after_fit() -> None:
    watcher = Watcher()
    trainer = Trainer(max_epochs=2, plugins=[watcher], leak_check="raise")
    await trainer.fit(TinyModule(), make_loader(), make_loader(n=32))
    assert len(watcher.refs) == 2 * 2 + 2 * 4 * 3
    alive = [r() for r in watcher.refs if r() is not None]
    assert alive == [], f"still alive after fit: {[type(a).__name__ for a in alive]}"


class Hoarder(Plugin):
    def __init__(self) -> None:
        self.kept: list[Any] = []

    @on(TrainBatchStarted)
    def keep(self, event: TrainBatchStarted) -> None:
        self.kept.append(event.ctx.batch)


async def test_planted_leak_is_reported_with_the_value_name() -> None:
    trainer = Trainer(max_epochs=1, plugins=[Hoarder()], leak_check="raise")
    with pytest.raises(
        ScopeLeakError,
        match=r"ctx.batch\[0\] \(Tensor of shape \(16, 4\)\), set by loop 'train' in "
        r"on_advance_start, is still alive.*held by .*Hoarder.kept",
    ):
        await trainer.fit(TinyModule(), make_loader())


class KeepsEverything(TinyModule):
    def training_step(self, batch: Any, ctx: Scope) -> torch.Tensor:
        x, y = batch
        ctx.logits = self(x)
        ctx.loss = torch.nn.functional.cross_entropy(ctx.logits, y)
        ctx.extra = {"probs": ctx.logits.softmax(-1), "grad_view": ctx.loss * 1}
        self.put("train/loss", ctx.loss)
        return ctx.loss  # type: ignore[no-any-return]


def fresh_batches(n: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        x = torch.randn(8, 4, generator=g)
        yield x, (x[:, 0] > 0).long()


class TensorCounter(Plugin):
    def __init__(self) -> None:
        self.counts: list[int] = []

    @on(TrainBatchStarted, when=lambda e: e.batch_idx % 200 == 0)
    def count(self, event: TrainBatchStarted) -> None:
        gc.collect()
        self.counts.append(sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor)))


@pytest.mark.parametrize("leak_check", [None, "raise"])
async def test_live_tensors_do_not_grow_over_2000_iterations(leak_check: Any) -> None:
    counter = TensorCounter()
    trainer = Trainer(max_epochs=1, plugins=[counter], leak_check=leak_check)
    await trainer.fit(KeepsEverything(), fresh_batches(2000))
    assert trainer.global_step == 2000
    assert len(counter.counts) == 10
    # The first count is taken before any step: optimizer state appears after it.
    steady = counter.counts[1:]
    assert max(steady) == min(steady), counter.counts
