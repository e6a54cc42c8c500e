"""Golden transcripts of the stream protocol: one file per version, ``golden/v<N>.json``.

Each transcript is one connection to a real server (``loopbus.stream.Server``, over TCP):
the frames the client sent (the bytes ``docs/protocol.md`` shows) and every frame the
server answered, as bytes and decoded. The server is driven by a small scripted run
(:data:`RUN`: a ``fit`` stage, then a ``validate`` stage) so that every byte is
deterministic; only ``Welcome.time`` (the server's clock) and ``Welcome.server`` (the
package version) are set to fixed values before comparing (:data:`VOLATILE`).

Two checks per version (docs/protocol.md, "What may change within a version"):

* the server keeps the promises the file records: the same messages in the same order,
  every recorded key with its recorded value, items exactly as recorded. A failure here
  breaks the version: make the change a new protocol version instead.
* the bytes are the recorded ones. A failure here alone (keys added) is a change a
  version allows: regenerate the files with ``python -m tests.stream.test_golden`` and
  let the diff show only additions.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from loopbus import PutRecord
from loopbus.stream import EpochEnded, Server, StageEnded, StageStarted
from loopbus.stream._wire import PROTOCOL_VERSIONS
from tests.helpers import ROOT
from tests.stream.raw_client import RawClient, accounting, encode_frame, is_type

GOLDEN = Path(__file__).resolve().parent / "golden"
PROTOCOL_DOC = ROOT / "docs" / "protocol.md"

#: Server options of the scripted run: a small per-client queue, so that the run's
#: second hand-over overflows it (a Gap), and no pause between hand-overs.
OPTIONS: dict[str, Any] = {"client_buffer": 6, "flush_interval": 0.0}
#: What is not the protocol's to fix: the server's clock and its package version.
VOLATILE: dict[str, Any] = {"time": 0.0, "server": "loopbus"}
T = 1_700_000_000.0

#: The client frames, by the heading docs/protocol.md shows them under (None: not shown).
CLIENT: dict[str, tuple[str | None, bytes]] = {
    "hello 1": ("Hello {version: 1}", encode_frame({"type": "Hello", "version": 1})),
    "hello 2": ("Hello {version: 2}", encode_frame({"type": "Hello", "version": 2})),
    # A version no server speaks (0: a future version would not turn this into a Welcome).
    "hello 0": (None, encode_frame({"type": "Hello", "version": 0})),
    "subscribe train": (
        'Subscribe {names: ["train/*"], topics: ["records"]}',
        encode_frame({"type": "Subscribe", "names": ["train/*"], "topics": ["records"]}),
    ),
    "subscribe all": (
        'Subscribe {names: ["*"], topics: ["records", "events"]}',
        encode_frame({"type": "Subscribe", "names": ["*"], "topics": ["records", "events"]}),
    ),
    "bye": ('Bye {code: "end"}', encode_frame({"type": "Bye", "code": "end"})),
}
#: The server frame docs/protocol.md shows (the first Batch of the "records" transcripts).
DOCUMENTED_BATCH = (
    'Batch {seq: 0, items: [["R", "train/loss", 0.5, 1, 0, 1700000000.0, "MyModule"]]}'
)


def _record(name: str, value: float | int, step: int, at: float) -> PutRecord:
    return PutRecord(name=name, value=value, step=step, epoch=0, time=T + at, source="MyModule")


#: The scripted run: what the server is handed at each point, each part at once.
RUN: dict[str, list[Any]] = {
    "fit begins": [
        StageStarted(stage="fit", step=0, epoch=0, time=T),
        _record("train/loss", 0.5, 1, 0.0),
    ],
    "fit goes on and ends": [
        *(_record("train/loss", 0.5**step, step, float(step)) for step in range(2, 10)),
        _record("val/loss", 0.75, 9, 9.5),
        EpochEnded(epoch=0, step=9, time=T + 10),
        StageEnded(stage="fit", reason="completed", step=9, epoch=0, time=T + 10),
    ],
    "validate": [
        StageStarted(stage="validate", step=9, epoch=0, time=T + 20),
        _record("val/loss", 0.625, 9, 21.0),
        _record("val/acc", 1, 9, 21.0),
        StageEnded(stage="validate", reason="completed", step=9, epoch=0, time=T + 22),
    ],
}

#: The parts of the run each transcript's connection is served, by version and name.
SERVED: dict[int, dict[str, tuple[str, ...]]] = {
    1: {
        "records": ("fit begins", "fit goes on and ends"),
        "records and events": ("fit begins", "fit goes on and ends"),
        "the next stage": ("validate",),
    },
    2: {
        "records": tuple(RUN),
        "records and events": tuple(RUN),
    },
}

#: The transcripts of each version: name -> (client frames, when the client connects).
TRANSCRIPTS: dict[int, dict[str, tuple[tuple[str, ...], str]]] = {
    1: {
        "handshake": (("hello 1", "bye"), "before the run; the client leaves at once"),
        "records": (("hello 1", "subscribe train"), "before the run"),
        "records and events": (("hello 1", "subscribe all"), "before the run"),
        "the next stage": (("hello 1", "subscribe all"), "between fit and validate"),
        "another version": (("hello 0",), "before the run"),
    },
    2: {
        "handshake": (("hello 2", "bye"), "before the run; the client leaves at once"),
        "records": (("hello 2", "subscribe train"), "before the run"),
        "records and events": (("hello 2", "subscribe all"), "before the run"),
        "another version": (("hello 0",), "before the run"),
    },
}

_ABOUT = (
    "Golden transcripts of protocol version {v} (docs/protocol.md). Each is one "
    "connection to loopbus.stream.Server({options}) over TCP: the client's frames, then "
    "every frame the server sent until it closed the connection. 'run' is what the server "
    "was handed, part by part. Welcome.time and Welcome.server are set to the values of "
    "'volatile'. Within a version these bytes may change only as docs/protocol.md, 'What "
    "may change within a version', allows; tests/stream/test_golden.py checks it."
)


def _payload(client: tuple[str, ...]) -> bytes:
    return b"".join(CLIENT[name][1] for name in client)


def _ends_stage(stage: str) -> Any:
    def done(message: Any) -> bool:
        return message["type"] == "Batch" and any(
            item[:2] == ["StageEnded", stage] for item in message["items"]
        )

    return done


async def _ended_with_the_stage(client: RawClient, name: str, stage: str) -> None:
    try:
        await client.read_to_end(within=10.0)
    except AssertionError as exc:
        raise AssertionError(
            f"version 1, {name!r}: the end of the {stage} stage did not end the connection "
            f"(a version-1 client would wait for its Bye forever): {exc}"
        ) from None


async def _record_run() -> dict[tuple[int, str], list[bytes]]:
    """Drive a server through :data:`RUN` with the clients of :data:`TRANSCRIPTS`; return
    the frames each connection received."""
    out: dict[tuple[int, str], list[bytes]] = {}

    def publish(part: str) -> None:
        for item in RUN[part]:
            if isinstance(item, PutRecord):
                server.publish_record(item)
            else:
                server.publish_event(item)

    async with Server(**OPTIONS) as server:
        address = server.address
        assert address is not None
        for version in (1, 2):
            for name in ("handshake", "another version"):
                client = await RawClient.open(address, _payload(TRANSCRIPTS[version][name][0]))
                await client.read_to_end()
                out[version, name] = client.frames
        live: dict[tuple[int, str], RawClient] = {}
        for version in (1, 2):
            for name in ("records", "records and events"):
                payload = _payload(TRANSCRIPTS[version][name][0])
                live[version, name] = client = await RawClient.open(address, payload)
                await client.read_until(is_type("Subscribed"))
        publish("fit begins")
        for client in live.values():
            await client.read_until(is_type("Batch"))
        publish("fit goes on and ends")
        # Version 1: the stage's end ends the connection (what was queued, then a Bye).
        for name in ("records", "records and events"):
            await _ended_with_the_stage(live[1, name], name, "fit")
        await live[2, "records"].read_until(is_type("Batch"))
        await live[2, "records and events"].read_until(_ends_stage("fit"))
        # A version-1 client connects again for the next stage, as its document says.
        again = await RawClient.open(address, _payload(TRANSCRIPTS[1]["the next stage"][0]))
        await again.read_until(is_type("Subscribed"))
        publish("validate")
        await _ended_with_the_stage(again, "the next stage", "validate")
        await live[2, "records and events"].read_until(_ends_stage("validate"))
        out[1, "the next stage"] = again.frames
        async with anyio.create_task_group() as tg:
            for name in ("records", "records and events"):
                tg.start_soon(live[2, name].read_to_end)
            await server.aclose("the job ended")
    for key, client in live.items():
        out[key] = client.frames
    return out


def _normalized(payload: bytes) -> bytes:
    message = msgspec.msgpack.decode(payload)
    if isinstance(message, dict) and message.get("type") == "Welcome":
        message |= VOLATILE  # (keys keep their places)
        return msgspec.msgpack.encode(message)
    return payload


def _hex(payload: bytes) -> str:
    return (len(payload).to_bytes(4, "big") + payload).hex(" ")


def _wire(item: Any) -> Any:
    if isinstance(item, PutRecord):
        fields = ("R", item.name, item.value, item.step, item.epoch, item.time, item.source)
        return list(fields)
    return msgspec.msgpack.decode(msgspec.msgpack.encode(item))


def _document(version: int, frames: dict[tuple[int, str], list[bytes]]) -> dict[str, Any]:
    transcripts = []
    for name, (client, when) in TRANSCRIPTS[version].items():
        server = []
        for payload in map(_normalized, frames[version, name]):
            message = msgspec.msgpack.decode(payload)
            server.append({"message": message, "frame": _hex(payload)})
        if name == "records":
            server[2]["doc"] = DOCUMENTED_BATCH
        transcripts.append(
            {
                "name": name,
                "when": when,
                "client": [{"doc": CLIENT[c][0], "frame": CLIENT[c][1].hex(" ")} for c in client],
                "server": server,
            }
        )
    options = ", ".join(f"{k}={v!r}" for k, v in OPTIONS.items())
    return {
        "version": version,
        "about": _ABOUT.format(v=version, options=options),
        "volatile": {f"Welcome.{key}": value for key, value in VOLATILE.items()},
        "run": {part: [_wire(item) for item in items] for part, items in RUN.items()},
        "transcripts": transcripts,
    }


def _golden(version: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((GOLDEN / f"v{version}.json").read_text(encoding="utf-8"))
    return data


#: Keys whose values are words for people, not promises (their presence is one).
_WORDS = {("Bye", "reason")}


def _stream(messages: list[Any]) -> list[Any]:
    """What a connection's messages promise, whatever the frames: the messages other
    than Batch and Gap, and between them each item with its sequence number and each gap
    (adjacent gaps merged)."""
    out: list[Any] = []
    for message in messages:
        if message["type"] == "Batch":
            out += [("item", message["seq"] + i, item) for i, item in enumerate(message["items"])]
        elif message["type"] == "Gap":
            last = out[-1] if out else None
            if last is not None and last[0] == "gap" and last[1] + last[2] == message["seq"]:
                out[-1] = ("gap", last[1], last[2] + message["count"])
            else:
                out.append(("gap", message["seq"], message["count"]))
        else:
            out.append(message)
    return out


def _kind(entry: Any) -> str:
    return str(entry["type"] if isinstance(entry, dict) else entry[0])


def _broken_promises(golden: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """What ``actual`` no longer does of what ``golden`` records. Added keys are fine, and
    so are other words in a bye's reason and another split of the items into batches."""
    problems: list[str] = []
    now = {t["name"]: t for t in actual["transcripts"]}
    for transcript in golden["transcripts"]:
        name = transcript["name"]
        if name not in now:
            problems.append(f"{name!r}: no such transcript any more")
            continue
        want = _stream([f["message"] for f in transcript["server"]])
        got = _stream([f["message"] for f in now[name]["server"]])
        if [_kind(e) for e in want] != [_kind(e) for e in got]:
            problems.append(
                f"{name!r}: the server sent {[_kind(e) for e in got]}, the version promises "
                f"{[_kind(e) for e in want]}"
            )
            continue
        for i, (old, new) in enumerate(zip(want, got, strict=True)):
            if not isinstance(old, dict):
                if new != old:
                    problems.append(f"{name!r}: {new!r} where the version promises {old!r}")
                continue
            for key, value in old.items():
                if key not in new:
                    problems.append(f"{name!r}, entry {i} ({old['type']}): no key {key!r}")
                elif (old["type"], key) in _WORDS:
                    if not isinstance(new[key], str):
                        problems.append(f"{name!r}, entry {i}: {key!r} is not a str")
                elif new[key] != value:
                    problems.append(
                        f"{name!r}, entry {i} ({old['type']}): {key!r} is {new[key]!r}, "
                        f"the version promises {value!r}"
                    )
    return problems


