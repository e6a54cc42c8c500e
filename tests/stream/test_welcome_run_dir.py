"""``Welcome.run_dir``: a server tells its clients the run folder the job writes, so that
a dashboard reads what was put before it connected (an optional key within version 2)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

import loopbus
from loopbus.stream import Server, Welcome


async def test_the_welcome_names_the_run_folder_once_it_is_set(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    socket = tmp_path / "run.sock"
    async with Server(host=None, path=socket) as server:
        async with loopbus.connect(f"unix://{socket}") as stream:
            assert stream.welcome is not None
            assert stream.welcome.run_dir is None
        server.run_dir = tmp_path / "runs" / "exp" / "version_0"
        async with loopbus.connect(f"unix://{socket}") as stream:
            assert stream.welcome is not None
            assert stream.welcome.run_dir == str(tmp_path / "runs" / "exp" / "version_0")
        # A value that is no path is not told (and the client is served all the same).
        server.run_dir = 3  # type: ignore[assignment]
        with caplog.at_level("WARNING", logger="loopbus.stream"):
            async with loopbus.connect(f"unix://{socket}") as stream:
                assert stream.welcome is not None
                assert stream.welcome.run_dir is None
        assert "Server.run_dir must be a folder path or None, got 3" in caplog.text


def test_a_client_that_does_not_know_the_key_ignores_it() -> None:
    class OldWelcome(msgspec.Struct, tag="Welcome"):
        version: int
        server: str

    frame = msgspec.msgpack.encode(Welcome(version=2, server="x", run_dir="/runs/a"))
    assert msgspec.msgpack.decode(frame, type=OldWelcome) == OldWelcome(version=2, server="x")
