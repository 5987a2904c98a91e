"""A small character-level transformer language model on generated text; prints the loss, then samples text.

The text comes from a tiny grammar with a fixed seed ("the small cat sees a red ball."), so it has structure
to learn and nothing is downloaded. The model is nn.TransformerEncoder with a causal mask (a GPT-style decoder).

Run:  python examples/language_model.py --accelerator cpu --devices 2
      python examples/language_model.py --accelerator cuda --devices 2 --precision bf16-mixed --max-steps 2000
"""

from __future__ import annotations

import argparse
import random

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from fabric import Fabric

SUBJECTS = ["the cat", "a dog", "the small bird", "my friend", "the old man", "a child"]
VERBS = ["sees", "likes", "finds", "takes", "wants"]
OBJECTS = ["a red ball", "the green box", "some bread", "the blue door", "a long stick", "the warm sun"]


def make_text(sentences: int = 3000, seed: int = 0) -> str:
    """Sentences from a small grammar, the same text in every process."""
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}." for _ in range(sentences))


class CharDataset(Dataset):
    """Windows of `block` characters; the target is the window shifted by one character."""

    def __init__(self, text: str, block: int) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.index[c] for c in text])
        self.block = block

    def __len__(self) -> int:
        return len(self.data) - self.block - 1

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        window = self.data[i : i + self.block + 1]
        return window[:-1], window[1:]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class CharTransformer(nn.Module):
    def __init__(self, vocab: int, block: int, width: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.block = block
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(1, block, width))
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        length = ids.shape[1]
        # The causal mask lets position t attend to positions <= t only, so it predicts t+1 without peeking.
        mask = nn.Transformer.generate_square_subsequent_mask(length, device=ids.device)
        hidden = self.encoder(self.embed(ids) + self.position[:, :length], mask=mask, is_causal=True)
        return self.head(hidden)


@torch.no_grad()
def generate(model: nn.Module, prompt: Tensor, new_chars: int, block: int) -> list[int]:
    """Sample one character at a time from the model's distribution over the next one."""
    ids = prompt
    for _ in range(new_chars):
        logits = model(ids[:, -block:])[:, -1]
        ids = torch.cat([ids, torch.multinomial(logits.float().softmax(dim=-1), 1)], dim=1)
    return ids[0].tolist()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Defaults that leave the choice to fabric (and to `fabric run`): 1 process on a CPU, every GPU on a GPU machine.
    parser.add_argument("--accelerator", default="auto", help="cpu, cuda, gpu, mps or auto")
    parser.add_argument("--strategy", default="auto", help="e.g. ddp, ddp_spawn; auto: ddp for several devices")
    parser.add_argument("--devices", default="auto", help="how many devices (processes on a CPU)")
    parser.add_argument("--precision", default=None, help="e.g. bf16-mixed, 16-mixed; default: 32-true")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--block", type=int, default=48, help="context length in characters")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--sample-chars", type=int, default=80, help="characters to generate at the end; 0: none")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    fabric = Fabric(
        accelerator=args.accelerator, strategy=args.strategy, devices=args.devices, precision=args.precision
    )
    fabric.launch()
    fabric.seed_everything(42)

    dataset = CharDataset(make_text(), args.block)
    model = CharTransformer(len(dataset.chars), args.block)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=args.batch_size, shuffle=True, drop_last=True))

    step = 0
    while step < args.max_steps:  # steps, not epochs: one epoch of overlapping windows is far more than needed
        for inputs, targets in loader:
            logits = model(inputs)
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
            optimizer.zero_grad()
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            if step % args.log_every == 0 or step == args.max_steps - 1:
                mean_loss = fabric.all_reduce(loss.detach(), reduce_op="mean")
                fabric.print(f"step {step}: loss {mean_loss.item():.4f}")
            step += 1
            if step == args.max_steps:
                break

    if args.sample_chars > 0:
        # Every process samples (same seed, same weights, same text), so no process waits in a collective alone.
        torch.manual_seed(0)
        model.eval()
        prompt = torch.tensor([[dataset.index[c] for c in "the "]], device=fabric.device)
        fabric.print("sample: " + dataset.decode(generate(model, prompt, args.sample_chars, args.block)))


if __name__ == "__main__":
    main()