def _sent(version: int, name: str, subscribe: dict[str, Any]) -> int:
    """How many items docs/protocol.md says the connection is sent (received or reported
    missing): the records its names select and, with ``events``, the events (from
    version 2 on, ``StageStarted`` too) of the parts of the run it is served."""
    count = 0
    for part in SERVED[version][name]:
        for item in RUN[part]:
            if isinstance(item, PutRecord):
                wanted = "records" in subscribe["topics"] and any(
                    fnmatch.fnmatchcase(item.name, p) for p in subscribe["names"]
                )
            else:
                wanted = "events" in subscribe["topics"] and (
                    version >= 2 or not isinstance(item, StageStarted)
                )
            count += wanted
    return count


def _check_accounting(version: int, document: dict[str, Any]) -> None:
    """Every connection's items and gaps tile its sequence numbers, and received +
    reported missing = sent when the server's Bye comes."""
    for transcript in document["transcripts"]:
        if transcript["name"] not in SERVED[version]:
            continue  # (a handshake, a refusal)
        messages = [f["message"] for f in transcript["server"]]
        subscribe = msgspec.msgpack.decode(bytes.fromhex(transcript["client"][1]["frame"])[4:])
        items, missing, _ = accounting(messages)
        sent = _sent(version, transcript["name"], subscribe)
        assert len(items) + missing == sent, (
            f"version {version}, {transcript['name']!r}: received {len(items)} items and "
            f"{missing} reported missing, but the server was to send {sent}"
        )
        if "fit goes on and ends" in SERVED[version][transcript["name"]]:
            assert missing > 0, "that part of the run overflows every client's queue"
        assert messages[-1] == {
            "type": "Bye",
            "code": "end",
            "reason": messages[-1]["reason"],
        }, transcript["name"]


