"""The shared test and benchmark models, and builders that return a model with a batch for it.

Classes (build them on any device: ``with torch.device("meta"): GPT(...)`` allocates nothing):

- ``MLP(d, hidden, out=None, activation=F.gelu)``: ``fc2(activation(fc1(x)))``, the planner's and
  the runtime's two-layer model.
- ``ResidualMLP(d, hidden, layers)``: ``x + downs[i](gelu(ups[i](x)))`` repeated, for the step-time benchmark.
- ``MaskedMLP(d, hidden)``: one ``nn.Linear`` (``proj``) applied twice (a parameter used twice) and a
  second float input (a mask).
- ``GPT(vocab, d, n_layer, n_head, seq, tied=True, fused_qkv=False)``: pre-LN GPT, causal SDPA, GELU
  MLP, learned positions (``arange`` with a device argument), optionally an LM head tied to the token
  embedding. ``fused_qkv=False``: separate ``q``, ``k``, ``v`` without bias; ``True``: one biased
  ``qkv`` Linear split in three (nanoGPT's layout).
- ``CNN``: Conv2d + BatchNorm2d (running-stat buffers, updated in place) + ReLU + pooling + flatten +
  Linear on 3x8x8 images.
- ``BlockCNN(dropout)``: a stem conv, 2 numbered residual blocks (conv, BatchNorm, ReLU, dropout:
  repeated blocks that activation checkpointing can recompute), pooling, Linear, on 3x8x8 images.
- ``ComplexRopeLlama(vocab, d, n_layer, n_head, n_kv_head, seq, hidden=2 d)``: Meta's reference Llama layout
  (RMSNorm, GQA by ``repeat_kv``, SwiGLU) whose rotary embedding multiplies queries and keys as
  complex numbers (``view_as_complex`` / ``view_as_real``) by a complex ``freqs_cis`` buffer
  (non-persistent, as torchtitan registers it).
- ``UNet(d, depth)``: a down path of Linear+GELU blocks and an up path; up block k reads the previous
  up output concatenated (even k) or added (odd k) with the output of down block depth-1-k, so with
  4 pipeline stages stage 0's ``down.0`` output travels straight to stage 3.

- ``UNet1d(channels, width)``: a 1-D convolutional U-Net of named, unnumbered modules (``d1``, ``d2``
  (stride 2), ``mid`` (residual), ``up`` (transposed conv), ``u1``, ``gn`` (GroupNorm), ``out``) with
  a long skip from ``d1``'s output to ``u1``'s input: no numbered block anywhere, so the stage
  planner must find its cuts on the op graph.

Builders return ``(model, example_inputs, target, loss_fn)`` for a global batch of 8 (divisible by
4), build on the current default device and draw from the global RNG, so the caller seeds it
(``torch.manual_seed(0)``). Dropout is 0 everywhere, so the models are deterministic.
``loss_fn(output, target)`` returns a scalar from exactly what the model returns (as ``capture``
passes it): for the HF models an HF output object, whose ``.logits`` ``hf_lm_loss`` takes. ``BUILDERS`` names them: ``mlp``, ``gpt``, ``cnn``,
``hf_gpt2`` (tied embeddings, Conv1D), ``hf_llama`` (GQA, RMSNorm, rotary ``inv_freq``
non-persistent buffers), ``complex_rope_llama``.

Pipeline builders (``PIPELINE_BUILDERS``: ``unet``, ``gpt``) return ``(model, example_inputs, target,
loss_fn, stage_prefixes)``, where ``stage_prefixes[n]`` lists the module-name prefixes where stages
1..n-1 start for ``n`` stages (2, 4, 8; 8 cuts the GPT's blocks between attention and MLP; ``unet1d``
has 2 and 4 only), as
``passes.pipeline.stages.stage_graphs.stage_nodes_from_prefixes`` reads them.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["BATCH", "lm_loss", "hf_lm_loss", "MLP", "DeepMLP", "ResidualMLP", "MaskedMLP", "Block", "GPT", "CNN", "BlockCNN", "ComplexRopeLlama",
           "UNet", "UNet1d", "mlp", "gpt", "cnn", "hf_gpt2", "hf_llama", "complex_rope_llama", "unet", "gpt_pipeline", "unet1d", "BUILDERS",
           "PIPELINE_BUILDERS"]

BATCH = 8


def _mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy over every position: ``logits`` (..., vocab), ``target`` (...) of token ids."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def hf_lm_loss(output, target: torch.Tensor) -> torch.Tensor:
    """``lm_loss`` of a Hugging Face output's ``.logits`` (what a loss for an HF model is given)."""
    return lm_loss(output.logits, target)


