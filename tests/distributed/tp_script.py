"""Tensor-parallel scenarios that ``tests/distributed/test_model_parallel.py`` launches under
``torchrun`` (gloo, CPU): a tiny Llama-style model (RMSNorm, causal attention, a SwiGLU
MLP, no bias) whose ``configure_model`` applies tensor and sequence parallelism on
``mesh["tp"]``, under ``ModelParallelStrategy``. Each scenario writes a JSON summary per
rank to ``--out``.

* ``train``: one epoch on a mesh (``--tp``, ``--dp-shard``, ``--dp-replicate``) with
  gradient clipping, against a hand-written one-process loop on the same global batches
  (every rank runs it, without the process group); the samples each rank read; with
  ``--save``, a checkpoint of the end of the epoch and (rank 0) its full weights and
  optimizer state.
* ``resume``: one more epoch from ``--ckpt`` on the mesh (or under ``--strategy fsdp``,
  or in one process, where the checkpoint is also consolidated into one file); the full
  weights and optimizer state once loaded, before training.
* ``meta``: the model built on the ``meta`` device against one built normally with the
  same seed.
* ``refusals``: a loader sharded over the whole world, a module split on meta.
* ``job``: ``--epochs`` epochs of ``--n-train`` shuffled samples on a mesh with a
  ``Checkpoint`` plugin (sharded, every ``--every`` steps, all kept), resumed from
  ``last`` in ``--ckpt-dir`` with ``--resume`` or from ``--ckpt``; every rank appends the
  samples of each batch it trains to ``samples_rank<R>.jsonl`` as it goes. ``--kill-at``
  SIGKILLs every rank after that step; ``--wait-at`` holds rank 0 in that step's batch
  (writing ``ready``) until the preemption signal the test sends has asked for a stop. A
  run that ends writes its full weights and optimizer state (rank 0, ``final.pt``); a
  preempted one writes ``preempted_rank<R>.json`` and exits with the signal's status.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import loopbus
from loopbus import (
    FSDPStrategy,
    MisconfigurationError,
    ModelParallelStrategy,
    Module,
    Plugin,
    Trainer,
    on,
)
from loopbus.events import TrainBatchCompleted, TrainEpochStarted
from loopbus.plugins import Checkpoint

VOCAB = 32
SEQ = 16
DIM = 32
HEADS = 4
HIDDEN = 64
N_TRAIN = 256
GLOBAL_BATCH = 16
CLIP = 0.5


class Attention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq = torch.nn.Linear(DIM, DIM, bias=False)
        self.wk = torch.nn.Linear(DIM, DIM, bias=False)
        self.wv = torch.nn.Linear(DIM, DIM, bias=False)
        self.wo = torch.nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Under tensor parallelism each rank holds HEADS / tp heads: -1 counts them.
        q, k, v = (
            w(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(a.transpose(1, 2).reshape(b, t, -1))  # type: ignore[no-any-return]


class FeedForward(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = torch.nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = torch.nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # type: ignore[no-any-return]


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = torch.nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = torch.nn.RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))  # type: ignore[no-any-return]


class Scale(torch.nn.Module):
    """A learned scale of the logits, left whole on the ``tp`` ranks (FSDP shards it over
    the data-parallel ones only): its gradient lives on another mesh than the others'."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        torch.nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def tensor_parallel(model: torch.nn.Module, tp_mesh: Any) -> None:
    """torchtitan's plan for Llama: tensor and sequence parallelism on ``tp_mesh``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    parallelize_module(
        model,
        tp_mesh,
        {
            "tok": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    for block in cast(Any, model).layers:
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )


class TinyLlama(Module):
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.norm = torch.nn.RMSNorm(DIM)
        self.output = torch.nn.Linear(DIM, VOCAB, bias=False)
        self.scale = Scale()
        self.lr = lr
        self.losses: list[torch.Tensor] = []
        self.samples: list[list[int]] = []
        self.initial: dict[str, Any] | None = None
        self.mesh_seen: Any = None
        #: ``job``: where each batch's samples are appended, and the step whose batch
        #: waits (rank 0, after writing ``ready``) for a preemption signal.
        self.record: Path | None = None
        self.wait_at: int | None = None
        self.ready = Path("ready")

    def configure_model(self, mesh: Any) -> None:
        self.mesh_seen = mesh
        tensor_parallel(self, mesh["tp"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x)
        for block in self.layers:
            h = block(h)
        return self.scale(self.output(self.norm(h)))  # type: ignore[no-any-return]

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch[0], batch[1]
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        self.samples.append([int(i) for i in batch[2]])
        trainer = self.trainer
        if self.record is not None:
            entry = {"epoch": trainer.current_epoch, "step": trainer.global_step}
            with self.record.open("a") as f:  # closed at once: a SIGKILL loses nothing
                f.write(json.dumps({**entry, "idx": self.samples[-1]}) + "\n")
        if self.wait_at == trainer.global_step and trainer.is_global_zero:
            self.ready.write_text(str(trainer.global_step))
            state, deadline = trainer.state, time.monotonic() + 120
            while time.monotonic() < deadline and not (
                state.stop_requested or state.pending_stop is not None
            ):
                time.sleep(0.005)
        loss = self.loss(batch)
        self.losses.append(loss.detach())
        return loss

    @on(TrainEpochStarted)
    def _keep_initial(self, event: TrainEpochStarted) -> None:
        # On every rank (gathering the full state is a collective): what the stage
        # starts from, after a checkpoint loaded.
        # The optimizer's only once it has state: torch's get_optimizer_state_dict steps
        # an optimizer without state (zero gradients) to make it.
        if self.initial is None:
            optimizer = self.trainer.optimizers[0]
            self.initial = full_state(self, optimizer if optimizer.state else None)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def data(n: int = N_TRAIN, seed: int = 0) -> TensorDataset:
    """Arithmetic sequences mod VOCAB, and each sample's index."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return TensorDataset(seq[:, :-1], seq[:, 1:], torch.arange(n))


