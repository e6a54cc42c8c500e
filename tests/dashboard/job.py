"""A small training job serving its stream, for the dashboard's tests: ``fit`` (records
under ``train/``, ``val/`` and a name without a prefix), then ``test``, on one address.

    python -m tests.dashboard.job ADDRESS [--epochs N] [--delay SECONDS] [--wait] [--root DIR]

With ``--root`` the job has a run folder there (``DIR/job/version_0``) with a JSONL log,
and its stream names it.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import anyio
import torch

import loopbus
from loopbus.events import FitStarted, TestStarted
from loopbus.plugins import StreamServer
from loopbus.plugins.loggers import JSONLLogger
from tests.helpers import TinyModule, make_loader


class Job(TinyModule):
    """TinyModule, plus accuracy, the learning rate and a prefix-less name; each step
    takes at least ``delay`` seconds so that a watcher sees the run progress."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        loss = super().training_step(batch, ctx)
        x, y = batch
        self.put("train/acc", (self(x).argmax(1) == y).float().mean())
        self.put("lr", 0.1)
        if self.delay:
            time.sleep(self.delay)
        return loss

    def validation_step(self, batch: Any, ctx: Any) -> None:
        super().validation_step(batch, ctx)
        x, y = batch
        self.put("val/acc", (self(x).argmax(1) == y).float().mean())


class WaitForClient(loopbus.Plugin):
    """Holds each stage at its start until a client subscribed to ``server`` (the stream
    does not replay what was put before), for at most 60 s."""

    def __init__(self, server: StreamServer) -> None:
        self.server = server

    @loopbus.on(FitStarted)
    @loopbus.on(TestStarted)
    async def hold(self, event: Any) -> None:
        with anyio.fail_after(60):
            while self.server.subscribers < 1:  # noqa: ASYNC110 - a counter, no event
                await anyio.sleep(0.02)


async def main(address: str, epochs: int, delay: float, wait: bool, root: str | None) -> None:
    server = StreamServer.from_address(address, announce=False)
    plugins: list[loopbus.Plugin] = [server, WaitForClient(server)] if wait else [server]
    if root is not None:
        plugins.append(JSONLLogger(flush_interval=0.1))
    trainer = loopbus.Trainer(
        max_epochs=epochs, plugins=plugins, device="cpu", root_dir=root, name="job"
    )
    module = Job(delay)
    try:
        await trainer.fit(module, make_loader(256, 16), make_loader(64, 16, seed=1))
        await trainer.test(module, make_loader(64, 16, seed=2))
    finally:
        server.close()  # the job ends: its server (serving the trainer's lifetime) closes


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--delay", type=float, default=0.0)
    parser.add_argument("--wait", action="store_true", help="hold each stage for a client")
    parser.add_argument("--root", help="the run folders' root (a JSONL log in the run's)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    loopbus.run(main, args.address, args.epochs, args.delay, args.wait, args.root)
