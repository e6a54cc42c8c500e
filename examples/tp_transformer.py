"""A small Llama-style language model trained with tensor parallelism inside its layers
and FSDP2 over the data-parallel ranks (``ModelParallelStrategy``), on the CPU or on GPUs.

    torchrun --nproc_per_node=4 examples/tp_transformer.py                 # dp=2 x tp=2
    torchrun --nproc_per_node=4 examples/tp_transformer.py --tp 4          # tp over 4
    torchrun --nproc_per_node=4 examples/tp_transformer.py --tp 1 --dp-replicate 2  # HSDP
    torchrun --nproc_per_node=4 examples/tp_transformer.py --meta

The model (RMSNorm, causal attention, a SwiGLU MLP, no bias) learns to continue
arithmetic sequences mod the vocabulary. ``configure_model(mesh)`` applies torchtitan's
plan for Llama on ``mesh["tp"]``: the attention's and the MLP's input projections split
by columns, their output projections by rows, the norms sequence-parallel; the strategy
then shards each ``Block`` (a shard unit) over the data-parallel ranks. The training
loader is sharded over the data-parallel replicas, so the tp peers read the same batch.

``--meta`` builds the model on the ``meta`` device; the strategy materialises and
initialises it whole on each rank before ``configure_model`` splits it, so with the same
seed on every rank the weights are those of a normal construction.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import loopbus
from loopbus import ModelParallelStrategy, Module, Trainer, on
from loopbus.events import TrainEpochCompleted


class Attention(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (
            torch.nn.Linear(dim, dim, bias=False) for _ in range(4)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Each rank holds heads / tp of the heads: -1 counts them.
        q, k, v = (
            w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(a.transpose(1, 2).reshape(b, t, -1))  # type: ignore[no-any-return]


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm = torch.nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = torch.nn.RMSNorm(dim)
        self.w1 = torch.nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = torch.nn.Linear(4 * dim, dim, bias=False)
        self.w3 = torch.nn.Linear(dim, 4 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))  # type: ignore[no-any-return]


class TinyLlama(Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, lr: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.norm = torch.nn.RMSNorm(dim)
        self.output = torch.nn.Linear(dim, vocab, bias=False)

    def configure_model(self, mesh: Any) -> None:
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel as Col
        from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module
        from torch.distributed.tensor.parallel import RowwiseParallel as Row
        from torch.distributed.tensor.parallel import SequenceParallel as Seq

        tp = mesh["tp"]
        gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        parallelize_module(self, tp, {
            "tok": Row(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": Seq(),
            "output": Col(input_layouts=Shard(1), output_layouts=Replicate()),
        })  # fmt: skip
        for block in self.layers:
            parallelize_module(block, tp, {
                "attention_norm": Seq(), "attention": gather,
                "attention.wq": Col(), "attention.wk": Col(), "attention.wv": Col(),
                "attention.wo": Row(output_layouts=Shard(1)),
                "ffn_norm": Seq(), "w1": Col(), "w3": Col(), "w2": Row(output_layouts=Shard(1)),
            })  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tok(x)
        for block in self.layers:
            h = block(h)
        return self.output(self.norm(h))  # type: ignore[no-any-return]

    def training_step(self, batch: Any, ctx: Any) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.last_loss = loss.detach()
        return loss

    @on(TrainEpochCompleted)
    def _report(self, event: TrainEpochCompleted) -> None:
        if self.trainer.is_global_zero:
            print(f"epoch {event.epoch}: loss {float(self.last_loss):.3f}")

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def sequences(n: int, vocab: int, seq: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dp-replicate", type=int, default=1)
    parser.add_argument("--meta", action="store_true")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=32)
    args = parser.parse_args()
    loopbus.seed_everything(0)  # the same seed on every rank
    options = {"vocab": 64, "dim": 64, "layers": 2, "heads": 4, "lr": 3e-3}
    with torch.device("meta" if args.meta else "cpu"):
        model = TinyLlama(**options)
    strategy = ModelParallelStrategy(tp=args.tp, dp_replicate=args.dp_replicate, units=[Block])
    trainer = Trainer(max_epochs=args.epochs, strategy=strategy, plugins=[])
    batch = args.global_batch // strategy.data_parallel_size
    data = DataLoader(sequences(1024, 64, 32), batch_size=batch, shuffle=True)
    loopbus.run(trainer.fit, model, data)


if __name__ == "__main__":
    main()