def full_state(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """The full (unsharded) weights and, with ``optimizer``, its state by parameter name,
    on every rank."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    weights = get_model_state_dict(module, options=options)
    out: dict[str, Any] = {"model": {k: cast(torch.Tensor, v).clone() for k, v in weights.items()}}
    if optimizer is not None:
        state = get_optimizer_state_dict(module, optimizer, options=options)["state"]
        out["optim"] = {
            name: {k: torch.as_tensor(v).clone() for k, v in entry.items()}
            for name, entry in cast(dict[str, dict[str, Any]], state).items()
        }
    return out


@functools.cache
def reference(clip: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The one-process run: the model built normally with seed 0, AdamW, the global
    batches in order, ``clip_grad_norm_`` (no process group is touched). The same for
    every scenario of a launch: run once per clip value, read-only for the callers."""
    loopbus.seed_everything(0)
    model = TinyLlama()
    opt = torch.optim.AdamW(model.parameters(), lr=model.lr)
    losses = []
    for batch in DataLoader(data(), batch_size=GLOBAL_BATCH, shuffle=False):
        loss = model.loss(batch)
        loss.backward()  # type: ignore[no-untyped-call]
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def strategy_of(args: argparse.Namespace) -> Any:
    if args.strategy == "fsdp":
        return FSDPStrategy()
    if args.strategy == "single":
        return "single"
    return ModelParallelStrategy(
        tp=args.tp,
        dp_shard=args.dp_shard,
        dp_replicate=args.dp_replicate,
        units=[Block] if args.ac else None,
        activation_checkpointing=args.ac,
    )


def trainer(strategy: Any, **options: Any) -> Trainer:
    return Trainer(max_epochs=1, strategy=strategy, plugins=[], num_sanity_val_steps=0, **options)


def mean_over_data_parallel(values: list[torch.Tensor], t: Trainer) -> list[float]:
    """The losses of the global batches: each rank's averaged over every rank (the tp
    peers of a replica have the same loss, so that is the mean over the replicas)."""
    stacked = torch.stack([v.float() for v in values])
    if dist.is_initialized():
        dist.all_reduce(stacked)
        stacked /= dist.get_world_size()
    return [float(v) for v in stacked]


def scenario_train(args: argparse.Namespace) -> dict[str, Any]:
    loopbus.seed_everything(0)
    module = TinyLlama()
    t = trainer(strategy_of(args), gradient_clip_val=args.clip, precision=args.precision)
    batch = GLOBAL_BATCH // t.strategy.data_parallel_size
    loopbus.run(t.fit, module, DataLoader(data(), batch_size=batch, shuffle=False))
    state = full_state(module, t.optimizers[0])
    out = Path(args.out)
    if args.save:
        t.save_checkpoint(out / "ckpt")
        if rank() == 0:
            torch.save(state, out / "saved.pt")
    losses = mean_over_data_parallel(module.losses, t)
    ref_losses, ref_weights = reference(args.clip)
    unclipped, _ = reference(1e9)
    weights = state["model"]
    mesh = getattr(t.strategy, "mesh", None)
    return {
        "step": t.global_step,
        "mesh": None if mesh is None else [list(mesh.mesh_dim_names), list(mesh.shape)],
        "mesh_seen": mesh is not None and module.mesh_seen is mesh,
        "data_parallel": [t.strategy.data_parallel_size, t.strategy.data_parallel_rank],
        "losses": losses,
        "reference_losses": ref_losses,
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True)),
        "max_weight_diff": max(float((weights[k] - ref_weights[k]).abs().max()) for k in weights),
        "keys_match": sorted(weights) == sorted(ref_weights),
        "unclipped_loss_diff": max(abs(a - b) for a, b in zip(losses, unclipped, strict=True)),
        "samples": module.samples,
        "param_types": sorted({type(p).__name__ for p in module.parameters()}),
        "param_dtypes": sorted({str(p.dtype) for p in module.parameters()}),
        "checkpointed": sum(_checkpointed(m) for m in module.modules()),
    }


