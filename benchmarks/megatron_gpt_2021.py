"""Megatron-LM's GPT as the 2021 runs of Narayanan et al. (SC21, Table 1) executed it, for planning on
the meta device: ``megatron_gpt(layers, hidden, heads, seq, vocab)``.

The module computes what Megatron-LM's GPT computes (pre-LayerNorm blocks, learned position
embeddings, a word embedding tied to the output layer, GeLU MLP of 4h, dropout 0.1 on the hidden
states and on the attention probabilities) with the kernels the 2021 code ran, so that
``autoshard.plan`` prices those kernels:

- ``F.linear`` on a 3-D input with a bias, as PyTorch 1.8 ran it (``at::linear``: ``matmul``, then a
  separate ``output.add_(bias)``): the fused query/key/value projection's bias add is its own
  memory-bound kernel;
- the attention output and the MLP's second projection skip their bias (Megatron's
  ``skip_bias_add``) and hand it to ``bias_dropout_add`` (a ``torch.jit.script`` function Megatron
  runs fused: one kernel); the first MLP projection's bias goes to ``bias_gelu`` (fused the same way);
- attention unfused: ``baddbmm`` for the scores (here ``matmul``: the same GEMM, the scale folded in),
  Megatron's fused ``scaled_upper_triang_masked_softmax`` CUDA kernel (causal: it reads the lower
  triangle only), attention dropout, ``bmm`` with the values, then the context's
  ``permute(...).contiguous()`` copy;
- the logits cast to fp32 (``output.float()``) before the loss.

The three fused kernels are ``torch.library`` custom ops (namespace ``megatron``) with CPU/meta
implementations, autograd formulas, sharding rules (registered in autoshard's rule registry under
their qualified names) and kernel costs (``autoshard.passes.cost.kernel_classes.register_kernel``):
what each kernel reads and writes, from Megatron-LM's sources of April 2021
(``megatron/model/fused_bias_gelu.py``, ``megatron/model/transformer.py`` ``bias_dropout_add``,
``megatron/fused_kernels/scaled_upper_triang_masked_softmax.h``).

Activations are ``[batch, seq, hidden]`` (Megatron keeps ``[seq, batch, hidden]``; the kernels and
bytes are the same, and autoshard's microbatches cut dim 0).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.passes.cost.kernel_classes import register_kernel
from autoshard.passes.sharding.rules.elementwise import pointwise_rule
from autoshard.passes.sharding.rules.registry import OpCall, register_rule
from autoshard.passes.spec import Shard, Strategy1D

__all__ = ["megatron_gpt", "MegatronGPT", "lm_loss", "HIDDEN_DROPOUT", "ATTENTION_DROPOUT"]

#: Megatron-LM's defaults (megatron/arguments.py, 2021): --hidden-dropout 0.1, --attention-dropout 0.1
HIDDEN_DROPOUT = ATTENTION_DROPOUT = 0.1


# ---- megatron::bias_gelu: GeLU (tanh form) of x + bias, one fused kernel each way ---------------------

def _gelu(y):
    return y * 0.5 * (1.0 + torch.tanh(0.79788456 * y * (1 + 0.044715 * y * y)))


@torch.library.custom_op("megatron::bias_gelu", mutates_args=())
def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """``gelu(x + bias)`` with GeLU's tanh approximation (megatron/model/fused_bias_gelu.py)."""
    return _gelu(x + bias)


@bias_gelu.register_fake
def _bias_gelu_fake(x, bias):
    return torch.empty_like(x)


def _bias_gelu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _bias_gelu_backward(ctx, grad):
    x, bias = ctx.saved_tensors
    with torch.enable_grad():
        y = (x + bias).detach().requires_grad_()
        (gy,) = torch.autograd.grad(_gelu(y), y, grad)
    return gy, gy.reshape(-1, gy.shape[-1]).sum(0)


bias_gelu.register_autograd(_bias_gelu_backward, setup_context=_bias_gelu_setup)


# ---- megatron::bias_dropout_add: residual + dropout(x + bias), one fused kernel ------------------------

@torch.library.custom_op("megatron::bias_dropout_add", mutates_args=())
def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor, p: float) -> torch.Tensor:
    """``residual + dropout(x + bias, p)`` (megatron/model/transformer.py ``bias_dropout_add_fused_train``)."""
    return residual + F.dropout(x + bias, p=p, training=True)


@bias_dropout_add.register_fake
def _bias_dropout_add_fake(x, bias, residual, p):
    return torch.empty_like(residual)


def _bda_setup(ctx, inputs, output):
    x, bias, residual, p = inputs
    ctx.p = p
    # the kept-element mask: one byte per element (what the fused kernel's backward reads)
    ctx.save_for_backward(torch.ones_like(x, dtype=torch.bool))


def _bda_backward(ctx, grad):
    (mask,) = ctx.saved_tensors
    gx = grad * mask / (1.0 - ctx.p)
    return gx, gx.reshape(-1, gx.shape[-1]).sum(0), grad, None


bias_dropout_add.register_autograd(_bda_backward, setup_context=_bda_setup)


# ---- megatron::scaled_upper_triang_masked_softmax: causal softmax(scale * x), one kernel ---------------

