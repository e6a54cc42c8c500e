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

Last, a store that stalls (``--stall``): the same fit of ``--saves`` remote saves through
a TCP proxy in front of the S3 server, healthy, then switched at the first step to accept
connections and read nothing (a store that stops reading). Every store call is held to
``StoreDeadlines(call_s=--call-s, save_wait_s=--save-wait-s)`` (connect and read:
``--call-s`` too), ``upload_retries=1``: the stalled upload is abandoned and tried again,
a save due meanwhile is skipped after ``save_wait_s``. The figures: each fit's wall time,
its longest step, the saves skipped and the uploads that failed.

    ./dev bench checkpoint
    ./dev bench checkpoint --saves 30 --width 2048
And a store that is down (``--outage``): 20 epochs of a small model (an MLP of width
``--outage-width``, ``--outage-steps`` batches an epoch: about 10 s without a checkpoint,
the run of the outage this measures) saving every epoch to the S3 server through the
proxy: healthy; refusing connections from the first step on (a store that is down);
stalling them from the first step on (a store that stops reading); against the same fit
with no checkpoint, in ``--repeats`` rounds of the four (after one that warms up), the
median ratio of each round's. Refusing runs with the default ``StoreDeadlines``;
stalling with ``save_wait_s=--save-wait-s``, ``call_s=--call-s`` and
``upload_retries=1`` (the first due save waits ``save_wait_s``, the later ones none;
``fit`` ends once the upload in flight has, within (1 + 1) x ``call_s`` plus backoff).
The target: a store that is down within 1.2x the fit without a checkpoint.

    ./dev bench checkpoint --stall --saves 10 --call-s 2 --save-wait-s 0.5
    ./dev bench checkpoint --outage
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import logging
import select
import socket
import statistics
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import anyio
import torch
from torch.utils.data import DataLoader, TensorDataset

import loopbus
from loopbus import Module, Plugin, RemotePath, StoreDeadlines, Trainer, on
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


class StallingProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream``; while :attr:`stalled` is set it
    accepts connections and reads nothing, and stops forwarding on those it has."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.stalled = threading.Event()
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:  # closed
                return
            self.sockets.append(client)
            if self.stalled.is_set():
                continue  # parked: never read, never answered
            upstream = socket.create_connection(self.upstream)
            self.sockets.append(upstream)
            for source, target in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, target), daemon=True).start()

    def _pipe(self, source: socket.socket, target: socket.socket) -> None:
        try:
            while True:
                if self.stalled.is_set() or not select.select([source], [], [], 0.05)[0]:
                    time.sleep(0.01 if self.stalled.is_set() else 0)
                    continue
                data = source.recv(1 << 16)
                if not data:
                    break
                target.sendall(data)
        except (OSError, ValueError):  # closed by the other side or the other pipe
            pass
        finally:
            source.close()
            target.close()

    def refuse(self) -> None:
        """From now on a store that is down: connections are refused (the port closed),
        and those open are closed."""
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self.close()

    def close(self) -> None:
        for sock in [self.server, *self.sockets]:
            sock.close()


class Stall(Plugin):
    """Stalls the proxy at the first step (once the folder is claimed); records the
    longest time between two steps."""

    def __init__(self, proxy: StallingProxy, stall: bool, refuse: bool = False) -> None:
        self.proxy, self.stall, self.refuse = proxy, stall, refuse
        self.last: float | None = None
        self.longest = 0.0

    @on(TrainBatchCompleted)
    def _step(self, event: TrainBatchCompleted) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.longest = max(self.longest, now - self.last)
        self.last = now
        if self.stall:
            self.proxy.stalled.set()
        if self.refuse and not self.proxy.stalled.is_set():
            self.proxy.stalled.set()  # refused once: not again
            self.proxy.refuse()


def stalled_store(
    url: RemotePath, width: int, saves: int, every: int, deadlines: StoreDeadlines
) -> None:
    """A fit of ``saves`` remote saves through a proxy, healthy, then stalled."""
    host, port = url.storage_options["client_kwargs"]["endpoint_url"][7:].split(":")
    torch.manual_seed(0)
    x = torch.randn(32 * every * saves, 32)
    data = DataLoader(TensorDataset(x, torch.randint(0, 10, (len(x),))), batch_size=32)
    for stalled in (False, True):
        proxy = StallingProxy((host, int(port)))
        options = url.storage_options
        options["client_kwargs"] = dict(options["client_kwargs"], endpoint_url=proxy.endpoint)
        where = RemotePath(f"{url.url}/stall-{stalled}", options)
        watch = Stall(proxy, stalled)
        checkpoint = Checkpoint(
            where,
            every_n_steps=every,
            save_on_end=False,
            upload_retries=1,
            store_deadlines=deadlines,
        )
        trainer = Trainer(max_epochs=1, plugins=[checkpoint, watch], device="cpu")
        took, messages = _timed_fit(trainer, width, data)
        proxy.close()
        down = sum("cannot save to" in m for m in messages)
        back = sum(" resumed: " in m for m in messages)
        print(
            f"{'stalled' if stalled else 'healthy':>12} store: fit of {saves} saves "
            f"{took:6.1f} s, longest step {watch.longest:5.2f} s, outage warnings {down}, "
            f"resumed {back}"
        )


