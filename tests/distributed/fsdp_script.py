"""FSDP scenarios that ``tests/distributed/test_fsdp.py`` launches under ``torchrun`` (2 ranks, gloo,
CPU), and runs in one process for the single-process reference. Each writes a JSON
summary per rank to ``--out``.

* ``train``: a small transformer language model (token and position embeddings, two
  blocks of causal self-attention and MLP with LayerNorm, a head) trains with
  ``Trainer(strategy=...)``; the summary holds the loss of every step (averaged over the
  ranks: the loss of the global batch), the bytes of parameters and optimizer state held
  locally and in all, and a validation loss computed after training.
* ``accumulate``: the same model trained with ``accumulate_grad_batches`` and gradient
  clipping under FSDP, then by a hand-written FSDP2 loop that accumulates by hand
  (``set_requires_gradient_sync(False)`` on the non-final micro-batches); the summary
  says whether the two end with identical weights.
* ``meta``: the model built on the ``meta`` device, materialised and sharded by the
  strategy, against one built normally with the same seed; then it trains.
* ``refusals``: what FSDP refuses, with the messages.
* ``checkpoints``: ``save_checkpoint`` under FSDP (a sharded directory), its weights
  loaded by ``validate(ckpt_path=...)`` and resumed with other shard units; a sharded
  checkpoint taken under DDP resumed under FSDP; a file checkpoint's weights loaded and
  its resume refused.
* ``stop``: a stop asked on one rank stops both at the same step; a logger writes on
  rank 0 only.

Every scenario also writes, once the process's other exit handlers have run (the
trainer's leaves the process group), which gloo threads are still alive
(``<scenario>_rank<N>_exit.json``; ``null`` where the platform does not list threads).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import loopbus
from loopbus import (
    CheckpointError,
    FSDPStrategy,
    MisconfigurationError,
    Module,
    Plugin,
    Trainer,
    on,
)
from loopbus.events import TrainBatchCompleted, TrainEpochStarted
from loopbus.plugins import Checkpoint, CSVLogger

VOCAB = 32
SEQ = 16
DIM = 32
HEADS = 4
N_TRAIN = 512
N_VAL = 64
#: The dtypes the blocks' weights had in their forward (FSDP casts the gathered ones).
SEEN_DTYPES: set[str] = set()


class Block(torch.nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(DIM)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.proj = torch.nn.Linear(DIM, DIM)
        self.ln2 = torch.nn.LayerNorm(DIM)
        self.fc1 = torch.nn.Linear(DIM, 4 * DIM)
        self.fc2 = torch.nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        SEEN_DTYPES.add(str(self.qkv.weight.dtype))
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, HEADS, d // HEADS).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))  # type: ignore[no-any-return]


class TinyLM(Module):
    def __init__(self, lr: float = 3e-3) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(VOCAB, DIM)
        self.pos = torch.nn.Embedding(SEQ, DIM)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.ln_f = torch.nn.LayerNorm(DIM)
        self.head = torch.nn.Linear(DIM, VOCAB)
        self.lr = lr
        self.losses: list[torch.Tensor] = []
        self.val_losses: list[torch.Tensor] = []
        self.initial: dict[str, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.shape[1], device=x.device)
        h = self.tok(x) + self.pos(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))  # type: ignore[no-any-return]

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        loss = self.loss(batch)
        self.losses.append(loss.detach())
        return loss

    def validation_step(self, batch: Any, ctx: Any) -> None:
        self.val_losses.append(self.loss(batch))

    @on(TrainEpochStarted)
    def _keep_initial(self, event: TrainEpochStarted) -> None:
        # On every rank (gathering the full state dict is a collective).
        if self.initial is None:
            self.initial = full_state(self)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class ManualLM(TinyLM):
    automatic_optimization = False


class NoReset(torch.nn.Module):
    """A layer whose parameter is made in ``__init__`` with no ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(DIM))


class LMWithNoReset(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.extra = NoReset()


def data(n: int, seed: int) -> TensorDataset:
    """Arithmetic sequences mod VOCAB (random start and stride): the next token follows
    from the last two."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    return TensorDataset(seq[:, :-1], seq[:, 1:])


def full_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) state dict, on every rank."""
    if not dist.is_initialized():
        return {k: v.detach().clone() for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))
    return {k: cast(torch.Tensor, v).detach().clone() for k, v in state.items()}


def local_and_full_bytes(tensors: Sequence[torch.Tensor]) -> tuple[int, int]:
    from torch.distributed.tensor import DTensor

    local = full = 0
    for t in tensors:
        full += t.numel() * t.element_size()
        t_local = t.to_local() if isinstance(t, DTensor) else t
        local += t_local.numel() * t_local.element_size()
    return local, full


