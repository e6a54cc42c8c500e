"""``Welcome.run_dir``: a server tells its clients the run folder the job writes, so that
a dashboard reads what was put before it connected (an optional key within version 2)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

import loopbus
from loopbus.stream import Server, Welcome


async def test_the_welcome_names_the_run_folder_once_it_is_set(tmp_path: Path) -> None:
    socket = tmp_path / "run.sock"
    async with Server(host=None, path=socket) as server:
        async with loopbus.connect(f"unix://{socket}") as stream:
            assert stream.welcome is not None
            assert stream.welcome.run_dir is None
        server.run_dir = tmp_path / "runs" / "exp" / "version_0"
        assert server.run_dir == str(tmp_path / "runs" / "exp" / "version_0")
        async with loopbus.connect(f"unix://{socket}") as stream:
            assert stream.welcome is not None
            assert stream.welcome.run_dir == server.run_dir
        with pytest.raises(TypeError, match=r"Server\.run_dir must be a folder path or None"):
            server.run_dir = 3  # type: ignore[assignment]


def test_a_client_that_does_not_know_the_key_ignores_it() -> None:
    class OldWelcome(msgspec.Struct, tag="Welcome"):
        version: int
        server: str

    frame = msgspec.msgpack.encode(Welcome(version=2, server="x", run_dir="/runs/a"))
    assert msgspec.msgpack.decode(frame, type=OldWelcome) == OldWelcome(version=2, server="x")
