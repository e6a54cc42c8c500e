"""The recorder routes each flush with the subscriptions of that moment: records go one
way, to the subscribers their destinations name, and those nobody listens to are kept,
unread, as the latest of their name."""

from __future__ import annotations

from loopbus.events import PutRecord
from loopbus.records._entries import PendingPut
from loopbus.records._recorder import Recorder
from loopbus.state._runstate import RunState


def put(recorder: Recorder, name: str, value: float, *destinations: str) -> None:
    recorder.enqueue(PendingPut(name, value, destinations or ("callbacks",), "test"))


async def test_routes_follow_the_subscriptions_from_one_flush_to_the_next() -> None:
    recorder = Recorder(RunState())
    put(recorder, "a", 1.0)
    await recorder.flush()  # nobody listens: kept unread
    assert recorder.stage_records()["a"].value == 1.0

    got: list[PutRecord] = []
    sub = recorder.bus.subscribe(PutRecord, got.append)
    put(recorder, "a", 2.0)
    await recorder.flush()
    assert [record.value for record in got] == [2.0]

    sub.unsubscribe()
    put(recorder, "a", 3.0)
    await recorder.flush()
    assert [record.value for record in got] == [2.0]
    assert recorder.stage_records()["a"].value == 3.0


async def test_a_record_that_follows_one_of_its_name_to_nobody_is_the_latest() -> None:
    recorder = Recorder(RunState())
    callbacks: list[PutRecord] = []
    loggers: list[PutRecord] = []
    recorder.bus.subscribe(PutRecord, callbacks.append)
    recorder.bus.subscribe(PutRecord, loggers.append, destination="loggers")
    put(recorder, "a", 1.0, "callbacks")
    put(recorder, "a", 2.0, "external")  # nobody plays "external"
    put(recorder, "b", 3.0, "external")
    put(recorder, "c", 4.0, "callbacks", "loggers")
    await recorder.flush()
    assert [(r.name, r.value) for r in callbacks] == [("a", 1.0), ("c", 4.0)]
    assert [(r.name, r.value) for r in loggers] == [("c", 4.0)]
    latest = recorder.stage_records()
    assert {name: record.value for name, record in latest.items()} == {"a": 2.0, "b": 3.0, "c": 4.0}
    # Each record reached every subscriber as the same object, kept as the latest.
    assert callbacks[1] is loggers[0] is latest["c"]