def mean_over_ranks(values: list[torch.Tensor]) -> list[float]:
    stacked = torch.stack([v.float() for v in values])
    if dist.is_initialized():
        dist.all_reduce(stacked)
        stacked /= dist.get_world_size()
    return [float(v) for v in stacked]


def trainer(strategy: Any, **options: Any) -> Trainer:
    return Trainer(max_epochs=1, strategy=strategy, plugins=[], num_sanity_val_steps=0, **options)


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def scenario_train(args: argparse.Namespace) -> dict[str, Any]:
    loopbus.seed_everything(0)
    module = TinyLM()
    batch = args.global_batch // world()
    train = DataLoader(data(N_TRAIN, 0), batch_size=batch, shuffle=False)
    strategy: Any = args.strategy
    if args.strategy == "fsdp":
        strategy = FSDPStrategy(
            activation_checkpointing=args.ac, reshard_after_forward=not args.keep_gathered
        )
    t = trainer(strategy, precision=args.precision)
    loopbus.run(t.fit, module, train)
    params = list(module.parameters())
    opt_state = [
        v for state in t.optimizers[0].state.values() for v in state.values() if v.dim() > 0
    ]
    param_local, param_full = local_and_full_bytes(params)
    opt_local, opt_full = local_and_full_bytes(opt_state)
    loopbus.run(t.validate, module, DataLoader(data(N_VAL, 1), batch_size=16))
    losses = mean_over_ranks(module.losses)
    # A new trainer (a new strategy object) with the module as it is: it is not sharded
    # again, and it goes on learning.
    module.losses.clear()
    again = trainer(args.strategy if args.strategy == "single" else FSDPStrategy())
    loopbus.run(again.fit, module, train)
    return {
        "again_step": again.global_step,
        "again_losses": mean_over_ranks(module.losses),
        "strategy": t.strategy.name,
        "world_size": t.world_size,
        "step": t.global_step,
        "losses": losses,
        "val_loss": mean_over_ranks([torch.stack(module.val_losses).mean()])[0],
        "param_bytes": [param_local, param_full],
        "optimizer_bytes": [opt_local, opt_full],
        "param_types": sorted({type(p).__name__ for p in params}),
        "param_dtypes": sorted({str(p.dtype) for p in params}),
        "compute_dtypes": sorted(SEEN_DTYPES),
    }


