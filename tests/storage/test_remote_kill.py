"""kill -9 during a remote save: a training process (``_remote_kill_script.py``) uploads
its checkpoints to the S3 server and is SIGKILLed inside an upload; ``fit(ckpt_path=
"last")`` against the same URL, in this process, resumes from the newest complete
checkpoint and ends bit-identical to an uninterrupted run.

The process patches nothing in loopbus. It uploads through a gate: a second front door
to the session's moto server (the same in-process store, on a port of its own) that
SIGKILLs it when the k-th request of a chosen kind arrives, and stores nothing of that
request. Three points of a save (object, marker, ``last.json``), so that the store is
left with: nothing of save k; the object of save k without its marker; save k complete
but not named by ``last.json``. The three processes run side by side, once per module;
each test resumes from a copy of what its process left, in a bucket of its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest
import torch

import loopbus
from loopbus import RemotePath
from tests.helpers import ROOT

from ._remote_kill_script import (
    EPOCHS,
    EVERY_N_STEPS,
    PER_EPOCH,
    assert_same_final,
    build,
    final_state,
)
from .conftest import S3, free_port, make_bucket

STEPS = EPOCHS * PER_EPOCH

pytestmark = pytest.mark.slow


@dataclass
class Kill:
    """SIGKILL the process that uploads into ``bucket`` when its ``nth`` PUT of ``what``
    arrives (``"object"``: a ``.ckpt``; ``"marker"``: a ``.ckpt.complete``;
    ``"pointer"``: ``last.json``), before the request reaches the store."""

    what: str
    nth: int
    bucket: str = ""
    proc: subprocess.Popen[str] | None = None
    seen: int = 0
    killed_at: str | None = None
    returncode: int | None = None
    stderr: str = ""
    tmp: Path = field(default_factory=Path)

    def matches(self, key: str) -> bool:
        if self.what == "object":
            return key.endswith(".ckpt")
        if self.what == "marker":
            return key.endswith(".ckpt.complete")
        return key == "run/last.json"

    def kill_now(self, key: str) -> bool:
        """Whether this request is the one: then the process is dead on return."""
        if self.killed_at is not None or not self.matches(key):
            return False
        self.seen += 1
        if self.seen < self.nth:
            return False
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while self.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        self.killed_at = key
        return True


class Gate:
    """The moto server's application (the store this process shares with the session's
    server), on a port of its own, with a :class:`Kill` rule per bucket."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import WSGIRequestHandler, make_server

        class Quiet(WSGIRequestHandler):
            def log(self, *args: Any) -> None:
                pass

        self.app = DomainDispatcherApplication(create_backend_app)
        self.rules: dict[str, Kill] = {}
        self.server = make_server(
            "127.0.0.1", free_port(), self, threaded=True, request_handler=Quiet
        )
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        if environ["REQUEST_METHOD"] == "PUT":
            bucket, _, key = unquote(environ.get("PATH_INFO", "")).lstrip("/").partition("/")
            rule = self.rules.get(bucket)
            if rule is not None and rule.kill_now(key):
                start_response("503 Service Unavailable", [("Content-Length", "0")])
                return [b""]
        return self.app(environ, start_response)

    def close(self) -> None:
        self.server.shutdown()
        self.thread.join()
        self.server.server_close()


CASES = {
    # Killed while the object of the 9th save is on its way: nothing of it is stored.
    "object": Kill("object", 9),
    # The object of the 10th save is stored, its marker never is.
    "marker": Kill("marker", 10),
    # The 11th save is complete (object and marker), last.json still names the 10th.
    "pointer": Kill("pointer", 11),
}


@pytest.fixture(scope="module")
def killed(s3_endpoint: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Kill]:
    gate = Gate()
    base = tmp_path_factory.mktemp("remote-kill")
    try:
        for name, case in CASES.items():
            case.bucket = make_bucket(s3_endpoint)
            case.tmp = base / name
            case.tmp.mkdir()
            gate.rules[case.bucket] = case
            # The upload's staging directory goes to the case's own temporary folder (a
            # killed process leaves it behind).
            env = {**os.environ, "TMPDIR": str(case.tmp), "OMP_NUM_THREADS": "1"}
            case.proc = subprocess.Popen(
                [
                    sys.executable, "-m", "tests.storage._remote_kill_script",
                    "--endpoint", gate.endpoint,
                    "--url", f"s3://{case.bucket}/run",
                    "--out", str(case.tmp / "final.pt"),
                    "--threads", str(torch.get_num_threads()),
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
        for case in CASES.values():
            assert case.proc is not None
            try:
                _, case.stderr = case.proc.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                case.proc.kill()
                _, case.stderr = case.proc.communicate()
            case.returncode = case.proc.returncode
    finally:
        gate.close()
    return CASES


def _objects(s3: S3, bucket: str) -> dict[str, bytes]:
    fs = s3.fs
    return {key.split("/", 2)[2]: fs.cat_file(key) for key in fs.find(f"{bucket}/run")}


def _reference() -> dict[str, Any]:
    trainer, module, train = build(None, None)
    loopbus.run(trainer.fit, module, train)
    return final_state(trainer, module)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return _reference()


@pytest.mark.parametrize("case", list(CASES))
async def test_resume_after_sigkill_in_a_remote_save_is_bit_identical(
    case: str, killed: dict[str, Kill], reference: dict[str, Any], s3: S3
) -> None:
    kill = killed[case]
    where = f"(killed at the {kill.nth}th {kill.what} PUT: {kill.killed_at})"
    assert kill.returncode == -signal.SIGKILL, f"not killed {where}: {kill.stderr[-3000:]}"
    assert not (kill.tmp / "final.pt").exists()
    assert kill.killed_at is not None
    killed_save = kill.killed_at.removeprefix("run/").removesuffix(".complete")
    left = _objects(s3, kill.bucket)
    saves = sorted(
        (n for n in left if n.endswith(".ckpt")), key=lambda n: int(n.split("step=")[1][:-5])
    )
    pointer = json.loads(left["last.json"])["checkpoint"]
    # What the kill left: last.json names the save before the one killed, complete.
    if kill.what == "object":
        assert saves[-1] == pointer
        assert kill.killed_at.endswith(f"step={kill.nth * EVERY_N_STEPS}.ckpt"), where
    if kill.what == "marker":
        assert saves[-1] == killed_save, where  # stored without its marker
        assert killed_save + ".complete" not in left, where
        assert saves[-2] == pointer
    if kill.what == "pointer":
        assert saves[-1] + ".complete" in left, where  # complete, and not named
        assert saves[-2] == pointer
    assert int(pointer.split("step=")[1][:-5]) == (kill.nth - 1) * EVERY_N_STEPS, where
    assert f"{pointer}.complete" in left

    # Resume, in this process, from a copy of what the kill left.
    fs = s3.fs
    for name, data in left.items():
        fs.pipe_file(f"{s3.bucket}/run/{name}", data)
    directory = RemotePath(s3.url, s3.options)
    assert str(loopbus.latest_checkpoint(directory)) == f"{s3.url}/{pointer}"
    trainer, module, train = build(s3.url, s3.options)
    await trainer.fit(module, train, ckpt_path="last")
    assert_same_final(final_state(trainer, module), reference, where)
    last = loopbus.latest_checkpoint(directory)
    assert str(last) == f"{s3.url}/epoch={EPOCHS - 1}-step={STEPS}.ckpt"
    assert loopbus.load_checkpoint(directory)["loopbus"]["global_step"] == STEPS
