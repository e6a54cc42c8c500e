"""The one iteration path: the training loop's hooks are composed once per run (a hook
with nothing to do in the run is left out) and ``TrainBatchStarted`` is built and
delivered only while someone subscribes; without the leak check one iteration scope
serves the run. A run trains bit for bit the same with and without a subscriber and with
the leak check, and subscriptions made mid-run take effect at once."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loopbus import PutRecord, Trainer
from loopbus.events import LoopEvent, TrainBatchCompleted, TrainBatchStarted, ValidationCompleted
from loopbus.loop._loops import TrainEpochLoop
from loopbus.state._scope import Scope
from tests.helpers import TinyModule, load_benchmark, make_loader


@pytest.fixture
def started_built(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The batches whose ``TrainBatchStarted`` was built (only while someone subscribes)."""
    built: list[int] = []
    real = TrainEpochLoop.make_event

    def counted(
        self: TrainEpochLoop, event_type: type[LoopEvent], ctx: Scope | None, **fields: Any
    ) -> Any:
        if event_type is TrainBatchStarted:
            built.append(self.progress.current.ready - 1)
        return real(self, event_type, ctx, **fields)

    monkeypatch.setattr(TrainEpochLoop, "make_event", counted)
    return built


Record = tuple[str, int, int, float]


async def _fit(
    *, evented: bool, leak_check: Any = None, **options: Any
) -> tuple[dict[str, torch.Tensor], list[Record], list[int]]:
    torch.manual_seed(0)
    module = TinyModule()
    trainer = Trainer(
        max_epochs=2, plugins=[], device="cpu", leak_check=leak_check, **options
    )
    records: list[Record] = []
    validations: list[int] = []
    trainer.subscribe(
        PutRecord,
        lambda r: records.append((r.name, r.step, r.epoch, float(r.value))),
        destination="loggers",
    )
    trainer.subscribe(ValidationCompleted, lambda e: validations.append(e.step))
    if evented:
        trainer.subscribe(TrainBatchStarted, lambda e: None)
    # 70 samples in batches of 16: a short last batch.
    await trainer.fit(module, make_loader(70, 16), make_loader(32, 8, seed=1))
    return module.state_dict(), records, validations


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({}, id="plain"),
        pytest.param({"val_check_interval": 2}, id="val-every-2"),
        pytest.param({"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}, id="accumulate"),
    ],
)
async def test_a_run_trains_bit_identically_with_or_without_subscribers(
    options: dict[str, Any], started_built: list[int]
) -> None:
    fused_weights, fused_records, fused_vals = await _fit(evented=False, **options)
    assert started_built == []  # nobody subscribes: no TrainBatchStarted is built
    weights, records, vals = await _fit(evented=True, **options)
    assert started_built == [0, 1, 2, 3, 4] * 2  # every batch of both epochs
    started_built.clear()
    tracked_weights, tracked_records, tracked_vals = await _fit(
        evented=False, leak_check="raise", **options
    )
    assert started_built == []  # the leak check labels the hooks and scopes, nothing more
    assert fused_records == records == tracked_records
    assert fused_vals == vals == tracked_vals
    assert len(fused_records) > 10
    for name, value in weights.items():
        assert torch.equal(fused_weights[name], value), name
        assert torch.equal(tracked_weights[name], value), name


async def test_a_subscriber_added_mid_run_receives_every_following_event(
    started_built: list[int],
) -> None:
    trainer = Trainer(max_epochs=1, plugins=[], device="cpu", leak_check=None)
    started: list[int] = []
    completed: list[int] = []
    handles: list[Any] = []

    def on_record(record: PutRecord) -> None:
        # Put by the step of batch 2 (the third step), delivered at its boundary.
        if record.step == 3 and not handles:
            handles.append(trainer.subscribe(TrainBatchStarted, lambda e: started.append(e.batch_idx)))
            handles.append(trainer.subscribe(TrainBatchCompleted, lambda e: completed.append(e.batch_idx)))
        if record.step == 6:
            handles[0].unsubscribe()  # nobody watches batches start again

    trainer.subscribe(PutRecord, on_record)
    await trainer.fit(TinyModule(), make_loader(128, 16))
    # Subscribed during batch 2: its completion and everything after it arrive.
    assert completed == [2, 3, 4, 5, 6, 7]
    assert started == [3, 4, 5]
    # Built only while subscribed.
    assert started_built == [3, 4, 5]


async def test_one_iteration_scope_serves_the_run_and_is_emptied_after_each_batch() -> None:
    trainer = Trainer(max_steps=4, plugins=[], device="cpu", leak_check=None)
    scopes: list[Scope] = []
    seen: list[list[str]] = []

    def on_completed(event: TrainBatchCompleted) -> None:
        scopes.append(event.ctx)
        seen.append(sorted(event.ctx.names()))

    trainer.subscribe(TrainBatchCompleted, on_completed)
    await trainer.fit(TinyModule(), make_loader(64, 16))
    assert len(scopes) == 4
    assert all(scope is scopes[0] for scope in scopes)
    assert seen == [["batch", "batch_idx", "output"]] * 4
    assert scopes[0].names() == []  # emptied when the iteration ended
    scopes.clear()


async def test_a_subclass_that_overrides_an_iteration_hook_has_it_run() -> None:
    calls: list[str] = []

    class Logged(TrainEpochLoop):
        async def on_advance_start(self, ctx: Scope) -> None:
            await super().on_advance_start(ctx)
            calls.append("start")

        async def on_advance_end(self, ctx: Scope) -> None:
            # Not left out although no validation runs inside the epoch: it is not
            # TrainEpochLoop's own.
            await super().on_advance_end(ctx)
            calls.append("end")

    trainer = Trainer(max_steps=3, plugins=[], device="cpu", leak_check=None)
    trainer.fit_loop.replace(epoch_loop=Logged)
    await trainer.fit(TinyModule(), make_loader(64, 16))
    assert calls == ["start", "end"] * 3


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_engine_adds_at_most_18_python_calls_a_step(backend: str) -> None:
    # The deterministic figure benchmarks/overhead.py prints: profile events per step
    # over the hand-written loop, put every step, no plugins (17 when this was written).
    calls = load_benchmark("overhead").extra_calls_per_step(backend, subscribers=False, n=100)
    assert calls <= 18
