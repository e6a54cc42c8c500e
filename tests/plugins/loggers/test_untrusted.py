"""A JSON lines log is read as untrusted input: each line's nesting is measured (without
recursion) before it is decoded. ``read_jsonl`` raises ``msgspec.DecodeError`` naming the
file, the line and the problem for a line nested too deep, as for any line that does not
decode; a resumed ``JSONLLogger`` keeps such a line as it keeps any line that is not a
record.

msgspec skips the value of a key it does not know by recursing once per level, and what
stops it is the recursion limit. A process that raised it overflowed its C stack on a
line of brackets (a segmentation fault): with ``sys.setrecursionlimit(1_000_000)`` on a
800 kB line, and with ``sys.setrecursionlimit(200_000)`` on a 300 kB line read in a thread
with a 1 MiB stack (loggers work in threads). Those reads run in subprocesses, so a crash
is an exit code, not a dead test session.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from loopbus import PutRecord
from loopbus.plugins import decode_records, read_jsonl

TOO_DEEP = "nests arrays and objects more than 64 levels deep"


def line(step: int) -> bytes:
    record = PutRecord(name="train/loss", value=0.5, step=step, time=float(step))
    return msgspec.json.encode(record) + b"\n"


def deep_line(depth: int) -> bytes:
    """A record with one more key, ``"x"``, first, whose value nests ``depth`` levels."""
    return b'{"x": ' + b"[" * depth + b"]" * depth + b", " + line(2)[1:]


#: Runs ``sys.argv[4]`` (code that reads ``ARG``, ``sys.argv[3]``) with the recursion limit
#: ``sys.argv[1]``, in the main thread or (``sys.argv[2]`` not 0) in a thread with a stack
#: of that many bytes.
VICTIM = """
import sys, threading
sys.setrecursionlimit(int(sys.argv[1]))
stack, namespace = int(sys.argv[2]), {"ARG": sys.argv[3]}
if stack:
    threading.stack_size(stack)
    thread = threading.Thread(target=exec, args=(sys.argv[4], namespace))
    thread.start()
    thread.join()
else:
    exec(sys.argv[4], namespace)
"""
#: (recursion limit, thread stack or 0 for the main thread, nesting of the deep line).
SETTINGS = {
    "main-thread": (1_000_000, 0, 400_000),
    "small-stack-thread": (200_000, 1 << 20, 150_000),
}


def run(setting: str, code: str, arg: str) -> str:
    """Run ``code`` as :data:`VICTIM` does, with ``SETTINGS[setting]``; its output."""
    limit, stack, _ = SETTINGS[setting]
    result = subprocess.run(
        [sys.executable, "-c", VICTIM, str(limit), str(stack), arg, code],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    return result.stdout


@pytest.mark.external
@pytest.mark.parametrize("setting", SETTINGS)
def test_read_jsonl_names_the_file_and_the_line_that_nests_too_deep(
    tmp_path: Path, setting: str
) -> None:
    path = tmp_path / "records.jsonl"
    path.write_bytes(line(1) + deep_line(SETTINGS[setting][2]) + line(3))
    code = """
import msgspec
from loopbus.plugins import read_jsonl
try:
    read_jsonl(ARG)
except msgspec.DecodeError as exc:
    print("error:", exc)
"""
    assert (
        run(setting, code, str(path))
        == f"error: {path}, line 2: it {TOO_DEEP} (loopbus writes at most 2); it was not decoded\n"
    )


@pytest.mark.external
def test_a_resumed_jsonl_logger_keeps_a_deep_line(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    deep = deep_line(SETTINGS["small-stack-thread"][2])
    path.write_bytes(line(1) + deep + line(3))
    # Resuming from a checkpoint at step 1 drops the lines of later steps; a line it
    # cannot read as a record is kept, as before.
    code = """
from loopbus.plugins import JSONLLogger
logger = JSONLLogger(ARG, name="", version="")
logger._resume_step, logger._resume_time = 1, None
logger.open("fit")
logger.close()
print("ok")
"""
    assert run("small-stack-thread", code, str(tmp_path)) == "ok\n"
    assert path.read_bytes() == line(1) + deep


def test_every_bad_line_is_named_with_the_file(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    path.write_bytes(line(1) + b"\n" + b'{"type": "PutRecord", "name": 3}\n' + line(3))
    with pytest.raises(
        msgspec.ValidationError,
        match=rf"^{re.escape(str(path))}, line 3: Expected `str`, got `int`",
    ):
        read_jsonl(path)
    with pytest.raises(msgspec.DecodeError, match=rf"^line 2: it {TOO_DEEP}"):
        decode_records([line(1), deep_line(64)])
    assert decode_records([line(1), deep_line(63)]) == [
        PutRecord(name="train/loss", value=0.5, step=1, time=1.0),
        PutRecord(name="train/loss", value=0.5, step=2, time=2.0),
    ]
