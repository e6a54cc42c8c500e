"""The dashboard's hub: records batched into one message per flush, in columns per name,
markers, state, history, on both anyio backends where it waits."""

from __future__ import annotations

import math
from typing import Any

import anyio
import msgspec
import pytest

from loopbus import MisconfigurationError
from loopbus.dashboard import Hub


def _messages(hub: Hub, start: int = 0) -> list[dict[str, Any]]:
    _, messages = hub.read(start)
    return [msgspec.json.decode(m) for m in messages]


def test_a_flush_is_one_message_with_columns_per_run_and_name() -> None:
    hub = Hub()
    a = hub.add_run("a", "tcp://127.0.0.1:1")
    b = hub.add_run("b", "tcp://127.0.0.1:2")
    for step in range(3):
        a.record("train/loss", 1.0 / (step + 1), step, 0)
        a.record("train/acc", step % 2 == 0, step, 0)
    b.record("val/loss", math.nan, 7, 1)
    b.record("val/loss", math.inf, 8, 1)
    b.record("val/n", 2**60, 9, 1)
    assert hub.flush() == 9
    assert hub.flush() == 0  # nothing new: no message
    [message] = _messages(hub)
    assert message == {
        "id": 0,
        "parts": [
            {
                "run": 0,
                "records": {
                    "train/loss": [[0, 1, 2], [1.0, 0.5, 1.0 / 3]],
                    "train/acc": [[0, 1, 2], [1, 0, 1]],  # booleans as 0/1
                },
                "markers": [],
            },
            # NaN and infinities break the line (null); big integers stay integers.
            {
                "run": 1,
                "records": {"val/loss": [[7, 8], [None, None]], "val/n": [[9], [2**60]]},
                "markers": [],
            },
        ],
    }
    assert (a.records, a.step, b.records, b.step, b.epoch) == (6, 2, 3, 9, 1)


def test_markers_and_state_reach_the_status() -> None:
    hub = Hub()
    run = hub.add_run("job", "unix:///tmp/x.sock")
    version = hub.status_version
    run.started("fit", 0, 0)
    run.record("train/loss", 0.5, 10, 0)
    run.epoch_ended(0, 10)
    run.gap(25)
    run.stage_ended("fit", "completed", 10)
    assert hub.status_version > version
    hub.flush()
    [message] = _messages(hub)
    assert message["parts"] == [
        {
            "run": 0,
            "records": {"train/loss": [[10], [0.5]]},
            "markers": [
                {"kind": "epoch", "step": 10, "label": "epoch 0"},
                {"kind": "gap", "step": 10, "label": "25 dropped"},
                {"kind": "stage", "step": 10, "label": "fit completed"},
            ],
        }
    ]
    [info] = msgspec.json.decode(hub.status())["runs"]
    assert info == {
        "run": 0,
        "label": "job",
        "address": "unix:///tmp/x.sock",
        "state": "between stages",
        "detail": "fit completed",
        "stage": "fit",
        "step": 10,
        "epoch": 0,
        "records": 1,
        "gaps": 25,
    }
    with pytest.raises(ValueError, match="a run's state is one of"):
        run.set_state("sleeping")


def test_a_restarted_run_gets_a_series_of_its_own() -> None:
    hub = Hub()
    first = hub.add_run("job", "tcp://127.0.0.1:9")
    first.record("train/loss", 0.1, 100, 3)
    second = first.successor()
    third = second.successor()
    assert [r.label for r in hub.runs] == ["job", "job (2)", "job (3)"]
    assert (first.state, second.state, third.index) == ("ended", "ended", 2)


def test_history_forgets_the_oldest_messages() -> None:
    hub = Hub(history=10)
    run = hub.add_run("job")
    for i in range(5):
        for step in range(4):
            run.record("x", float(step), i * 4 + step, 0)
        hub.flush()
    # 20 records put in messages of 4; at most 10 kept: the last 2 messages.
    assert hub.first == 3
    assert hub.next_id == 5
    first, messages = hub.read(0)
    assert first == 3
    assert [m["id"] for m in _messages(hub)] == [3, 4]
    assert hub.read(4)[1] == messages[1:]
    assert hub.read(5) == (5, [])


def test_bad_options_are_refused() -> None:
    with pytest.raises(MisconfigurationError, match=r"Dashboard\(interval=\.\.\.\) must be"):
        Hub(interval=0)
    with pytest.raises(MisconfigurationError, match=r"Dashboard\(history=\.\.\.\) must be an int"):
        Hub(history=0)


async def test_waiters_wake_on_each_message_and_the_flusher_batches() -> None:
    hub = Hub(interval=0.05)
    run = hub.add_run("job")
    woke: list[int] = []

    async def waiter() -> None:
        await hub.wait()
        woke.append(hub.next_id)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(hub.run)
        for step in range(100):  # within one interval: one message
            run.record("train/loss", 0.5, step, 0)
        with anyio.fail_after(5):
            while hub.next_id < 1:  # noqa: ASYNC110 - the flusher's tick, no event
                await anyio.sleep(0.01)
        tg.cancel_scope.cancel()
    assert woke == [1]
    [message] = _messages(hub)
    assert message["parts"][0]["records"]["train/loss"][0] == list(range(100))