async def _check(version: int) -> None:
    golden = _golden(version)
    for transcript in golden["transcripts"]:
        client, _ = TRANSCRIPTS[version][transcript["name"]]
        stored = [bytes.fromhex(f["frame"]) for f in transcript["client"]]
        assert stored == [CLIENT[c][1] for c in client], (
            f"the client frames of {transcript['name']!r} changed: the golden file is what "
            "clients of this version send"
        )
    actual = _document(version, await _record_run())
    problems = _broken_promises(golden, actual)
    assert not problems, (
        f"the server breaks protocol version {version}: "
        + "; ".join(problems)
        + ". Keep the version's promises, or make the change a new protocol version "
        "(docs/protocol.md, 'What may change within a version')."
    )
    _check_accounting(version, actual)
    assert actual == golden, (
        f"the frames of protocol version {version} changed in a way the version allows "
        "(only keys were added). If docs/protocol.md documents the addition, regenerate "
        "the golden files: python -m tests.stream.test_golden"
    )


@pytest.mark.parametrize("version", PROTOCOL_VERSIONS)
async def test_the_server_answers_each_version_s_documented_frames_as_recorded(
    version: int,
) -> None:
    await _check(version)


def test_every_version_has_its_golden_transcripts() -> None:
    assert sorted(p.name for p in GOLDEN.glob("v*.json")) == [
        f"v{v}.json" for v in PROTOCOL_VERSIONS
    ]
    assert sorted(TRANSCRIPTS) == list(PROTOCOL_VERSIONS)


