"""A training run that checkpoints to an S3 server, as a process of its own, for the
remote kill and preemption tests::

    python -m tests.storage._remote_kill_script --endpoint http://127.0.0.1:PORT \\
        --url s3://BUCKET/run --out final.pt [--wait-at EPOCH:BATCH --ready FILE]

The run is the checkpoint tests' scenario (``tests/ckpt_scenario.py``: an MLP
with dropout, SGD with momentum, a per-epoch StepLR) over torchdata's
StatefulDataLoader, so that a resume mid-epoch replays nothing. It patches nothing in
loopbus: the kill test ends it from outside (at a chosen request to the server). With
``--wait-at`` the training step of that batch writes ``--ready`` and waits until the
trainer was asked to stop, so that the preemption test's signal lands at a known batch.
A run that ends writes its final weights and optimizer state to ``--out``; one that is
preempted exits with the status ``loopbus.Preempted`` carries.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

import loopbus
from loopbus import Plugin, Trainer
from loopbus.plugins import Checkpoint
from tests.ckpt_scenario import SEED, Net, make_data
from tests.storage.conftest import options_for

EPOCHS = 2
PER_EPOCH = 40  # make_data's 320 samples, batches of 8
EVERY_N_STEPS = 6


class Waiting(Net):
    """The scenario's MLP; the training step of batch ``wait_at`` (epoch, batch) writes
    ``ready`` and waits until the trainer was asked to stop."""

    def __init__(self, wait_at: tuple[int, int] | None = None, ready: Path | None = None) -> None:
        super().__init__()
        self.wait_at = wait_at
        self.ready = ready

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        loss = super().training_step(batch, ctx)
        trainer = self.trainer
        if self.wait_at == (trainer.current_epoch, ctx.batch_idx) and self.ready is not None:
            self.ready.write_text(str(trainer.global_step))
            state = trainer.state
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (
                state.stop_requested or state.pending_stop is not None
            ):
                time.sleep(0.002)
        return loss


def build(
    url: str | None,
    options: dict[str, Any] | None,
    *,
    wait_at: tuple[int, int] | None = None,
    ready: Path | None = None,
    sharded: bool = False,
) -> tuple[Trainer, Waiting, Any]:
    """The trainer (with ``Checkpoint(url)`` every ``EVERY_N_STEPS`` steps, keeping the
    last two, ``sharded`` or files; none without a URL), the module and the training
    data, seeded."""
    loopbus.seed_everything(SEED)
    module = Waiting(wait_at, ready)
    train, _ = make_data("stateful")
    plugins: list[Plugin] = []
    if url is not None:
        plugins.append(
            Checkpoint(
                url,
                storage_options=options,
                every_n_steps=EVERY_N_STEPS,
                keep_last=2,
                sharded=sharded,
            )
        )
    trainer = Trainer(
        max_epochs=EPOCHS, plugins=plugins, device="cpu", enable_model_summary=False
    )
    return trainer, module, train


def final_state(trainer: Trainer, module: Net) -> dict[str, Any]:
    return {
        "module": module.state_dict(),
        "optimizer": trainer.optimizers[0].state_dict(),
        "global_step": trainer.global_step,
    }


def assert_same_final(resumed: dict[str, Any], reference: dict[str, Any], where: str = "") -> None:
    """A resumed run's :func:`final_state` is the uninterrupted run's, bit for bit (after
    as many steps, the same weights, momentum buffers and parameter groups)."""
    assert resumed["global_step"] == reference["global_step"] == EPOCHS * PER_EPOCH
    for name, tensor in reference["module"].items():
        assert torch.equal(resumed["module"][name], tensor), f"weight {name!r} differs {where}"
    for index, state in reference["optimizer"]["state"].items():
        assert torch.equal(
            resumed["optimizer"]["state"][index]["momentum_buffer"], state["momentum_buffer"]
        ), f"momentum buffer {index} differs {where}"
    assert resumed["optimizer"]["param_groups"] == reference["optimizer"]["param_groups"]


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--endpoint", required=True, help="the S3 server, http://host:port")
    parser.add_argument("--url", required=True, help="the checkpoints' URL, s3://bucket/run")
    parser.add_argument("--out", required=True)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument("--wait-at", default="", help="EPOCH:BATCH")
    parser.add_argument("--ready", default=None)
    parser.add_argument("--sharded", action="store_true", help="sharded checkpoints")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    wait_at = None
    if args.wait_at:
        epoch, batch = args.wait_at.split(":")
        wait_at = (int(epoch), int(batch))
    ready = Path(args.ready) if args.ready else None
    trainer, module, train = build(
        args.url, options_for(args.endpoint), wait_at=wait_at, ready=ready, sharded=args.sharded
    )
    loopbus.run(trainer.fit, module, train, backend=args.backend)
    torch.save(final_state(trainer, module), args.out)


if __name__ == "__main__":
    main(sys.argv[1:])