def _checkpointed(module: torch.nn.Module) -> bool:
    """Whether activation checkpointing (torch's composable ``checkpoint``) is on."""
    from torch.distributed._composable.checkpoint_activation import checkpoint

    return checkpoint.state(module) is not None


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a.keys() != b.keys():
        return False
    return all(_same(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(a[k], b[k]) for k in a)


def scenario_resume(args: argparse.Namespace) -> dict[str, Any]:
    """Resume the saved end of the epoch for one more epoch on this layout: the state
    loaded (read at the next epoch's start) against the saved one."""
    ckpt = Path(args.ckpt) if args.ckpt else Path(args.out).parent / "train" / "ckpt"
    saved = torch.load(ckpt.parent / "saved.pt", weights_only=True)
    consolidated = None
    if args.strategy == "single":  # the shards read in one process, into one file
        file = loopbus.consolidate_checkpoint(ckpt, Path(args.out) / "consolidated.ckpt")
        consolidated = torch.load(file, weights_only=True)["module"]
    loopbus.seed_everything(1)  # other initial weights
    module = TinyLlama()
    t = Trainer(max_epochs=2, strategy=strategy_of(args), plugins=[], num_sanity_val_steps=0)
    batch = GLOBAL_BATCH // t.strategy.data_parallel_size
    loader = DataLoader(data(), batch_size=batch, shuffle=False)
    loopbus.run(t.fit, module, loader, ckpt_path=ckpt)
    loaded = module.initial or {}
    return {
        "step": t.global_step,
        "weights_equal": _same(loaded.get("model", {}), saved["model"]),
        "optimizer_equal": _same(loaded.get("optim", {}), saved["optim"]),
        "optimizer_entries": len(loaded.get("optim", {})),
        "consolidated_equal": consolidated is None or _same(consolidated, saved["model"]),
        "losses": [float(v) for v in module.losses],
    }


def scenario_meta(args: argparse.Namespace) -> dict[str, Any]:
    loopbus.seed_everything(0)
    expected = TinyLlama().state_dict()
    loopbus.seed_everything(0)
    with torch.device("meta"):
        module = TinyLlama()
    t = trainer(strategy_of(args))
    loopbus.run(t.fit, module, DataLoader(data(32), batch_size=4, shuffle=False))
    initial = (module.initial or {}).get("model", {})
    return {
        "keys_match": sorted(initial) == sorted(expected),
        "equal_at_start": all(torch.equal(initial[k], expected[k]) for k in expected),
        "meta_left": any(p.is_meta for p in module.parameters()),
        "losses": [float(v) for v in module.losses],
    }


class KillAt(Plugin):
    """SIGKILLs this rank after optimizer step ``step`` (every rank does: torchrun starts
    its workers in sessions of their own, so a signal to the launcher would not reach
    them)."""

    def __init__(self, step: int) -> None:
        self.step = step

    @on(TrainBatchCompleted)
    def _batch(self, event: TrainBatchCompleted) -> None:
        if event.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def scenario_job(args: argparse.Namespace) -> dict[str, Any]:
    """A run with periodic sharded checkpoints, interrupted or resumed (module doc)."""
    out = Path(args.out)
    ckpt_dir = out.parent / args.ckpt_dir if args.ckpt_dir else out / "ckpt"
    ckpt_path: Any = None
    if args.resume:
        ckpt_path = "last"
    elif args.ckpt:
        ckpt_path = out.parent / args.ckpt  # relative to the scenarios' root
    loopbus.seed_everything(0)
    module = TinyLlama()
    module.record = out / f"samples_rank{rank()}.jsonl"
    module.wait_at, module.ready = args.wait_at, out / "ready"
    plugins: list[Plugin] = [
        Checkpoint(ckpt_dir, every_n_steps=args.every, keep_last=None, background=False)
    ]
    if args.kill_at >= 0:
        plugins.append(KillAt(args.kill_at))
    options: dict[str, Any] = {"gradient_clip_val": args.clip}
    if args.stop_check_interval is not None:
        options["stop_check_interval_s"] = args.stop_check_interval
    t = Trainer(
        max_epochs=args.epochs,
        strategy=strategy_of(args),
        plugins=plugins,
        num_sanity_val_steps=0,
        **options,
    )
    batch = GLOBAL_BATCH // t.strategy.data_parallel_size
    loader = DataLoader(data(args.n_train), batch_size=batch, shuffle=True)
    try:
        loopbus.run(t.fit, module, loader, ckpt_path=ckpt_path)
    except loopbus.Preempted as exc:
        report = {"code": exc.code, "signal": exc.signal, "step": exc.step}
        (out / f"preempted_rank{rank()}.json").write_text(json.dumps(report))
        raise
    state = full_state(module, t.optimizers[0])
    if rank() == 0:
        torch.save(state, out / "final.pt")
    return {
        "step": t.global_step,
        "data_parallel": [t.strategy.data_parallel_size, t.strategy.data_parallel_rank],
    }


def _message(fn: Any, error: type[Exception]) -> str:
    try:
        fn()
    except error as exc:
        return str(exc)
    return "not raised"


def scenario_refusals(args: argparse.Namespace) -> dict[str, Any]:
    dataset = data(32)
    whole_world = DataLoader(dataset, batch_size=4, sampler=DistributedSampler(dataset))

    def fit(module: Module, loader: Any) -> None:
        loopbus.run(trainer(strategy_of(args)).fit, module, loader)

    def split_on_meta() -> Module:
        from torch.distributed.device_mesh import init_device_mesh

        with torch.device("meta"):
            module = TinyLlama()
        tp_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]
        tensor_parallel(module, tp_mesh)
        return module

    return {
        "whole_world_sampler": _message(
            lambda: fit(TinyLlama(), whole_world), MisconfigurationError
        ),
        "split_on_meta": _message(
            lambda: fit(split_on_meta(), DataLoader(dataset, batch_size=4)),
            MisconfigurationError,
        ),
    }


