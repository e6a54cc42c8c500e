"""A process that raised its recursion limit (``sys.setrecursionlimit(200_000)``, as deep
models and ``torch.compile`` advise) and meets peers that send frames nested as deep as
the frame limits allow; run by ``tests/stream/test_deep_frames.py``.

``python -m tests.stream.deep_frames_script serve BACKEND SCOPE TOKEN``
    A small training run with a ``StreamServer`` (``TOKEN`` ``-``: none). Prints
    ``address <ADDRESS>``, trains when a line arrives on stdin, closes the server, prints
    ``put <N>`` (the records it put) and exits 0.

``python -m tests.stream.deep_frames_script connect BACKEND ADDRESS N``
    Connects ``N`` times to the server at ``ADDRESS`` with ``loopbus.connect`` and reads
    each stream to its end; prints one line per connection: ``error <StreamError's
    message>`` or ``ended <records received>``, then exits 0.
"""

from __future__ import annotations

import sys

sys.setrecursionlimit(200_000)

from typing import Any  # noqa: E402

import anyio  # noqa: E402
import anyio.to_thread  # noqa: E402

from loopbus.stream import connect  # noqa: E402

RECORDS_PER_STEP = 20


def say(line: str) -> None:
    print(line, flush=True)


async def serve(scope: Any, token: str | None) -> None:
    from loopbus import PutRecord, Trainer
    from loopbus.plugins import StreamServer
    from tests.helpers import make_loader
    from tests.plugins.stream_helpers import ChattyModule, Gate

    server = StreamServer(scope=scope, token=token, announce=False)
    gate = Gate()
    trainer = Trainer(plugins=[server, gate], max_epochs=2)
    put: list[PutRecord] = []
    trainer.subscribe(PutRecord, put.append, destination="external")

    async def go_when_told() -> None:
        await gate.started.wait()
        say(f"address {gate.address}")
        await anyio.to_thread.run_sync(sys.stdin.readline)
        gate.go.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(go_when_told)
        await trainer.fit(ChattyModule(RECORDS_PER_STEP), make_loader(64))
    server.close()
    say(f"put {len(put)}")


async def read(address: str, n: int) -> None:
    for _ in range(n):
        try:
            async with connect(address, timeout=60) as stream:
                received = [item async for item in stream]
        except Exception as exc:
            say(f"error {type(exc).__name__}: {exc}")
        else:
            say(f"ended {len(received)}")


def main(argv: list[str]) -> None:
    mode, backend, *args = argv
    if mode == "serve":
        scope, token = args
        anyio.run(serve, scope, None if token == "-" else token, backend=backend)
    else:
        address, n = args
        anyio.run(read, address, int(n), backend=backend)


if __name__ == "__main__":
    main(sys.argv[1:])
