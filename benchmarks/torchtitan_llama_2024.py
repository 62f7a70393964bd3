"""torchtitan's Llama 3 as its December 2024 benchmarks ran it, for planning on the meta device:
``torchtitan_llama(layers, dim, heads, kv_heads, ffn, vocab, seq)``.

The module computes what ``torchtitan/models/llama/model.py`` (pytorch/torchtitan 9dec370, 2024-12-26)
computes, with the same eager ops, so that ``autoshard.plan`` prices the kernels torchtitan ran:
RMSNorm in fp32 (``x.float()``, ``pow``, ``mean``, ``rsqrt``, ``type_as``, then the weight;
torchtitan/models/norms.py), rotary embeddings as a complex multiply (``view_as_complex`` of the fp32
queries and keys times the ``freqs_cis`` buffer, ``type_as`` back), separate ``wq``/``wk``/``wv``,
``repeat_kv``'s ``expand().reshape()`` copy for grouped-query attention, SDPA with ``is_causal``,
the output's ``transpose(1, 2).contiguous()`` copy, SwiGLU (``w2(silu(w1 x) * w3 x)``) and the
logits cast to fp32 before the loss (train.py).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["torchtitan_llama", "TorchtitanLlama", "lm_loss"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight


def _rotary(x, freqs_cis):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis.view(1, xc.shape[1], 1, xc.shape[-1])).flatten(3).type_as(x)


def _repeat_kv(x, n_rep: int):
    if n_rep == 1:
        return x
    b, s, kv, d = x.shape
    return x[:, :, :, None, :].expand(b, s, kv, n_rep, d).reshape(b, s, kv * n_rep, d)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        q, k = _rotary(q, freqs_cis), _rotary(k, freqs_cis)
        rep = self.heads // self.kv_heads
        k, v = _repeat_kv(k, rep), _repeat_kv(v, rep)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, ffn: int):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, heads, kv_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, ffn)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class TorchtitanLlama(nn.Module):
    """``forward(tokens [b, s]) -> fp32 logits [b, s, vocab]``."""

    def __init__(self, layers: int, dim: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int,
                 rope_theta: float = 500000.0):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        head_dim = dim // heads
        freqs = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
        angles = torch.outer(torch.arange(seq).float(), freqs)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)
        self.layers = nn.ModuleList(TransformerBlock(dim, heads, kv_heads, ffn) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[: tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h)).float()


def lm_loss(logits, labels):
    """torchtitan's loss (train.py): cross entropy over the flattened fp32 logits."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))


def torchtitan_llama(layers: int, dim: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int
                     ) -> TorchtitanLlama:
    """The model on the meta device, fp32 parameters (torchtitan keeps fp32 masters; FSDP2's mixed
    precision computes in bf16: plan it with ``mixed_precision``)."""
    with torch.device("meta"):
        return TorchtitanLlama(layers, dim, heads, kv_heads, ffn, vocab, seq)


class _LayerProbe(nn.Module):
    """``benchmarks/gpu_layer_probe.py``'s program: one 8B block on 2 x 8192 tokens in bf16, the
    gradient taken for its input and every weight (the input is a parameter here for that), times a
    given upstream gradient."""

    def __init__(self):
        super().__init__()
        self.x = nn.Parameter(torch.empty(2, 8192, 4096))
        self.block = TransformerBlock(4096, 32, 8, 14336)
        angles = torch.zeros(8192, 64)
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def forward(self, grad):
        return (self.block(self.x, self.freqs_cis) * grad).sum()


def layer_probe_seconds(hardware) -> tuple[float, float]:
    """(forward, forward + backward) seconds of the layer probe's program by the planner's per-op prices
    (``GraphFacts``: every op at one device, nothing sharded) on ``hardware``."""
    from autoshard.passes.capture.export import capture
    from autoshard.passes.cost.facts import GraphFacts
    with torch.device("meta"):
        probe = _LayerProbe().to(torch.bfloat16)
    grad = torch.empty(2, 8192, 4096, dtype=torch.bfloat16, device="meta")
    facts = GraphFacts(capture(probe, (grad,)), hardware)
    fwd = bwd = 0.0
    for name, kind in facts.kind.items():
        if kind == "op":
            f, b = facts.compute(name)
            fwd, bwd = fwd + f, bwd + b
    return fwd, fwd + bwd
