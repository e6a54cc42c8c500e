"""How long a checkpoint save holds up the training step, against a hand-written host copy.

Work: an MLP of four 1024-wide layers (about 3.2 M parameters, 13 MB, and as much again of
SGD momentum), batch 32, one torch thread. The ``Checkpoint`` plugin saves every
``--every`` steps. Around its handler (which runs inline at ``TrainBatchCompleted``) a
stopwatch plugin:

* first waits until the previous save is fully written (so a save is measured alone,
  not the wait for the one before it),
* then times a hand-written host copy of the same state (``copy.deepcopy`` of the
  module's and the optimizer's state dicts: the least any background save must do;
  the second of two, so that both sides copy into a warmed-up allocator),
* then times the Checkpoint handler itself: how long the step is held up.

The figure is the median over the saves of blocked / host copy, for a background save
(``background=True``: host copy on the step, write in a worker thread) and, for scale, a
synchronous one (the step waits for the write and its fsyncs).

Then the same background save to object storage: ``Checkpoint("s3://...")`` against moto's
S3 server, started in this process on a free port of 127.0.0.1 (``pip install
'loopbus[test]'``; skipped without moto), file checkpoints, uploaded by the worker
(object, marker, ``last.json``); then sharded checkpoints (``sharded=True``, one
process: the state staged to host memory on the step, DCP's writer in a worker thread),
to a local folder and to the S3 server (the shards through DCP's fsspec writer, then
``loopbus_state.pt``, the marker, ``last.json``). Each remote figure is its median
blocked time over the local background save's of the same kind (the target: within
1.2x).

    ./dev bench checkpoint
    ./dev bench checkpoint --saves 30 --width 2048
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import logging
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import anyio
import torch
from torch.utils.data import DataLoader, TensorDataset

import loopbus
from loopbus import Module, Plugin, RemotePath, Trainer, on
from loopbus.events import TrainBatchCompleted
from loopbus.plugins import Checkpoint
from loopbus.storage import Store

torch.set_num_threads(1)


class Wide(Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, width),
            torch.nn.ReLU(),
            torch.nn.Linear(width, 10),
        )

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Stopwatch(Plugin):
    """Checkpoint's handler has priority -100: ``before`` runs just ahead of it, ``after``
    just behind it."""

    def __init__(self, directory: Path | RemotePath, every: int) -> None:
        self.directory = directory
        self.every = every
        self.blocked: list[float] = []
        self.host_copy: list[float] = []
        self.previous: Path | RemotePath | None = None
        self.t0 = 0.0
        self.trainer: Trainer | None = None

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer

    def _settled(self) -> bool:
        if self.previous is None:
            return True
        if isinstance(self.directory, RemotePath):
            objects, prefixes = Store(self.directory).contents()
            files = [n for n in (*objects, *prefixes) if n.endswith(".ckpt")]
        else:
            files = [p.name for p in self.directory.glob("*.ckpt")]
        # Polled while a save is written: the warning about a half-written one is expected.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            latest = loopbus.latest_checkpoint(self.directory)
        return latest == self.previous and len(files) == 1

    @on(TrainBatchCompleted, priority=-99)
    async def before(self, event: TrainBatchCompleted) -> None:
        if event.step % self.every:
            return
        poll = 0.01 if isinstance(self.directory, RemotePath) else 0.002
        while not self._settled():  # noqa: ASYNC110 - polling files: there is no event
            await anyio.sleep(poll)
        assert self.trainer is not None
        assert self.trainer.module is not None
        module, optimizer = self.trainer.module, self.trainer.optimizers[0]
        for _ in range(2):  # the first warms the allocator, as earlier saves did for loopbus
            start = time.perf_counter()
            copy.deepcopy(module.state_dict())
            copy.deepcopy(optimizer.state_dict())
            elapsed = time.perf_counter() - start
        self.host_copy.append(elapsed)
        self.t0 = time.perf_counter()

    @on(TrainBatchCompleted, priority=-101)
    async def after(self, event: TrainBatchCompleted) -> None:
        if event.step % self.every:
            return
        self.blocked.append(time.perf_counter() - self.t0)
        self.previous = self.directory / f"epoch={event.epoch}-step={event.step}.ckpt"


def measure(
    background: bool,
    width: int,
    saves: int,
    every: int,
    remote: RemotePath | None = None,
    sharded: bool = False,
) -> tuple[list[float], list[float]]:
    """The step's blocked time and the hand-written host copy's, per save: into a
    temporary folder, or to the URL ``remote``; checkpoint files, or sharded ones."""
    torch.manual_seed(0)
    x = torch.randn(32 * every * saves, 32)
    y = torch.randint(0, 10, (len(x),))
    data = DataLoader(TensorDataset(x, y), batch_size=32)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) if remote is None else remote
        watch = Stopwatch(directory, every)
        checkpoint = Checkpoint(
            directory,
            every_n_steps=every,
            keep_last=1,
            background=background,
            save_on_end=False,
            exist_ok=True,
            sharded=sharded,
        )
        trainer = Trainer(max_epochs=1, plugins=[checkpoint, watch], device="cpu")
        loopbus.run(trainer.fit, Wide(width), data)
        written = loopbus.load_checkpoint(directory)  # complete when fit returned
        assert written["loopbus"]["global_step"] == every * saves
    return watch.blocked, watch.host_copy


def s3_server() -> tuple[Any, RemotePath] | None:
    """moto's S3 server on a free port of 127.0.0.1 and a bucket's URL on it (with the
    storage options that reach it); None without moto, s3fs or boto3."""
    if not all(importlib.util.find_spec(m) for m in ("moto", "s3fs", "boto3")):
        return None
    import boto3
    from _harness import free_port
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=free_port(), verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    credentials = {"aws_access_key_id": "bench", "aws_secret_access_key": "bench"}
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **credentials)
    client.create_bucket(Bucket="loopbus-bench")
    options = {
        "key": "bench",
        "secret": "bench",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }
    return server, RemotePath("s3://loopbus-bench/checkpoint", options)


def report(kind: str, blocked: list[float], host: list[float]) -> None:
    ratios = [b / h for b, h in zip(blocked, host, strict=True)]
    print(
        f"{kind:>12} save: step blocked {statistics.median(blocked) * 1e3:7.1f} ms, "
        f"hand-written host copy {statistics.median(host) * 1e3:6.1f} ms, "
        f"ratio {statistics.median(ratios):5.2f} (median of {len(ratios)})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--saves", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    args = parser.parse_args()
    params = sum(p.numel() for p in Wide(args.width).parameters())
    print(
        f"model: {params / 1e6:.1f} M parameters ({params * 4 / 2**20:.0f} MiB, and as much "
        f"momentum); {args.saves} saves, every {args.every} steps"
    )
    local: list[float] = []
    # The synchronous save first: the process's first run pays for warming up (the
    # allocator, the first torch.save), which the local background save compared with
    # the remote one must not.
    for background in (False, True):
        blocked, host = measure(background, args.width, args.saves, args.every)
        report("background" if background else "synchronous", blocked, host)
        local = blocked
    found = s3_server()
    if found is None:
        print("      remote save: skipped (needs moto, s3fs and boto3: pip install 'loopbus[test]')")
        return
    server, url = found
    try:
        blocked, host = measure(True, args.width, args.saves, args.every, remote=url)
        report("remote (s3)", blocked, host)
        sharded_local, host = measure(True, args.width, args.saves, args.every, sharded=True)
        report("sharded", sharded_local, host)
        sharded_remote, host = measure(
            True, args.width, args.saves, args.every, remote=url / "sharded", sharded=True
        )
        report("sharded (s3)", sharded_remote, host)
    finally:
        server.stop()
    for kind, remote, here in (
        ("file", blocked, local),
        ("sharded", sharded_remote, sharded_local),
    ):
        print(
            f"remote / local background save ({kind}), step blocked: "
            f"{statistics.median(remote) / statistics.median(here):5.2f} (target: within 1.2)"
        )


if __name__ == "__main__":
    main()
