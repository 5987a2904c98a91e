"""What a litgpt user brings along, built offline: a tiny word-level tokenizer, a pretraining data module of token
sequences, an instruction-tuning JSON file and the YAML config of a tiny GPT. No download, no hidden mock: litgpt's
own CLI reads all of these as it reads a user's.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from litgpt.data import DataModule
from torch.utils.data import DataLoader, Dataset

WORDS = [
    *("the", "a", "cat", "dog", "bird", "sees", "eats", "runs", "sleeps", "on", "under", "near", "big", "small"),
    *("red", "blue", "green", "tree", "house", "river", "hill", "sun", "moon", "day", "night", "is", "was", "and"),
    *("or", "not", "fast", "slow", "quiet", "loud", "happy", "sad", "cold", "warm", "old", "new"),
]
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]
SEQ_LEN = 16


def write_tokenizer(directory: Path) -> int:
    """A word-level `tokenizers` tokenizer as `tokenizer.json` plus litgpt's `tokenizer_config.json`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: index for index, token in enumerate(SPECIAL + WORDS + list("#:.,!?"))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Punctuation()])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return len(vocab)


def write_instructions(path: Path, count: int = 24) -> None:
    """Alpaca-style records for litgpt's `JSON` data module."""
    rng = random.Random(0)
    records = [
        {
            "instruction": " ".join(rng.choice(WORDS) for _ in range(5)),
            "input": "",
            "output": " ".join(rng.choice(WORDS) for _ in range(4)),
        }
        for _ in range(count)
    ]
    path.write_text(json.dumps(records))


MODEL = {
    "name": "tiny-gpt",
    "block_size": 64,  # room for LoRA's prompts; pretraining trains on SEQ_LEN (train.max_seq_length)
    "padded_vocab_size": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 32,
    "rotary_percentage": 0.25,
    "parallel_residual": True,
    "bias": True,
}


def write_initial_checkpoint(directory: Path, vocab_size: int) -> None:
    """Starting weights for `--initial_checkpoint_dir`, so that runs with and without FSDP start from the same model.

    (Without it each run initialises its own, and FSDP materialises modules in another order than one process.)
    """
    from litgpt import GPT, Config

    torch.manual_seed(0)
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(GPT(Config(vocab_size=vocab_size, **MODEL)).state_dict(), directory / "lit_model.pth")


def write_pretrain_config(path: Path, vocab_size: int) -> None:
    """The model and training settings of every pretraining run (a litgpt `--config` file, as in its config_hub)."""
    model = [f"  {key}: {str(value).lower() if isinstance(value, bool) else value}" for key, value in MODEL.items()]
    lines = [
        "model_name: pythia-14m",
        "model_config:",
        f"  vocab_size: {vocab_size}",
        *model,
        "data:",
        "  class_path: litgpt_assets.RandomTokens",
        "train:",
        "  save_interval: 2",
        f"  max_seq_length: {SEQ_LEN}",
        "  log_interval: 1",
        "  global_batch_size: 4",
        "  micro_batch_size: 2",
        f"  max_tokens: {12 * 2 * SEQ_LEN}",
        # A constant learning rate: litgpt schedules it per micro-batch, so any warmup or decay would differ between
        # one process accumulating two micro-batches and two processes taking one each.
        "  lr_warmup_steps: 0",
        "  min_lr: 0.1",
        "  max_norm: 1.0",
        "eval:",
        "  interval: 2",
        "  max_iters: 2",
        "  initial_validation: false",
        "  final_validation: true",
        # SGD with momentum (state that a resume must restore), not Adam: Adam turns the rounding noise in gradients
        # that are zero in exact arithmetic (attention key biases) into full-size steps, so runs that sum the same
        # gradients in another order would drift apart by 1e-4 on those weights and compare nothing useful.
        "optimizer:",
        "  class_path: torch.optim.SGD",
        "  init_args:",
        "    lr: 0.1",
        "    momentum: 0.9",
        "logger_name: csv",
        "seed: 42",
        "precision: 32-true",
    ]
    path.write_text("\n".join(lines) + "\n")


class _Sequences(Dataset):
    def __init__(self, count: int, vocab_size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.data = torch.randint(len(SPECIAL), vocab_size, (count, SEQ_LEN + 1), generator=generator)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.data[index]


class RandomTokens(DataModule):
    """Token sequences for `litgpt pretrain` (a user's own data module, given by class path in the config)."""

    def __init__(self, count: int = 64, vocab_size: int = 48) -> None:
        super().__init__()
        self.count, self.vocab_size, self.batch_size = count, vocab_size, 1

    def connect(self, tokenizer: object = None, batch_size: int = 1, max_seq_length: int | None = None) -> None:
        self.batch_size = batch_size

    def train_dataloader(self) -> DataLoader:
        # In order: one process accumulating two micro-batches [0, 1] + [2, 3] then sees the same global batch as two
        # processes taking [0, 2] and [1, 3] from their distributed shards, so the two runs can be compared weight by
        # weight.
        return DataLoader(_Sequences(self.count, self.vocab_size, 1), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(_Sequences(8, self.vocab_size, 2), batch_size=self.batch_size)