SCENARIOS = {
    "train": scenario_train,
    "resume": scenario_resume,
    "meta": scenario_meta,
    "refusals": scenario_refusals,
    "job": scenario_job,
}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="train")
    parser.add_argument("--strategy", default="tp", choices=["tp", "fsdp", "single"])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp-shard", type=int, default=-1)
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--clip", type=float, default=CLIP)
    parser.add_argument(
        "--ckpt",
        default="",
        help="the checkpoint to resume (job: relative to --out's parent); resume's default: "
        "the train scenario's beside --out",
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--n-train", type=int, default=N_TRAIN, help="job: samples an epoch")
    parser.add_argument("--every", type=int, default=4, help="job: a checkpoint every N steps")
    parser.add_argument("--ckpt-dir", default="", help="job: relative to --out's parent")
    parser.add_argument("--resume", action="store_true", help="job: ckpt_path='last'")
    parser.add_argument("--kill-at", type=int, default=-1, help="job: SIGKILL after that step")
    parser.add_argument("--wait-at", type=int, default=None, help="job: hold that step's batch")
    parser.add_argument("--stop-check-interval", type=float, default=None)
    parser.add_argument("--ac", action="store_true", help="activation checkpointing of Block")
    parser.add_argument("--precision", default="32")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    summary = SCENARIOS[args.scenario](args)
    (out / f"{args.scenario}_rank{rank()}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
