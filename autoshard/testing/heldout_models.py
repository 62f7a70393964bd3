"""Models the memory estimate was never tuned on: Hugging Face Llama, OPT and Gemma of a few million
parameters, at a realistic vocabulary and sequence (issue 27's held-out rows).

``HELDOUT[name]()`` returns ``(model, batch, loss_fn, None)`` in ``levers.build``'s form, so
``levers.layouts`` runs them as ``"mid:llama"``, ``"mid:opt"``, ``"mid:gemma"``: ``batch(n, seed)``
gives ``({"input_ids": (n, SEQ)}, target (n, SEQ))``. Vocabulary 8,192, width 256, 3 layers, MLP
1,024, 4 heads; Llama untied (7.3 M parameters), OPT and Gemma tie the head to the embedding
(as their configs do by default). At ``levers.MICRO`` = 8 samples of 128 tokens the logits are
8 x 128 x 8,192 floats (33.5 MB), the size of everything else in the step together: the regime
where the loss, not the blocks, sets the peak. ``"small:llama"``: the same vocabulary at width 64, 2
layers, 64 tokens (1.2 M parameters), for a test.
"""
from __future__ import annotations

from typing import Callable

import torch

from .models import hf_lm_loss

__all__ = ["HELDOUT", "HELDOUT_BLOCKS", "VOCAB", "SEQ"]

VOCAB = 8192
SEQ = 128
WIDTH = 256
LAYERS = 3
FFN = 1024
HEADS = 4


def _batcher(seq: int) -> Callable:
    def batch(n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        return ({"input_ids": torch.randint(0, VOCAB, (n, seq), generator=g)},
                torch.randint(0, VOCAB, (n, seq), generator=g))
    return batch


def llama(width: int = WIDTH, layers: int = LAYERS, ffn: int = FFN, seq: int = SEQ):
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=layers, hidden_size=width, intermediate_size=ffn, num_attention_heads=HEADS,
        num_key_value_heads=HEADS, vocab_size=VOCAB, max_position_embeddings=seq, use_cache=False))


def opt():
    from transformers import OPTConfig, OPTForCausalLM
    return OPTForCausalLM(OPTConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=HEADS, ffn_dim=FFN, vocab_size=VOCAB,
        max_position_embeddings=SEQ, word_embed_proj_dim=WIDTH, dropout=0, attention_dropout=0, pad_token_id=1,
        bos_token_id=0, eos_token_id=0, use_cache=False))


def gemma():
    from transformers import GemmaConfig, GemmaForCausalLM
    return GemmaForCausalLM(GemmaConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, intermediate_size=FFN, num_attention_heads=HEADS,
        num_key_value_heads=1, head_dim=64, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False))


def _builder(make: Callable, seq: int = SEQ, **config) -> Callable:
    def build():
        return make(**config, **({"seq": seq} if config else {})), _batcher(seq), hf_lm_loss, None
    return build


#: name -> builder of ``(model, batch, loss_fn, megatron_layers)``
HELDOUT: dict[str, Callable] = {"mid:llama": _builder(llama), "mid:opt": _builder(opt), "mid:gemma": _builder(gemma),
                                 # the same vocabulary, 1.2 M parameters: fast enough for a test
                                 "small:llama": _builder(llama, seq=64, width=64, layers=2, ffn=256)}
#: each model's repeated-block type (its per-block lever policy's key)
HELDOUT_BLOCKS = {"mid:llama": "model.layers.#", "mid:opt": "model.decoder.layers.#", "mid:gemma": "model.layers.#",
                  "small:llama": "model.layers.#"}
