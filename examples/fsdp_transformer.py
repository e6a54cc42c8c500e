"""A small transformer language model trained with its parameters, gradients and
optimizer state sharded over the ranks (FSDP2), on the CPU or on GPUs.

    torchrun --nproc_per_node=2 examples/fsdp_transformer.py
    torchrun --nproc_per_node=2 examples/fsdp_transformer.py --meta --precision bf16-mixed
    torchrun --nproc_per_node=4 examples/fsdp_transformer.py --ac --dim 256 --layers 8
    python examples/fsdp_transformer.py          # one process: the same model, unsharded

The model (token and position embeddings, ``--layers`` blocks of causal self-attention
and MLP with LayerNorm, a head) learns to continue arithmetic sequences mod the
vocabulary. Each ``Block`` is a shard unit (``FSDPStrategy(units=[Block])``); the
embeddings, the final LayerNorm and the head belong to the root unit.

``--meta`` builds the model on the ``meta`` device: no memory is allocated until the
strategy materialises it, one unit at a time (``to_empty`` on the device, then each
layer's ``reset_parameters()``), sharding each unit as soon as it is initialised, so the
whole model never exists in one process. With the same seed on every rank the weights
are those of a normal construction.

``--ckpt DIR`` writes a sharded checkpoint at the end of every epoch (every rank its
shards, through ``torch.distributed.checkpoint``, in the background) and resumes from the
last one there when started again, also on another number of ranks. One process makes
one full file of a checkpoint: ``loopbus consolidate DIR/<name>.ckpt full.ckpt``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import loopbus
from loopbus import FSDPStrategy, Module, Trainer, on
from loopbus.events import TrainEpochCompleted
from loopbus.plugins import Checkpoint


class Block(torch.nn.Module):
    """Pre-norm causal self-attention and an MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.ln2 = torch.nn.LayerNorm(dim)
        self.fc1 = torch.nn.Linear(dim, 4 * dim)
        self.fc2 = torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.reshape(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))  # type: ignore[no-any-return]


class TinyGPT(Module):
    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int, lr: float) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(seq, dim)
        self.blocks = torch.nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.ln_f = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)
        self.vocab = vocab
        self.lr = lr
        self.epoch_losses: list[float] = []
        # Plain state, not tensors: under `with torch.device("meta")` a tensor made here
        # would be a meta tensor too.
        self._losses: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln_f(h))  # type: ignore[no-any-return]

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).reshape(-1, self.vocab), y.reshape(-1))
        self.put("train/loss", loss)
        self._losses.append(loss.detach().float())
        return loss

    @on(TrainEpochCompleted)
    def _epoch_loss(self, event: TrainEpochCompleted) -> None:
        # This rank's mean loss over the epoch, averaged over the ranks (a collective:
        # every rank runs this handler).
        mean = torch.stack(self._losses).mean()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(mean)
            mean = mean / torch.distributed.get_world_size()
        self.epoch_losses.append(float(mean))
        self._losses.clear()
        if self.trainer.is_global_zero:
            print(f"epoch {event.epoch}: mean loss {self.epoch_losses[-1]:.3f}", flush=True)

    def configure_optimizers(self) -> Any:
        # Runs after sharding: self.parameters() are the shards (DTensors), so the
        # optimizer state is sharded too.
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def sequences(n: int, vocab: int, seq: int, seed: int) -> TensorDataset:
    """Arithmetic sequences mod ``vocab`` with a random start and stride: inputs and the
    next token at every position."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 5, (n, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--meta", action="store_true", help="build the model on meta")
    parser.add_argument("--ac", action="store_true", help="activation checkpointing")
    parser.add_argument("--precision", default="32", help="'32' or 'bf16-mixed'")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--ckpt", default=None, help="checkpoint directory (resumes)")
    args = parser.parse_args(argv)

    loopbus.seed_everything(0)  # the same seed on every rank: the same initial weights
    sizes = (args.vocab, args.seq, args.dim, args.layers, args.heads, args.lr)
    if args.meta:
        with torch.device("meta"):
            model = TinyGPT(*sizes)
    else:
        model = TinyGPT(*sizes)
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    strategy: Any = (
        FSDPStrategy(units=[Block], activation_checkpointing=args.ac) if launched else "single"
    )
    if args.meta and not launched:
        # One process has no sharding strategy to materialise the model: do it here.
        model.to_empty(device="cpu")
        loopbus.seed_everything(0)
        for module in model.modules():
            reset = getattr(module, "reset_parameters", None)
            if callable(reset):
                reset()
    trainer = Trainer(
        max_epochs=args.epochs,
        strategy=strategy,
        precision=args.precision,
        device=args.device,
        plugins=[Checkpoint(args.ckpt, every_n_epochs=1)] if args.ckpt else [],
    )
    data = DataLoader(
        sequences(args.samples, args.vocab, args.seq, seed=1), batch_size=args.batch, shuffle=True
    )
    loopbus.run(trainer.fit, model, data, ckpt_path="last" if args.ckpt else None)
    return model.epoch_losses


if __name__ == "__main__":
    main()
