"""The ``loopbus`` command: ``loopbus watch`` against a real run, as a subprocess."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import anyio
import msgspec
import pytest

from loopbus import PutRecord
from loopbus.__main__ import main
from tests.helpers import TinyModule, make_loader
from tests.plugins.stream_helpers import serving

WATCH = [sys.executable, "-m", "loopbus", "watch"]


async def test_watch_jsonl_prints_decodable_lines_for_every_record() -> None:
    async with serving(
        TinyModule(), max_epochs=2, train=make_loader(64), val=make_loader(32)
    ) as run:
        async with await anyio.open_process(
            [*WATCH, "--jsonl", run.address], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        ) as process:
            await run.wait_for_subscribers(1)
            run.gate.go.set()
            assert process.stdout is not None
            assert process.stderr is not None
            with anyio.fail_after(120):
                output = b"".join([chunk async for chunk in process.stdout])
                errors = b"".join([chunk async for chunk in process.stderr])
                code = await process.wait()
    assert code == 0, errors.decode()
    lines = output.splitlines()
    assert len(lines) == len(run.captured) == 2 * (4 + 2)
    records = [msgspec.json.decode(line, type=PutRecord) for line in lines]
    assert records == run.expected
    seqs = [msgspec.json.decode(line)["seq"] for line in lines]
    assert seqs == list(range(len(lines)))


async def test_watch_table_shows_each_name() -> None:
    async with serving(
        TinyModule(), max_epochs=2, train=make_loader(64), val=make_loader(32)
    ) as run:
        async with await anyio.open_process(
            [*WATCH, "--events", "--names", "train/*,val/*", run.address],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        ) as process:
            await run.wait_for_subscribers(1)
            run.gate.go.set()
            assert process.stdout is not None
            with anyio.fail_after(120):
                output = b"".join([chunk async for chunk in process.stdout]).decode()
                code = await process.wait()
    assert code == 0
    last = {r.name: r for r in run.captured}
    for name in ("train/loss", "val/loss"):
        assert name in output
        assert f"{last[name].value:.6g}" in output
    assert "12 records" in output
    assert "ended: the fit stage ended" in output


def test_watch_reports_unreachable_and_bad_addresses(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert main(["watch", "--jsonl", f"127.0.0.1:{port}"]) == 1
    assert f"could not connect to tcp://127.0.0.1:{port}" in capsys.readouterr().err
    assert main(["watch", "ftp://example.com:21"]) == 2
    assert "scheme 'ftp'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["watch"])  # ADDRESS is required
    assert "the following arguments are required: address" in capsys.readouterr().err


def test_console_script_is_declared() -> None:
    from importlib.metadata import entry_points

    scripts = {ep.name: ep.value for ep in entry_points(group="console_scripts")}
    assert scripts.get("loopbus") == "loopbus.__main__:main"


def test_digits_demo_serves_its_records(capfd: pytest.CaptureFixture[str]) -> None:
    examples = str(Path(__file__).resolve().parents[1] / "examples")
    sys.path.insert(0, examples)
    try:
        import digits

        digits.main(["--epochs", "1", "--serve", "tcp://127.0.0.1:0"])
    finally:
        sys.path.remove(examples)
    err = capfd.readouterr().err
    assert "loopbus: streaming records on tcp://127.0.0.1:" in err
    assert "watch them with: loopbus watch tcp://127.0.0.1:" in err
