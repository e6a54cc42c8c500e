"""Fault tolerance (``strategy="ft"``, torchft): what the commit protocol costs per step
against plain DDP on the same work, and how long a lost replica group takes from its
restart to its first committed step.

Work: an MLP (32 -> H -> H -> 10, H = ``--hidden``), batch 32 per process, SGD, ``put``
of the loss every step, no plugins, 2 processes (gloo, CPU, one torch thread each):

* **DDP**: ``Trainer(strategy="ddp")``, the 2 processes launched under
  ``torch.distributed.run``;
* **ft**: 2 replica groups of one process each, ``Trainer(strategy=FaultTolerantStrategy
  (...))``, coordinated by a Lighthouse started in this process (quorum tick
  ``--quorum-tick-ms``). Per step: a quorum through the Lighthouse, the gradients
  averaged by the manager's all-reduce, ``should_commit``.

With ``--group-size 2`` (HSDP) the same work runs on 4 processes: **FSDP** over all 4
(``strategy="fsdp"``, one ``torch.distributed.run``) against 2 replica groups of 2 FSDP2
processes, each group its own ``torch.distributed.run`` (``--max-restarts=1``).

Each worker notes the time at the start of every training batch (``TrainBatchStarted``);
the figure per run is the median step time of its steps after the first 20, median over
the processes. The ratio is ft over DDP, both measured in this one run.

Then the restart: a run of 2 groups in which group 1 SIGKILLs itself at its 30th step and is
restarted at once; printed are the time from the restart (the new process spawned) to
its first committed step, and how that splits into the interpreter, the imports and
the trainer's start, and the quorum with its healing (the state of the live group fetched
over HTTP) plus the first step. With ``--group-size 2`` group 1's rank 1 dies and its
``torch.distributed.run`` restarts the group: the time is counted from the death, so it
includes the launcher noticing it and stopping the group's other process.

    python benchmarks/ft.py                       # defaults below
    python benchmarks/ft.py --steps 400 --hidden 256
    python benchmarks/ft.py --group-size 2            # HSDP: groups of 2 FSDP2 processes
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _harness import launch_env, torchrun

HERE = Path(__file__).resolve()
SRC = str(HERE.parents[1] / "src")


def _worker(args: argparse.Namespace) -> None:
    t_main = time.time()
    import torch
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    import loopbus
    from loopbus import Module, Plugin, Trainer, on
    from loopbus.distributed import FaultTolerantStrategy
    from loopbus.events import FitStarted, TrainBatchCompleted, TrainBatchStarted

    torch.set_num_threads(1)
    h = args.hidden

    class Net(Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(32, h),
                torch.nn.ReLU(),
                torch.nn.Linear(h, h),
                torch.nn.ReLU(),
                torch.nn.Linear(h, 10),
            )

        def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.put("loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class Clock(Plugin):
        def __init__(self) -> None:
            self.starts: list[float] = []
            self.fit_started = 0.0
            self.first_commit = 0.0

        @on(FitStarted)
        def _fit(self, event: Any) -> None:
            self.fit_started = time.time()

        @on(TrainBatchStarted)
        def _batch(self, event: Any) -> None:
            self.starts.append(time.perf_counter())
            if args.kill_at and len(self.starts) == args.kill_at:  # its own 30th step
                first = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0")
                if first and os.environ.get("RANK", "0") == str(args.kill_rank):
                    Path(args.out + ".died").write_text(str(time.time()))
                    os.kill(os.getpid(), signal.SIGKILL)

        @on(TrainBatchCompleted)
        def _done(self, event: Any) -> None:
            if not self.first_commit:
                self.first_commit = time.time()

    g = torch.Generator().manual_seed(0)
    groups = 2 if args.mode == "ft" else 1
    n = 32 * args.steps * groups * args.group_size
    data = DataLoader(
        TensorDataset(torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g)),
        batch_size=32,
        shuffle=True,
    )
    clock = Clock()
    if args.mode == "ft":
        strategy: Any = FaultTolerantStrategy(replica_groups=2, min_replicas=1, timeout_s=10)
    else:
        strategy = args.mode  # "ddp", or "fsdp" over every process
    trainer = Trainer(
        max_epochs=1,
        max_steps=args.steps,
        plugins=[clock],
        strategy=strategy,
        enable_model_summary=False,
    )
    loopbus.run(trainer.fit, Net(), data)
    steps = [b - a for a, b in zip(clock.starts, clock.starts[1:], strict=False)][20:]
    out = {
        "median_step_s": statistics.median(steps) if steps else None,
        "steps": trainer.global_step,
        "t_main": t_main,
        "fit_started": clock.fit_started,
        "first_commit": clock.first_commit,
    }
    Path(args.out).write_text(json.dumps(out))
    if args.mode == "ft":
        strategy.close()


def _ft_run(args: argparse.Namespace, tmp: Path, kill: bool) -> tuple[list[dict[str, Any]], float]:
    """2 replica groups; with ``kill``, group 1 dies at its 30th step and is restarted at
    once. The groups' results and when the (last) group 1 was spawned."""
    sys.path.insert(0, SRC)
    os.environ["RUST_LOG"] = "error"
    import loopbus.distributed._ft as ft

    # Without a kill every quorum has both groups (the steady state measured); with one,
    # a quorum forms with the survivor alone, which keeps training.
    lighthouse = ft.serve_lighthouse(
        "[::]:0",
        min_replicas=1 if kill else 2,
        join_timeout_ms=300,
        quorum_tick_ms=args.quorum_tick_ms,
        heartbeat_timeout_ms=1000,
    )
    env = launch_env(SRC)
    env.update(TORCHFT_LIGHTHOUSE=lighthouse.address(), RUST_LOG="error")

    def spawn(group: int, *extra: str, restarted: bool = False) -> subprocess.Popen[bytes]:
        genv = dict(env, REPLICA_GROUP_ID=str(group))
        if restarted:
            genv["TORCHELASTIC_RESTART_COUNT"] = "1"
        steps = args.restart_steps if kill else args.steps
        size = args.group_size
        launcher = [sys.executable] if size == 1 else [*torchrun(size), "--max-restarts=1"]
        cmd = [
            *launcher,
            str(HERE),
            "--worker",
            "--mode",
            "ft",
            "--out",
            str(tmp / (f"ft-{group}.json" if size == 1 else f"ft-{group}.RANK.json")),
            "--steps",
            str(steps),
            "--hidden",
            str(args.hidden),
            "--group-size",
            str(size),
            *extra,
        ]
        with open(tmp / f"ft-{group}.log", "ab") as log:
            return subprocess.Popen(cmd, env=genv, stdout=log, stderr=subprocess.STDOUT)

    try:
        procs = [spawn(0)]
        if kill:
            time.sleep(1.0)  # group 0 first: it trains from step 0, group 1 joins it
        kill_rank = "1" if args.group_size > 1 else "0"
        procs.append(spawn(1, *(["--kill-at", "30", "--kill-rank", kill_rank] if kill else [])))
        spawned = 0.0
        if kill and args.group_size == 1:
            procs[1].wait(timeout=300)
            spawned = time.time()
            procs[1] = spawn(1, restarted=True)
        for p in procs:
            if p.wait(timeout=600) != 0:
                logs = [(tmp / f"ft-{g}.log").read_text()[-2000:] for g in (0, 1)]
                raise SystemExit(f"a replica group failed ({p.args}):\n" + "\n".join(logs))
    finally:
        lighthouse.shutdown()
    if args.group_size > 1:  # rank 0 of each group; group 1's, restarted by its launcher
        if kill:
            spawned = float((tmp / "ft-1.1.json.died").read_text())
        return [json.loads((tmp / f"ft-{g}.0.json").read_text()) for g in (0, 1)], spawned
    return [json.loads((tmp / f"ft-{g}.json").read_text()) for g in (0, 1)], spawned


