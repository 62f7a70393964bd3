"""The Hugging Face zoo: tiny configs of many transformers architectures, each with a batch and a loss.

    model, inputs, target, loss_fn = ZOO["llama"]()      # build on the current device, seeded by the caller
    loss = loss_fn(model(**inputs), target)              # what autoshard's program computes

Every builder returns ``(model, example_inputs, target, loss_fn)``: ``example_inputs`` is a dict of
keyword tensors for one GLOBAL batch of ``BATCH`` (8, divisible by 4 ranks), ``loss_fn(output,
target)`` a scalar from exactly what the model returns (its HF output object, as ``capture`` passes it).
Configs are tiny (2 layers, width 32, 4 heads, vocabulary 96, sequence 8), dropout is 0 and
caches are off, so a model builds in milliseconds and trains deterministically.

``KINDS`` says what each architecture is (encoder, decoder, encoder-decoder, vision, MoE). MoE
models use the experts implementation ``transformers`` picks by default (``grouped_mm`` in 5.x),
which capture turns into one ``autoshard::moe_experts`` op (``passes.capture.moe_experts``);
``mixtral_batched`` uses the ``batched_mm`` one (each token gathers its experts' weights, then
``bmm``) and ``mixtral_grouped_mm`` keeps ``grouped_mm`` as written (``autoshard_fuse = False``).
In float32 under ``torch.export`` the ``grouped_mm`` path calls transformers' own custom op
``transformers::grouped_mm_fallback`` (``aten._grouped_mm`` traces in bfloat16 only), so these
float32 models exercise a framework's ``torch.library`` op; top-k routing, ``sort``, ``histc``
and ``cumsum`` offsets and an inverse permutation written with ``index_put_`` come with it.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from autoshard.testing.models import BATCH, hf_lm_loss

__all__ = ["ZOO", "KINDS", "VOCAB", "SEQ", "build"]

VOCAB = 96
SEQ = 8
WIDTH = 32
HEADS = 4
LAYERS = 2

_COMMON = dict(use_cache=False)


def _ids(vocab: int = VOCAB, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, seq))


def _causal(model) -> tuple:
    return model, {"input_ids": _ids()}, _ids(), hf_lm_loss


def _classes(output, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.logits, target)


# ---- decoders --------------------------------------------------------------------------------

def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    return _causal(GPT2LMHeadModel(GPT2Config(
        n_layer=LAYERS, n_embd=WIDTH, n_head=HEADS, vocab_size=VOCAB, n_positions=32, attn_pdrop=0, resid_pdrop=0,
        embd_pdrop=0, bos_token_id=0, eos_token_id=0, **_COMMON)))


def gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    return _causal(GPTNeoXForCausalLM(GPTNeoXConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=HEADS, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=32, rotary_pct=0.5, hidden_dropout=0, attention_dropout=0,
        bos_token_id=0, eos_token_id=0, **_COMMON)))


def opt():
    from transformers import OPTConfig, OPTForCausalLM
    return _causal(OPTForCausalLM(OPTConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=HEADS, ffn_dim=64, vocab_size=VOCAB,
        max_position_embeddings=32, word_embed_proj_dim=WIDTH, dropout=0, attention_dropout=0, pad_token_id=1,
        bos_token_id=0, eos_token_id=0, **_COMMON)))


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM
    return _causal(LlamaForCausalLM(LlamaConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, intermediate_size=64, num_attention_heads=HEADS,
        num_key_value_heads=2, vocab_size=VOCAB, **_COMMON)))


def mistral():
    from transformers import MistralConfig, MistralForCausalLM
    return _causal(MistralForCausalLM(MistralConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, intermediate_size=64, num_attention_heads=HEADS,
        num_key_value_heads=2, vocab_size=VOCAB, sliding_window=4, **_COMMON)))


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    return _causal(Qwen2ForCausalLM(Qwen2Config(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, intermediate_size=64, num_attention_heads=HEADS,
        num_key_value_heads=2, vocab_size=VOCAB, **_COMMON)))


def falcon():
    from transformers import FalconConfig, FalconForCausalLM
    return _causal(FalconForCausalLM(FalconConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=HEADS, vocab_size=VOCAB,
        hidden_dropout=0, attention_dropout=0, bos_token_id=0, eos_token_id=0, **_COMMON)))


def gemma():
    from transformers import GemmaConfig, GemmaForCausalLM
    return _causal(GemmaForCausalLM(GemmaConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, intermediate_size=64, num_attention_heads=HEADS,
        num_key_value_heads=1, head_dim=8, vocab_size=VOCAB, **_COMMON)))


def phi():
    from transformers import PhiConfig, PhiForCausalLM
    return _causal(PhiForCausalLM(PhiConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, intermediate_size=64, num_attention_heads=HEADS,
        vocab_size=VOCAB, partial_rotary_factor=0.5, resid_pdrop=0, embd_pdrop=0, attention_dropout=0, **_COMMON)))


# ---- mixtures of experts ------------------------------------------------------------------------

def mixtral(experts_implementation: str | None = None):
    from transformers import MixtralConfig, MixtralForCausalLM
    config = MixtralConfig(num_hidden_layers=LAYERS, hidden_size=WIDTH, intermediate_size=32,
                           num_attention_heads=HEADS, num_key_value_heads=2, vocab_size=VOCAB, num_local_experts=4,
                           num_experts_per_tok=2, router_jitter_noise=0.0, **_COMMON)
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    return _causal(MixtralForCausalLM(config))


def mixtral_batched():
    return mixtral("batched_mm")


def mixtral_grouped_mm():
    """Mixtral with its experts traced as transformers writes them (``autoshard_fuse = False``): the
    library's grouped-GEMM custom op, sort, histc and cumsum offsets, instead of one ``moe_experts`` op."""
    model, *rest = mixtral()
    for module in model.modules():
        if hasattr(module, "gate_up_proj"):
            module.autoshard_fuse = False
    return (model, *rest)


def qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    return _causal(Qwen2MoeForCausalLM(Qwen2MoeConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_attention_heads=HEADS, num_key_value_heads=2, vocab_size=VOCAB,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, **_COMMON)))


def deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    return _causal(DeepseekV3ForCausalLM(DeepseekV3Config(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, intermediate_size=64, moe_intermediate_size=16,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=VOCAB, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        max_position_embeddings=32, num_mtp_layers=0, **_COMMON)))


# ---- encoders ----------------------------------------------------------------------------------

def bert():
    from transformers import BertConfig, BertForMaskedLM
    model = BertForMaskedLM(BertConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=HEADS, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0, attention_probs_dropout_prob=0))
    return model, {"input_ids": _ids(), "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)}, _ids(), hf_lm_loss


def roberta():
    from transformers import RobertaConfig, RobertaForMaskedLM
    model = RobertaForMaskedLM(RobertaConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=HEADS, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=32, hidden_dropout_prob=0, attention_probs_dropout_prob=0,
        pad_token_id=1))
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))  # no padding tokens: positions count from padding_idx + 1
    return model, {"input_ids": ids}, _ids(), hf_lm_loss


# ---- encoder-decoders --------------------------------------------------------------------------

def t5():
    from transformers import T5Config, T5ForConditionalGeneration
    model = T5ForConditionalGeneration(T5Config(
        num_layers=LAYERS, num_decoder_layers=LAYERS, d_model=WIDTH, d_kv=8, d_ff=64, num_heads=HEADS,
        vocab_size=VOCAB, dropout_rate=0, decoder_start_token_id=0, pad_token_id=0, **_COMMON))
    return model, {"input_ids": _ids(), "decoder_input_ids": _ids()}, _ids(), hf_lm_loss


def bart():
    from transformers import BartConfig, BartForConditionalGeneration
    model = BartForConditionalGeneration(BartConfig(
        encoder_layers=LAYERS, decoder_layers=LAYERS, d_model=WIDTH, encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
        max_position_embeddings=32, dropout=0, attention_dropout=0, activation_dropout=0, **_COMMON))
    return model, {"input_ids": _ids(), "decoder_input_ids": _ids()}, _ids(), hf_lm_loss


def whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    config = WhisperConfig(encoder_layers=LAYERS, decoder_layers=LAYERS, d_model=WIDTH, encoder_attention_heads=HEADS,
                           decoder_attention_heads=HEADS, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB,
                           num_mel_bins=8, max_source_positions=8, max_target_positions=16, dropout=0,
                           attention_dropout=0, activation_dropout=0, pad_token_id=0, bos_token_id=0,
                           eos_token_id=0, decoder_start_token_id=0, **_COMMON)
    model = WhisperForConditionalGeneration(config)
    features = torch.randn(BATCH, config.num_mel_bins, 2 * config.max_source_positions)
    return model, {"input_features": features, "decoder_input_ids": _ids()}, _ids(), hf_lm_loss


# ---- vision ------------------------------------------------------------------------------------

def vit():
    from transformers import ViTConfig, ViTForImageClassification
    model = ViTForImageClassification(ViTConfig(
        num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=HEADS, intermediate_size=64,
        image_size=16, patch_size=4, num_channels=3, num_labels=10, hidden_dropout_prob=0,
        attention_probs_dropout_prob=0))
    return model, {"pixel_values": torch.randn(BATCH, 3, 16, 16)}, torch.randint(0, 10, (BATCH,)), _classes


def _clip_loss(out, target: torch.Tensor) -> torch.Tensor:
    """CLIP's symmetric contrastive loss: image i matches text i (``target`` = arange)."""
    return (F.cross_entropy(out.logits_per_image, target) + F.cross_entropy(out.logits_per_text, target)) / 2


def clip():
    from transformers import CLIPConfig, CLIPModel
    # The text tower pools at the first end-of-text token: put one last in every sequence, so the pooled
    # position attends to all (pooled at position 0, causal attention gives q/k exactly zero gradients).
    text = dict(num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=HEADS, intermediate_size=64,
                vocab_size=VOCAB, max_position_embeddings=SEQ, attention_dropout=0, bos_token_id=0,
                eos_token_id=VOCAB - 1, pad_token_id=1)
    vision = dict(num_hidden_layers=LAYERS, hidden_size=WIDTH, num_attention_heads=HEADS, intermediate_size=64,
                  image_size=16, patch_size=4, attention_dropout=0)
    model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=WIDTH))
    ids = torch.randint(2, VOCAB - 1, (BATCH, SEQ))
    ids[:, -1] = VOCAB - 1
    inputs = {"input_ids": ids, "pixel_values": torch.randn(BATCH, 3, 16, 16)}
    return model, inputs, torch.arange(BATCH), _clip_loss


ZOO: dict[str, Callable] = {
    "bert": bert, "roberta": roberta,
    "t5": t5, "bart": bart, "whisper": whisper,
    "vit": vit, "clip": clip,
    "gpt2": gpt2, "gpt_neox": gpt_neox, "opt": opt, "llama": llama, "mistral": mistral, "qwen2": qwen2,
    "falcon": falcon, "gemma": gemma, "phi": phi,
    "mixtral": mixtral, "mixtral_batched": mixtral_batched, "mixtral_grouped_mm": mixtral_grouped_mm,
    "qwen2_moe": qwen2_moe, "deepseek_v3": deepseek_v3,
}

KINDS = {
    "bert": "encoder", "roberta": "encoder", "t5": "encoder-decoder", "bart": "encoder-decoder",
    "whisper": "encoder-decoder (audio)", "vit": "vision", "clip": "vision + text", "gpt2": "decoder",
    "gpt_neox": "decoder", "opt": "decoder", "llama": "decoder", "mistral": "decoder", "qwen2": "decoder",
    "falcon": "decoder (multi-query, parallel attention)", "gemma": "decoder", "phi": "decoder",
    "mixtral": "MoE (experts as one moe_experts op)",
    "mixtral_batched": "MoE (batched_mm experts)", "mixtral_grouped_mm": "MoE (grouped-GEMM experts as written)",
    "qwen2_moe": "MoE", "deepseek_v3": "MoE (MLA)",
}


def build(name: str):
    """``ZOO[name]()`` with a clear error for an unknown name."""
    if name not in ZOO:
        raise KeyError(f"no zoo model {name!r}; known: {sorted(ZOO)}")
    return ZOO[name]()