def _documented_frames() -> dict[str, bytes]:
    """docs/protocol.md, "Example bytes": heading -> the frame's bytes."""
    text = PROTOCOL_DOC.read_text(encoding="utf-8")
    section = text.split("## Example bytes", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^`(.+?)`:\n\n```\n(.*?)```", section, re.M | re.S)
    return {label: bytes.fromhex(" ".join(body.split())) for label, body in blocks}


def test_the_documented_bytes_are_the_golden_ones() -> None:
    documented = _documented_frames()
    shown: set[str] = set()
    for version in PROTOCOL_VERSIONS:
        for transcript in _golden(version)["transcripts"]:
            for frame in [*transcript["client"], *transcript["server"]]:
                label = frame.get("doc")
                if label is not None:
                    assert label in documented, f"docs/protocol.md shows no frame {label!r}"
                    assert documented[label] == bytes.fromhex(frame["frame"]), label
                    shown.add(label)
    assert shown == set(documented), (
        f"docs/protocol.md shows frames no golden transcript sends: {set(documented) - shown}"
    )


def _dumps(value: Any, level: int = 0) -> str:
    """JSON with what fits on a line on one line (a message, an item, a frame's bytes)."""
    compact = json.dumps(value, ensure_ascii=False)
    if not isinstance(value, (list, dict)) or len(compact) + 2 * level <= 100:
        return compact
    pad = "  " * (level + 1)
    if isinstance(value, dict):
        parts = [f"{pad}{json.dumps(k)}: {_dumps(v, level + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(parts) + "\n" + "  " * level + "}"
    parts = [pad + _dumps(v, level + 1) for v in value]
    return "[\n" + ",\n".join(parts) + "\n" + "  " * level + "]"


async def _regenerate() -> None:
    frames = await _record_run()
    GOLDEN.mkdir(exist_ok=True)
    for version in PROTOCOL_VERSIONS:
        text = _dumps(_document(version, frames))
        (GOLDEN / f"v{version}.json").write_text(text + "\n", encoding="utf-8")


if __name__ == "__main__":
    anyio.run(_regenerate)