def store_down(
    url: RemotePath, width: int, steps: int, deadlines: StoreDeadlines, repeats: int
) -> None:
    """20 epochs of ``steps`` batches, without a checkpoint, then saving every epoch to a
    healthy store, to one that goes down at the first step (refusing), and to one that
    stalls at the first step; ``repeats`` rounds of the four, the median ratio of each
    to the fit without a checkpoint of the same round."""
    host, port = url.storage_options["client_kwargs"]["endpoint_url"][7:].split(":")
    torch.manual_seed(0)
    x = torch.randn(32 * steps, 32)
    data = DataLoader(TensorDataset(x, torch.randint(0, 10, (len(x),))), batch_size=32)
    modes = ("none", "healthy", "refusing", "stalling")
    took: dict[str, list[float]] = {mode: [] for mode in modes}
    warned: dict[str, list[int]] = {mode: [] for mode in modes}
    for round_ in range(repeats + 1):  # the first round warms up
        for mode in modes:
            seconds, down = _fit_20_epochs(
                url, host, int(port), mode, data, width, deadlines, round_
            )
            if round_:
                took[mode].append(seconds)
                warned[mode].append(down)
    none = took["none"]
    print(f"  no checkpoint: 20 epochs {statistics.median(none):6.2f} s (median of {repeats})")
    for mode in modes[1:]:
        ratios = [t / n for t, n in zip(took[mode], none, strict=True)]
        print(
            f"{mode:>8} store: 20 epochs {statistics.median(took[mode]):6.2f} s, ratio to no "
            f"checkpoint {statistics.median(ratios):5.2f} (median; "
            f"{min(ratios):.2f}-{max(ratios):.2f}; target for a store that is down: within "
            f"1.2), outage warnings {max(warned[mode])}"
        )


def _fit_20_epochs(
    url: RemotePath,
    host: str,
    port: int,
    mode: str,
    data: DataLoader[Any],
    width: int,
    deadlines: StoreDeadlines,
    round_: int,
) -> tuple[float, int]:
    """One fit of 20 epochs with the store in ``mode``: its seconds and outage warnings."""
    proxy = StallingProxy((host, port))
    options = url.storage_options
    options["client_kwargs"] = dict(options["client_kwargs"], endpoint_url=proxy.endpoint)
    plugins: list[Plugin] = []
    if mode in ("refusing", "stalling"):
        plugins.append(Stall(proxy, stall=mode == "stalling", refuse=mode == "refusing"))
    if mode != "none":
        plugins.append(
            Checkpoint(
                RemotePath(f"{url.url}/down-{mode}-{round_}", options),
                every_n_epochs=1,
                upload_retries=1 if mode == "stalling" else 3,
                store_deadlines=deadlines if mode == "stalling" else None,
            )
        )
    trainer = Trainer(max_epochs=20, plugins=plugins, device="cpu")
    seconds, messages = _timed_fit(trainer, width, data)
    proxy.close()
    return seconds, sum("cannot save to" in m for m in messages)


def _timed_fit(trainer: Trainer, width: int, data: DataLoader[Any]) -> tuple[float, list[str]]:
    """``trainer.fit`` of a fresh ``Wide(width)``: its seconds and the warnings it gave."""
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loopbus.run(trainer.fit, Wide(width), data)
    return time.perf_counter() - start, [str(w.message) for w in caught]


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
    parser.add_argument("--stall", action="store_true", help="only the stalled-store figures")
    parser.add_argument("--call-s", type=float, default=2.0)
    parser.add_argument("--save-wait-s", type=float, default=0.5)
    parser.add_argument("--outage", action="store_true", help="only the store-down figures")
    parser.add_argument("--outage-width", type=int, default=256)
    parser.add_argument("--outage-steps", type=int, default=320)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the --outage fits")
    args = parser.parse_args()
    params = sum(p.numel() for p in Wide(args.width).parameters())
    print(
        f"model: {params / 1e6:.1f} M parameters ({params * 4 / 2**20:.0f} MiB, and as much "
        f"momentum); {args.saves} saves, every {args.every} steps"
    )
    if args.outage:
        found = s3_server()
        if found is None:
            print("store down: skipped (needs moto, s3fs and boto3: pip install 'loopbus[test]')")
            return
        server, url = found
        c = args.call_s
        deadlines = StoreDeadlines(connect_s=c, read_s=c, call_s=c, save_wait_s=args.save_wait_s)
        print(
            f"store down: refusing with the default deadlines; stalling with call_s={c:g} s "
            f"(connect, read too), save_wait_s={args.save_wait_s:g} s"
        )
        try:
            store_down(url, args.outage_width, args.outage_steps, deadlines, args.repeats)
        finally:
            server.stop()
        return
    if args.stall:
        found = s3_server()
        if found is None:
            print(
                "stalled store: skipped (needs moto, s3fs and boto3: pip install 'loopbus[test]')"
            )
            return
        server, url = found
        c = args.call_s
        deadlines = StoreDeadlines(connect_s=c, read_s=c, call_s=c, save_wait_s=args.save_wait_s)
        print(f"deadlines: call_s={c:g} s (connect, read too), save_wait_s={args.save_wait_s:g} s")
        try:
            stalled_store(url, args.width, args.saves, args.every, deadlines)
        finally:
            server.stop()
        return
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
        print(
            "      remote save: skipped (needs moto, s3fs and boto3: pip install 'loopbus[test]')"
        )
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
