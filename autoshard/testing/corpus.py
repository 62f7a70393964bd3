"""A generated character corpus for training the test GPT on something learnable (benchmarks).

    data = CharData(generate_corpus())
    x, y = data.batch(16, 32, step=0)      # (16, 32) token ids and the next-token targets
    data.vocab                             # number of distinct characters

The toy language ``examples/nanogpt.py`` trains on (the examples import it from here).
"""
from __future__ import annotations

import random

import torch

__all__ = ["generate_corpus", "CharData"]


def generate_corpus(n_sentences: int = 2000, seed: int = 0) -> str:
    """A deterministic toy language: sentences from a tiny grammar, so a GPT can learn its regularities."""
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        subj = rng.choice(["the cat", "the dog", "a bird", "the big cat", "a small dog"])
        verb = rng.choice(["sat", "ran", "flew", "sees", "eats", "finds"])
        place = rng.choice(["on the mat", "under the tree", "over the roof", "and then ran", "quickly"])
        out.append(f"{subj} {verb} {place}.")
    return " ".join(out)


class CharData:
    """Character-level batches from a corpus: ``batch(n, seq, step)`` -> (ids, next-ids), deterministic."""

    def __init__(self, text: str):
        chars = sorted(set(text))
        self.vocab = len(chars)
        self.stoi = {c: i for i, c in enumerate(chars)}
        self.data = torch.tensor([self.stoi[c] for c in text], dtype=torch.long)

    def batch(self, n: int, seq: int, step: int):
        g = torch.Generator().manual_seed(step)
        starts = torch.randint(0, len(self.data) - seq - 1, (n,), generator=g)
        x = torch.stack([self.data[s:s + seq] for s in starts])
        y = torch.stack([self.data[s + 1:s + seq + 1] for s in starts])
        return x, y