class MLP(nn.Module):
    """``fc2(activation(fc1(x)))``; ``out`` defaults to ``d``."""

    def __init__(self, d: int, hidden: int, out: int | None = None, activation: Callable = F.gelu):
        super().__init__()
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, out or d)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.activation(self.fc1(x)))


class ResidualMLP(nn.Module):
    """``layers`` residual MLP blocks: ``x = x + downs[i](gelu(ups[i](x)))``."""

    def __init__(self, d: int, hidden: int, layers: int):
        super().__init__()
        self.ups = nn.ModuleList([nn.Linear(d, hidden) for _ in range(layers)])
        self.downs = nn.ModuleList([nn.Linear(hidden, d) for _ in range(layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for up, down in zip(self.ups, self.downs):
            x = x + down(F.gelu(up(x)))
        return x


class DeepMLP(nn.Module):
    """Three linears 64 -> 256 -> 256 -> 64 with GELUs between: the tiny model of the memory-limited plan-time
    benchmark (``benchmarks/memory_limit_plan_time.py``) and of the memory-fallback test."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(F.gelu(self.fc2(F.gelu(self.fc1(x)))))


class MaskedMLP(nn.Module):
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
    """``MaskedMLP``: inputs ``(x, mask)``, an MSE target."""
    model = MaskedMLP(d, hidden)
    x = torch.randn(BATCH, d)
    mask = (torch.rand(BATCH, d) > 0.25).float()
    return model, (x, mask), torch.randn(BATCH, d), _mse


class Block(nn.Module):
    """Pre-LN transformer block: x + o(attn(ln1(x))), then x + out(gelu(fc(ln2(x))))."""

    def __init__(self, d: int, n_head: int, fused_qkv: bool = False):
        super().__init__()
        self.n_head = n_head
        self.fused_qkv = fused_qkv
        self.ln1 = nn.LayerNorm(d)
        if fused_qkv:
            self.qkv = nn.Linear(d, 3 * d)
        else:
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
        if self.fused_qkv:
            q, k, v = (self._heads(t) for t in self.qkv(h).split(d, dim=-1))
        else:
            q, k, v = self._heads(self.q(h)), self._heads(self.k(h)), self._heads(self.v(h))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, n_layer: int, n_head: int, seq: int, tied: bool = True,
                 fused_qkv: bool = False):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, n_head, fused_qkv) for _ in range(n_layer))
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
    """``GPT`` with separate q/k/v: token ids as input and target."""
    model = GPT(vocab, d, n_layer, n_head, seq, tied)
    ids = torch.randint(0, vocab, (BATCH, seq))
    return model, (ids,), torch.randint(0, vocab, (BATCH, seq)), lm_loss


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


class ConvBlock(nn.Module):
    def __init__(self, channels: int, dropout: float):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.relu(self.bn(self.conv(x))))


class BlockCNN(nn.Module):
    def __init__(self, dropout: float = 0.0, channels: int = 8, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(channels, dropout) for _ in range(2))
        self.fc = nn.Linear(channels * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.fc(torch.flatten(F.max_pool2d(x, 2), 1))


def cnn():
    model = CNN()
    return model, (torch.randn(BATCH, 3, 8, 8),), torch.randint(0, 10, (BATCH,)), lm_loss


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
    return model, {"input_ids": ids}, torch.randint(0, vocab, (BATCH, seq)), hf_lm_loss


def _freqs_cis(head_dim: int, seq: int, theta: float = 10000.0) -> torch.Tensor:
    """(seq, head_dim / 2) unit complex numbers ``exp(i t f)``: Meta's ``precompute_freqs_cis``."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2)[: head_dim // 2].float() / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), freqs)
    return torch.polar(torch.ones_like(angles), angles)


def _rotate(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Meta's ``apply_rotary_emb`` for one tensor (b, s, h, d): pairs as complex numbers times ``freqs_cis``."""
    x_ = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs = freqs_cis.view(1, x_.shape[1], 1, x_.shape[-1])
    return torch.view_as_real(x_ * freqs).flatten(3).type_as(x)


class _RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _RopeBlock(nn.Module):
    def __init__(self, d: int, n_head: int, n_kv_head: int, hidden: int):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = n_head, n_kv_head, d // n_head
        self.attention_norm, self.ffn_norm = _RMSNorm(d), _RMSNorm(d)
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, n_kv_head * self.head_dim, bias=False)
        self.wv = nn.Linear(d, n_kv_head * self.head_dim, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x, freqs_cis):
        b, s, d = x.shape
        h = self.attention_norm(x)
        q = _rotate(self.wq(h).view(b, s, self.n_head, self.head_dim), freqs_cis)
        k = _rotate(self.wk(h).view(b, s, self.n_kv_head, self.head_dim), freqs_cis)
        v = self.wv(h).view(b, s, self.n_kv_head, self.head_dim)
        rep = self.n_head // self.n_kv_head  # Meta's repeat_kv
        k, v = (t[:, :, :, None].expand(b, s, self.n_kv_head, rep, self.head_dim).reshape(b, s, self.n_head, -1)
                for t in (k, v))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(b, s, d))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class ComplexRopeLlama(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32, n_layer: int = 2, n_head: int = 4, n_kv_head: int = 2,
                 seq: int = 16, hidden: int | None = None):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_RopeBlock(d, n_head, n_kv_head, hidden or 2 * d) for _ in range(n_layer))
        self.norm = _RMSNorm(d)
        self.output = nn.Linear(d, vocab, bias=False)
        self.register_buffer("freqs_cis", _freqs_cis(d // n_head, seq), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(ids)
        freqs_cis = self.freqs_cis[: ids.shape[1]]
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h))


def complex_rope_llama(seq: int = 16):
    """``ComplexRopeLlama`` (vocabulary 64, width 32, 4 heads / 2 KV heads): token ids in and as target."""
    model = ComplexRopeLlama(seq=seq)
    return model, (torch.randint(0, 64, (BATCH, seq)),), torch.randint(0, 64, (BATCH, seq)), lm_loss


BUILDERS = {"mlp": mlp, "gpt": gpt, "cnn": cnn, "hf_gpt2": hf_gpt2, "hf_llama": hf_llama,
            "complex_rope_llama": complex_rope_llama}


class UNet(nn.Module):
    def __init__(self, d: int = 16, depth: int = 4):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.down = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.up = nn.ModuleList(nn.Linear(2 * d if k % 2 == 0 else d, d) for k in range(depth))
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        skips = []
        for block in self.down:
            h = F.gelu(block(h))
            skips.append(h)
        u = h
        for k, block in enumerate(self.up):
            s = skips[len(skips) - 1 - k]
            u = F.gelu(block(torch.cat([u, s], dim=-1) if k % 2 == 0 else u + s))
        return self.head(u)


def unet(d: int = 16):
    model = UNet(d)
    x = torch.randn(BATCH, d)
    prefixes = {2: ["up.0"], 4: ["down.2", "up.0", "up.2"],
                8: ["down.0", "down.2", "down.3", "up.0", "up.1", "up.2", "up.3"]}
    return model, (x,), torch.randn(BATCH, d), F.mse_loss, prefixes


def gpt_pipeline(n_layer: int = 4):
    """The GPT with tied embeddings (wte on stage 0, the tied LM head on the last)."""
    model, inputs, target, loss_fn = gpt(n_layer=n_layer, d=16, n_head=2, seq=8)
    prefixes = {2: [f"blocks.{n_layer // 2}"], 4: [f"blocks.{k}" for k in range(1, n_layer)],
                8: [p for k in range(n_layer) for p in ([f"blocks.{k}"] if k else []) + [f"blocks.{k}.ln2"]]}
    return model, inputs, target, loss_fn, prefixes


class UNet1d(nn.Module):
    def __init__(self, channels: int = 4, width: int = 8):
        super().__init__()
        self.d1 = nn.Conv1d(channels, width, 3, padding=1)
        self.d2 = nn.Conv1d(width, 2 * width, 3, stride=2, padding=1)
        self.mid = nn.Conv1d(2 * width, 2 * width, 3, padding=1)
        self.up = nn.ConvTranspose1d(2 * width, width, 2, stride=2)
        self.u1 = nn.Conv1d(2 * width, width, 3, padding=1)
        self.gn = nn.GroupNorm(2, width)
        self.out = nn.Conv1d(width, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = F.silu(self.d1(x))
        b = F.silu(self.d2(a))
        m = F.silu(self.mid(b)) + b
        u = self.up(m)
        h = F.silu(self.gn(self.u1(torch.cat([u, a], dim=1))))
        return self.out(h)


def unet1d(channels: int = 4, width: int = 8, length: int = 16):
    model = UNet1d(channels, width)
    x = torch.randn(BATCH, channels, length)
    prefixes = {2: ["up"], 4: ["d2", "up", "gn"]}
    return model, (x,), torch.randn(BATCH, channels, length), F.mse_loss, prefixes


PIPELINE_BUILDERS = {"unet": unet, "gpt": gpt_pipeline, "unet1d": unet1d}
