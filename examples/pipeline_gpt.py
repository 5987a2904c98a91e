"""A small GPT-style language model trained with pipeline parallelism: each process holds some of its blocks.

The model has the usual layout (embedding, a ModuleList of blocks, final norm and head), and its forward skips a
submodule that is None: PipelineStrategy cuts it at the `split_points` and each process keeps only its stage.
The text comes from a tiny grammar with a fixed seed, so nothing is downloaded.

Run:  python examples/pipeline_gpt.py --devices 2                                  # 2 stages, 1F1B, CPU
      python examples/pipeline_gpt.py --devices 4 --schedule Interleaved1F1B --split blocks.1,blocks.2,blocks.3
      python examples/pipeline_gpt.py --accelerator cuda --devices 4 --split blocks.1,blocks.2,blocks.3 \
          --precision bf16-mixed
"""

from __future__ import annotations

import argparse
import random

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.strategies import PipelineStrategy

WORDS = ["the cat", "a dog", "sees", "likes", "a red ball", "the green box", "some bread", "the sun"]


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, each with a residual connection."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, is_causal=True, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Embedding(nn.Module):
    """Token and position embeddings: one submodule, so that one stage owns both."""

    def __init__(self, vocab: int, dim: int, block: int) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(block, dim)

    def forward(self, idx: Tensor) -> Tensor:
        return self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int = 64, layers: int = 4, heads: int = 4, block: int = 32) -> None:
        super().__init__()
        self.embed = Embedding(vocab, dim, block)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: Tensor) -> Tensor:
        # Under PipelineStrategy the submodules of other stages are None, and a later stage gets activations.
        h = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            h = block(h)
        h = self.norm(h) if self.norm is not None else h
        return self.head(h) if self.head is not None else h


def token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_data(block: int, samples: int = 2048) -> tuple[TensorDataset, int]:
    rng = random.Random(0)
    text = " ".join(f"{rng.choice(WORDS[:2])} {rng.choice(WORDS[2:4])} {rng.choice(WORDS[4:])}." for _ in range(2000))
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    starts = torch.randint(0, len(data) - block - 1, (samples,), generator=torch.Generator().manual_seed(0))
    windows = torch.stack([data[s : s + block + 1] for s in starts.tolist()])
    return TensorDataset(windows[:, :-1], windows[:, 1:]), len(chars)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--precision", default=None, help="e.g. bf16-mixed (16-mixed's loss scaling is refused)")
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--split", default="blocks.2", help="comma-separated names where a new stage begins")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--data-parallel", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--save", default=None, help="save a sharded checkpoint of the whole model here")
    args = parser.parse_args()

    strategy = PipelineStrategy(
        split_points=args.split.split(","),
        schedule=args.schedule,
        microbatches=args.microbatches,
        loss_fn=token_loss,
        data_parallel_size=args.data_parallel,
    )
    fabric = Fabric(accelerator=args.accelerator, devices=args.devices, strategy=strategy, precision=args.precision)
    fabric.launch()
    fabric.seed_everything(0)  # every rank builds the same model, then keeps its stage of it
    dataset, vocab = make_data(block=32)
    model = GPT(vocab)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True))

    step = 0
    while step < args.max_steps:
        for x, y in loader:
            loss = fabric.pipeline_step(model, x, target=y)  # forward and backward over the microbatches
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            if step % args.log_every == 0 or step == args.max_steps - 1:
                fabric.print(f"step {step}: loss {fabric.all_reduce(loss).item():.4f}")
            step += 1
            if step == args.max_steps:
                break
    if args.save:
        fabric.save(args.save, {"model": model, "optimizer": optimizer, "step": step})
        fabric.print(f"saved {args.save}")


if __name__ == "__main__":
    main()