@torch.library.custom_op("megatron::scaled_upper_triang_masked_softmax", mutates_args=())
def scaled_upper_triang_masked_softmax(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax over the last dim of ``scale * x`` with every key after the query masked (``x``:
    ``[..., sq, sk]``, sq == sk), as Megatron-LM's fused CUDA kernel computes it."""
    sq, sk = x.shape[-2], x.shape[-1]
    masked = torch.ones(sq, sk, dtype=torch.bool, device=x.device).triu(1)
    return torch.softmax((x.float() * scale).masked_fill(masked, float("-inf")), dim=-1).to(x.dtype)


@scaled_upper_triang_masked_softmax.register_fake
def _softmax_fake(x, scale):
    return torch.empty_like(x)


def _softmax_setup(ctx, inputs, output):
    ctx.scale = inputs[1]
    ctx.save_for_backward(output)


def _softmax_backward(ctx, grad):
    (y,) = ctx.saved_tensors
    gx = y * (grad - (grad * y).sum(-1, keepdim=True))
    return gx * ctx.scale, None


scaled_upper_triang_masked_softmax.register_autograd(_softmax_backward, setup_context=_softmax_setup)


# ---- how autoshard splits and prices them -----------------------------------------------------------

def _causal_softmax_rule(call: OpCall) -> list[Strategy1D]:
    """Every dim but the last two (the causal mask is by position in the whole sequence)."""
    return [Strategy1D((Shard(d),), (Shard(d),)) for d in range(len(call.inputs[0].shape) - 2)]


register_rule("megatron::bias_gelu", "megatron::bias_dropout_add")(pointwise_rule)
register_rule("megatron::scaled_upper_triang_masked_softmax")(_causal_softmax_rule)


def _x(ins):
    return ins[0].nbytes


# bias_gelu: forward reads x, writes y (the bias is a row); backward (bias_gelu_back) reads the gradient
# and x, writes x's gradient, and autograd reduces that into the bias's gradient: one more read
register_kernel("megatron::bias_gelu", "elementwise", fwd_bytes=lambda i, o: 2 * _x(i),
                bwd_bytes=lambda i, o: 4 * _x(i))
# bias_dropout_add: forward reads x and the residual, writes the output and the mask (1 byte per
# element); backward scales the gradient by the mask (reads both, writes x's gradient; the residual's
# gradient is the incoming one, no kernel) and reduces it into the bias's gradient
register_kernel("megatron::bias_dropout_add", "elementwise",
                fwd_bytes=lambda i, o: 3 * _x(i) + i[0].numel, bwd_bytes=lambda i, o: 3 * _x(i) + i[0].numel)
# the causal softmax (scaled_upper_triang_masked_softmax_warp_forward / _backward): each row reads its
# elements up to the diagonal (half the scores) and writes the whole row; the backward reads the
# gradient and the output up to the diagonal and writes the whole input gradient
register_kernel("megatron::scaled_upper_triang_masked_softmax", "softmax",
                fwd_bytes=lambda i, o: _x(i) / 2 + o[0].nbytes, bwd_bytes=lambda i, o: 2 * o[0].nbytes)


# ---- the model ------------------------------------------------------------------------------------

class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.heads = heads
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, x):
        b, s, h = x.shape
        hn = h // self.heads
        # PyTorch 1.8's F.linear on a 3-D input: matmul, then the bias added by its own kernel
        mixed = torch.matmul(x, self.query_key_value.weight.t()) + self.query_key_value.bias
        q, k, v = mixed.view(b, s, self.heads, 3 * hn).split(hn, dim=-1)
        scores = torch.matmul(q.permute(0, 2, 1, 3), k.permute(0, 2, 3, 1))
        probs = scaled_upper_triang_masked_softmax(scores, 1.0 / math.sqrt(hn))
        probs = F.dropout(probs, ATTENTION_DROPOUT, self.training)
        context = torch.matmul(probs, v.permute(0, 2, 1, 3))
        context = context.permute(0, 2, 1, 3).contiguous().view(b, s, h)
        return torch.matmul(context, self.dense.weight.t()), self.dense.bias   # skip_bias_add


class MLP(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(hidden, 4 * hidden)
        self.dense_4h_to_h = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        y = bias_gelu(torch.matmul(x, self.dense_h_to_4h.weight.t()), self.dense_h_to_4h.bias)
        return torch.matmul(y, self.dense_4h_to_h.weight.t()), self.dense_4h_to_h.bias


class TransformerLayer(nn.Module):
    def __init__(self, hidden: int, heads: int):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden, eps=1e-5)
        self.attention = SelfAttention(hidden, heads)
        self.post_attention_layernorm = nn.LayerNorm(hidden, eps=1e-5)
        self.mlp = MLP(hidden)

    def forward(self, x):
        out, bias = self.attention(self.input_layernorm(x))
        x = bias_dropout_add(out, bias, x, HIDDEN_DROPOUT)
        out, bias = self.mlp(self.post_attention_layernorm(x))
        return bias_dropout_add(out, bias, x, HIDDEN_DROPOUT)


class MegatronGPT(nn.Module):
    """``forward(ids [b, s]) -> fp32 logits [b, s, vocab]`` (the output layer tied to the word embedding)."""

    def __init__(self, layers: int, hidden: int, heads: int, seq: int, vocab: int):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden)
        self.position_embeddings = nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(TransformerLayer(hidden, heads) for _ in range(layers))
        self.final_layernorm = nn.LayerNorm(hidden, eps=1e-5)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        x = F.dropout(x, HIDDEN_DROPOUT, self.training)
        for layer in self.layers:
            x = layer(x)
        x = self.final_layernorm(x)
        return torch.matmul(x, self.word_embeddings.weight.t()).float()   # parallel_lm_logits, then .float()


def lm_loss(logits, target):
    """Megatron's language-model loss: cross entropy over the fp32 logits, averaged over the tokens."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def megatron_gpt(layers: int, hidden: int, heads: int, seq: int, vocab: int, dtype=torch.float16) -> MegatronGPT:
    """The model on the meta device in ``dtype`` (the 2021 runs: fp16 with a loss scale)."""
    with torch.device("meta"):
        return MegatronGPT(layers, hidden, heads, seq, vocab).to(dtype)
