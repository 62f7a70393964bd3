"""Small shared test models: each builder returns ``(model, example_inputs, target, loss_fn)``.

Every builder makes a global batch of 8 (divisible by 4), builds on the current default device
(``with torch.device("meta"): mlp()`` allocates nothing) and draws from the global RNG, so the
caller seeds it (``torch.manual_seed(0)``). Dropout is 0 everywhere, so the models are
deterministic. ``loss_fn(output, target)`` returns a scalar; for the HF models ``output`` is the
logits (``capture`` passes ``.logits`` of an HF output object).

What each one exercises:

- ``mlp``: one ``nn.Linear`` (``proj``) applied twice (a parameter used twice); a second float input
  (a mask).
- ``gpt``: pre-LN GPT (q/k/v without bias), causal SDPA, GELU MLP, learned positions (``arange``
  with a device argument), LM head tied to the token embedding; long token ids as input and target.
- ``cnn``: Conv2d + BatchNorm2d (running-stat buffers, updated in place) + ReLU + pooling + flatten
  + Linear on 3x8x8 images.
- ``hf_gpt2`` / ``hf_llama``: transformers models from tiny configs (GPT-2: tied embeddings, Conv1D;
  Llama: GQA, RMSNorm, rotary ``inv_freq`` non-persistent buffers).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

BATCH = 8


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class MLP(nn.Module):
    """``proj(fc2(gelu(fc1(proj(x)))) * mask)``: ``proj`` runs twice."""

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.fc2(F.gelu(self.fc1(self.proj(x))))
        return self.proj(h * mask)


def mlp(d: int = 16, hidden: int = 64):
    model = MLP(d, hidden)
    x = torch.randn(BATCH, d)
    mask = (torch.rand(BATCH, d) > 0.25).float()
    return model, (x, mask), torch.randn(BATCH, d), _mse


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.ln1 = nn.LayerNorm(d)
        # no q/k/v biases: a key bias has an exactly-zero gradient (softmax ignores a per-query
        # shift), so an optimizer like Adam would turn rounding noise into full-size updates
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, s, d = t.shape
        return t.view(b, s, self.n_head, d // self.n_head).transpose(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.ln1(x)
        y = F.scaled_dot_product_attention(self._heads(self.q(h)), self._heads(self.k(h)),
                                           self._heads(self.v(h)), is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, n_layer: int, n_head: int, seq: int, tied: bool):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        for block in self.blocks:  # GPT-2's scaled init of the residual projections
            for m in (block.o, block.out):
                nn.init.normal_(m.weight, std=0.02 / math.sqrt(2 * n_layer))
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt(vocab: int = 64, d: int = 32, n_layer: int = 2, n_head: int = 4, seq: int = 16, tied: bool = True):
    model = GPT(vocab, d, n_layer, n_head, seq, tied)
    ids = torch.randint(0, vocab, (BATCH, seq))
    return model, (ids,), torch.randint(0, vocab, (BATCH, seq)), _cross_entropy


class CNN(nn.Module):
    def __init__(self, channels: int = 8, classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1, bias=False)  # BatchNorm cancels a bias: its grad is 0
        self.bn = nn.BatchNorm2d(channels)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(channels * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(F.relu(self.bn(self.conv(x))))
        return self.fc(torch.flatten(h, 1))


def cnn():
    model = CNN()
    return model, (torch.randn(BATCH, 3, 8, 8),), torch.randint(0, 10, (BATCH,)), _cross_entropy


def hf_gpt2(seq: int = 16):
    """transformers GPT2LMHeadModel (2 layers, width 32, vocab 64); inputs ``{"input_ids": ids}``."""
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64, n_positions=32, attn_pdrop=0,
                        resid_pdrop=0, embd_pdrop=0, use_cache=False, bos_token_id=0, eos_token_id=0)
    return _hf(GPT2LMHeadModel(config), config.vocab_size, seq)


def hf_llama(seq: int = 16):
    """transformers LlamaForCausalLM (2 layers, width 32, 4 heads / 2 KV heads, vocab 64)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=64, use_cache=False)
    return _hf(LlamaForCausalLM(config), config.vocab_size, seq)


def _hf(model: nn.Module, vocab: int, seq: int):
    ids = torch.randint(0, vocab, (BATCH, seq))
    return model, {"input_ids": ids}, torch.randint(0, vocab, (BATCH, seq)), _cross_entropy


BUILDERS = {"mlp": mlp, "gpt": gpt, "cnn": cnn, "hf_gpt2": hf_gpt2, "hf_llama": hf_llama}