def hand_written_accumulation(
    dataset: TensorDataset, batch: int, accumulate: int, clip: float
) -> dict[str, torch.Tensor]:
    """FSDP2 by hand: the same units, AdamW made after sharding, accumulation with
    ``set_requires_gradient_sync(False)`` on the non-final micro-batches, the loss divided
    by the window, ``clip_grad_norm_`` over the DTensor gradients."""
    from torch.distributed.fsdp import fully_shard

    loopbus.seed_everything(0)
    model = TinyLM()
    for unit in (model.tok, model.pos, *model.blocks, model.ln_f, model.head):
        fully_shard(unit)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=model.lr)
    loader = DataLoader(
        dataset, batch_size=batch, sampler=DistributedSampler(dataset, shuffle=False)
    )
    model.train()
    for index, micro in enumerate(loader):
        last = (index + 1) % accumulate == 0
        model.set_requires_gradient_sync(last)  # type: ignore[operator]
        loss = model.loss(micro) / accumulate
        loss.backward()  # type: ignore[no-untyped-call]
        if last:
            torch.nn.utils.clip_grad_norm_(list(model.parameters()), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return full_state(model)


def scenario_accumulate(args: argparse.Namespace) -> dict[str, Any]:
    accumulate, clip = 4, 0.05
    dataset = data(N_TRAIN // 2, 0)  # 64 micro-batches of 2 per rank: 16 windows
    loopbus.seed_everything(0)
    module = TinyLM()
    t = trainer("fsdp", accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    loopbus.run(t.fit, module, DataLoader(dataset, batch_size=2, shuffle=False))
    engine = full_state(module)
    hand = hand_written_accumulation(dataset, 2, accumulate, clip)
    diffs = {k: float((engine[k] - hand[k]).abs().max()) for k in engine}
    initial = module.initial or {}
    return {
        "step": t.global_step,
        "identical": all(torch.equal(engine[k], hand[k]) for k in engine)
        and engine.keys() == hand.keys(),
        "max_abs_diff": max(diffs.values()),
        "moved": max(float((engine[k] - initial[k]).abs().max()) for k in engine),
    }


def scenario_meta(args: argparse.Namespace) -> dict[str, Any]:
    loopbus.seed_everything(0)
    expected = TinyLM().state_dict()
    loopbus.seed_everything(0)
    with torch.device("meta"):
        module = TinyLM()
    t = trainer(FSDPStrategy(units=[Block]))
    loopbus.run(t.fit, module, DataLoader(data(N_TRAIN, 0), batch_size=8, shuffle=False))
    initial = module.initial or {}
    return {
        "keys_match": sorted(initial) == sorted(expected),
        "equal_at_start": all(torch.equal(initial[k], expected[k]) for k in expected),
        "losses": mean_over_ranks(module.losses),
        "meta_left": any(p.is_meta for p in module.parameters()),
    }


class StopOnRank1(Plugin):
    """Asks to stop on rank 1 after step 5 (a plugin of every rank)."""

    def setup(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer

    @on(TrainBatchCompleted)
    def _maybe_stop(self, event: TrainBatchCompleted) -> None:
        t = self.trainer
        if t.global_rank == 1 and t.global_step == 5:
            t.request_stop("rank 1 asked at step 5")


def scenario_stop(args: argparse.Namespace) -> dict[str, Any]:
    """A stop asked on rank 1 stops both ranks at one step; a logger acts on rank 0."""
    loopbus.seed_everything(0)
    module = TinyLM()
    rank = int(os.environ.get("RANK", "0"))
    logs = Path(args.out) / f"logs_rank{rank}"
    t = Trainer(
        max_epochs=1,
        strategy="fsdp",
        plugins=[StopOnRank1(), CSVLogger(logs, name="", version="")],
        stop_check_interval_s=0,
    )
    loopbus.run(t.fit, module, DataLoader(data(N_TRAIN, 0), batch_size=8))
    return {
        "step": t.global_step,
        "stop_reason": t.stop_reason,
        "weights": {k: v.sum().item() for k, v in full_state(module).items()},
        "logged": (logs / "metrics.csv").is_file(),
    }


def _message(fn: Any, error: type[Exception]) -> str:
    """The message of the ``error`` that ``fn()`` raises ("not raised": none)."""
    try:
        fn()
    except error as exc:
        return str(exc)
    return "not raised"


def scenario_refusals(args: argparse.Namespace) -> dict[str, Any]:
    train = DataLoader(data(64, 0), batch_size=8)

    def fit(module: Module, strategy: Any = "fsdp", **kwargs: Any) -> None:
        plugins = kwargs.pop("plugins", [])
        options = kwargs.pop("options", {})
        t = Trainer(max_epochs=1, strategy=strategy, plugins=plugins, **options)
        loopbus.run(t.fit, module, train, **kwargs)

    return {
        "manual": _message(lambda: fit(ManualLM()), MisconfigurationError),
        "fp16": _message(
            lambda: fit(TinyLM(), options={"precision": "16-mixed"}), MisconfigurationError
        ),
        "no_unit": _message(
            lambda: fit(TinyLM(), FSDPStrategy(units=[torch.nn.Conv2d])), MisconfigurationError
        ),
        "no_reset": _message(lambda: fit(_on_meta(LMWithNoReset)), MisconfigurationError),
        "stale_optimizer": _message(lambda: fit(_StaleOptimizer()), MisconfigurationError),
    }


def _on_meta(cls: type[Module]) -> Module:
    with torch.device("meta"):
        return cls()


class _StaleOptimizer(TinyLM):
    """Builds its optimizer over parameters captured in ``__init__`` (before sharding)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept = list(self.parameters())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.kept, lr=self.lr)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def scenario_checkpoints(args: argparse.Namespace) -> dict[str, Any]:
    """Checkpoints under FSDP beyond the Checkpoint plugin: save_checkpoint, weights
    loaded by validate(ckpt_path=...), other shard units, a checkpoint taken under DDP,
    a file checkpoint."""
    train = DataLoader(data(64, 0), batch_size=8)
    val = DataLoader(data(16, 1), batch_size=8)
    out = Path(args.out)
    rank = int(os.environ.get("RANK", "0"))
    loopbus.seed_everything(0)
    module = TinyLM()
    t = trainer("fsdp")
    loopbus.run(t.fit, module, train)
    saved = t.save_checkpoint(out / "by-hand")
    state = full_state(module)
    if rank == 0:
        torch.save(state, out / "by-hand-full.pt")
    result: dict[str, Any] = {
        "saved": str(saved),
        "state_dict": _message(t.state_dict, CheckpointError),
    }

    def loaded(strategy: Any, ckpt: Path) -> bool:
        loopbus.seed_everything(1)  # other initial weights
        fresh = TinyLM()
        loopbus.run(trainer(strategy).validate, fresh, val, ckpt_path=ckpt)
        return _same(full_state(fresh), state)

    result["validate"] = loaded("fsdp", saved)
    # Other shard units: the blocks only (the default shards every child).
    result["validate_units"] = loaded(FSDPStrategy(units=[Block]), saved)
    # Resumed for one more epoch with other units: weights and AdamW state load.
    loopbus.seed_everything(1)
    again = TinyLM()
    t2 = Trainer(max_epochs=2, strategy=FSDPStrategy(units=[Block]), plugins=[])
    loopbus.run(t2.fit, again, train, ckpt_path=saved)
    result["resumed_step"] = t2.global_step
    # A checkpoint taken under DDP (sharded) resumes under FSDP.
    loopbus.seed_everything(2)
    ddp_module = TinyLM()
    d = Trainer(
        max_epochs=1,
        strategy="ddp",
        plugins=[Checkpoint(out / "ddp", sharded=True, background=False)],
        num_sanity_val_steps=0,
    )
    loopbus.run(d.fit, ddp_module, train)
    ddp_state = {k: v.detach().clone() for k, v in ddp_module.state_dict().items()}
    ddp_last = loopbus.latest_checkpoint(out / "ddp")
    assert ddp_last is not None
    loopbus.seed_everything(3)
    into = TinyLM()
    t3 = Trainer(
        max_epochs=1,
        strategy="fsdp",
        plugins=[Checkpoint(out / "into", background=False)],  # as the saved run had
        num_sanity_val_steps=0,
    )
    loopbus.run(t3.fit, into, train, ckpt_path=ddp_last)  # at its end: nothing to train
    result["ddp_to_fsdp"] = _same(full_state(into), ddp_state)
    result["ddp_to_fsdp_step"] = t3.global_step
    # A file checkpoint (full tensors, DDP): its weights load, resuming is refused.
    file = d.save_checkpoint(out / "ddp-file.ckpt")
    result["file_weights"] = _same_after(file, val, ddp_state)
    loopbus.seed_everything(3)
    t4 = Trainer(max_epochs=2, strategy="fsdp", plugins=[], num_sanity_val_steps=0)
    result["file_resume"] = _message(
        lambda: loopbus.run(t4.fit, TinyLM(), train, ckpt_path=file), CheckpointError
    )
    return result


def _same_after(file: Path, val: DataLoader[Any], expected: dict[str, torch.Tensor]) -> bool:
    fresh = TinyLM()
    loopbus.run(trainer("fsdp").validate, fresh, val, ckpt_path=file)
    return _same(full_state(fresh), expected)


SCENARIOS = {
    "checkpoints": scenario_checkpoints,
    "train": scenario_train,
    "accumulate": scenario_accumulate,
    "meta": scenario_meta,
    "refusals": scenario_refusals,
    "stop": scenario_stop,
}


def gloo_threads() -> list[str] | None:
    """The names of this process's gloo threads (a process group's workers and its
    transport loop), from ``/proc``; None where there is no ``/proc/self/task``."""
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return None
    names = []
    for task in tasks.iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(name for name in names if "gloo" in name)


#: Where to write, at exit, which gloo threads are still alive: a file per scenario run.
_EXIT_FILES: list[Path] = []


def _write_exit_files() -> None:
    threads = json.dumps(gloo_threads())
    for file in _EXIT_FILES:
        file.write_text(threads)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), default="train")
    parser.add_argument("--strategy", default="fsdp", choices=["fsdp", "single"])
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--ac", action="store_true", help="activation checkpointing")
    parser.add_argument("--precision", default="32")
    parser.add_argument("--keep-gathered", action="store_true", help="reshard_after_forward=False")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    SEEN_DTYPES.clear()  # this scenario's only (a process may run several)
    rank = int(os.environ.get("RANK", "0"))
    # One exit handler for every scenario this process runs (tests/scenario_worker.py
    # runs several), registered with the first, before any trainer's: it runs after them.
    if not _EXIT_FILES:
        atexit.register(_write_exit_files)
    _EXIT_FILES.append(out / f"{args.scenario}_rank{rank}_exit.json")
    summary = SCENARIOS[args.scenario](args)
    (out / f"{args.scenario}_rank{rank}.json").write_text(json.dumps(summary))


if __name__ == "__main__":
    main()