def _ddp_run(args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    """The baseline: DDP over 2 processes, or FSDP over 4 with ``--group-size 2``."""
    mode, world = ("ddp", 2) if args.group_size == 1 else ("fsdp", 2 * args.group_size)
    cmd = [
        *torchrun(world),
        str(HERE),
        "--worker",
        "--mode",
        mode,
        "--out",
        str(tmp / f"{mode}-RANK.json"),
        "--steps",
        str(args.steps),
        "--hidden",
        str(args.hidden),
    ]
    subprocess.run(
        cmd, env=launch_env(SRC), check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    return [json.loads((tmp / f"{mode}-{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
    parser.add_argument(
        "--restart-steps",
        type=int,
        default=1500,
        help="steps of the restart run: enough for the survivor to outlast the restart",
    )
    parser.add_argument("--hidden", type=int, default=64, help="MLP width (default 64)")
    parser.add_argument(
        "--quorum-tick-ms", type=int, default=20, help="Lighthouse tick (default 20)"
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=1,
        choices=(1, 2),
        help="processes per replica group: 2 is HSDP, against FSDP over 4 (default 1)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("ft", "ddp", "fsdp"), help=argparse.SUPPRESS)
    parser.add_argument("--kill-rank", default="0", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--kill-at", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if "RANK" in args.out:
            args.out = args.out.replace("RANK", os.environ["RANK"])
        _worker(args)
        return
    import torch

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        started = time.time()
        ddp = _ddp_run(args, tmp)
        ft, _ = _ft_run(args, tmp, kill=False)
        compared = time.time()
        restarted, spawned = _ft_run(args, tmp, kill=True)
        print(f"(runs: {compared - started:.0f} s and {time.time() - compared:.0f} s)")
    base = "DDP" if args.group_size == 1 else "FSDP"
    world = 2 * args.group_size
    ddp_s = statistics.median(r["median_step_s"] for r in ddp)
    ft_s = statistics.median(r["median_step_s"] for r in ft)
    shape = "" if args.group_size == 1 else f" (2 groups of {args.group_size}, HSDP)"
    print(
        f"python {sys.version.split()[0]}, torch {torch.__version__}, {world} processes{shape}, "
        f"gloo, one torch thread each, MLP 32-{args.hidden}-{args.hidden}-10, batch 32, "
        f"{args.steps} steps, quorum tick {args.quorum_tick_ms} ms, {os.cpu_count()} cores"
    )
    print(
        f"median step: {base} {ddp_s * 1e3:.2f} ms, ft {ft_s * 1e3:.2f} ms, "
        f"ratio ft/{base} {ft_s / ddp_s:.2f}"
    )
    new = restarted[1]
    print(
        f"{'restart' if args.group_size == 1 else 'death'} to first committed step: "
        f"{new['first_commit'] - spawned:.2f} s "
        f"({'interpreter' if args.group_size == 1 else 'launcher restart, interpreter'} "
        f"{new['t_main'] - spawned:.2f} s, imports and trainer start "
        f"{new['fit_started'] - new['t_main']:.2f} s, quorum + healing + first step "
        f"{new['first_commit'] - new['fit_started']:.2f} s); both groups ended at step "
        f"{restarted[0]['steps']} / {new['steps']}"
    )


if __name__ == "__main__":
    main()
