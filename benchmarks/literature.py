"""Published large-scale training runs priced from their own layouts, predicted next to measured.

    python benchmarks/literature.py [--json residuals.json] [--sensitivity]

Each row is a published run: its model, cluster, parallel layout, schedule, recomputation and the
figure its authors measured. The step is priced with autoshard's calibrated cost-model primitives --
achievable GEMM / attention / memory-bound throughput (``passes/cost/kernels.py``), NCCL's collective
model (``passes/cost/nccl.py``), the compute/communication stream overlap (``passes/cost/overlap.py``)
-- over an analytic description of one transformer layer (every GEMM with its local shape, the
memory-bound ops with their bytes, the collectives the layout runs), then the pipeline schedule.
Nothing here is fitted to these rows: the hardware constants are the presets' cited ones.

This prices the layout directly from the model's shapes; it does not go through ``autoshard.plan``'s
capture (planning a 1T model on meta takes minutes per row on this machine).

Rows:
- Megatron-LM 2021 (Narayanan et al., SC21, Table 1): ten GPT models on 32-3072 A100 80GB (Selene,
  8 per node, 8 x HDR 200 Gb/s), sequence 2048, vocabulary 51200, full activation recomputation,
  fp16 (static loss scale), attention unfused (two batched GEMMs + fused softmax + dropout). TP, PP,
  microbatch size, interleaved virtual stages and the DDP implementation as in the paper's own
  launch script (Megatron-LM ``examples/sc21/run_table_1.sh``): PyTorch DDP (bucketed all-reduce
  under the last microbatch's backward) for the pp=1 rows, Megatron's local DDP (all-reduce after the
  backward) for the others, fp16 gradients all-reduced (no ``--accumulate-allreduce-grads-in-fp32``).
  The measured figure is their TFLOP/s per GPU with their accounting
  ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` per iteration.
- torchtitan (PyTorch; docs/performance.md of 2024-12 and benchmarks/llama3_h100_202412_torchtitan.md):
  Llama-3.1 8B on 8 H100 (FSDP, selective op-level AC: every other matmul output saved), Llama-3 70B
  on 64 A100 (FSDP, full AC), Llama-3.1 405B on 128 H100 (FSDP 16 x TP 8 with sequence parallel, full
  AC); bf16 compute, fp32 gradient reduction, eager, SDPA's flash attention; tokens/s per GPU. The
  eager ops are priced by the bytes torchtitan's own code moves (TT_* below) and the H100 rows on the
  cards torchtitan names (96 GB HBM2e, 500 W: ``HARDWARE["h100-96gb-500w"]``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Optional

from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.cost.kernels import attention_seconds, gemm_seconds, memory_seconds, optimizer_seconds
from autoshard.passes.cost.nccl import nccl_p2p_seconds, nccl_terms
from autoshard.passes.cost.overlap import compute_slowdown, overlap_step

BF16 = 2

#: The H100s of torchtitan's runs (torchtitan benchmarks/llama3_h100_202412_torchtitan.md, "Hardware"
#: and footnote 2; docs/performance.md of 2024-12 for the 405B row): Grand Teton hosts, SXM H100 with
#: 96 GB HBM2e at 2.4 TB/s peak, run at the default 500 W power limit, "the actual peak TFLOPs number
#: is between SXM and NVL, and we don't know its exact value". We take the dense bf16 peak linear in
#: the power limit between the two datasheet points, H100 NVL (350-400 W: 1,671 sparse = 835.5 dense
#: TFLOPS, H100 NVL datasheet) and H100 SXM (700 W: 989), at 500 W: 886.8 TFLOPS. An assumption
#: inside the range its owners give, not a measurement; the rest (SMs, NVLink, NICs: 400 Gb/s per GPU,
#: as the same file says) is the h100 preset.
H100_NVL_DENSE, H100_NVL_WATTS = 1671e12 / 2, 400.0
H100_SXM_DENSE, H100_SXM_WATTS = 989e12, 700.0
GRAND_TETON_WATTS = 500.0
HARDWARE = dict(PRESETS)
#: The attention kernel torchtitan's torch ran: SDPA's priority order in late 2024 put the flash kernel
#: (FlashAttention-2) first and cuDNN attention last (the order quoted in pytorch/pytorch#138907,
#: 2024-10); torch 2.11, which the h100 preset's attention fields describe, picks cuDNN attention first on H100.
#: Measured with SDPA held to its flash kernel, causal 2 x 32 x 8192 x 128, forward + backward:
#: 0.305 of peak (benchmarks/gpu_layer_probe.py, benchmarks/gpu_layer_probe_h100.json), counting the
#: backward as FlashAttention-2's 2.5x the forward (Dao 2023; the probe's flash kernel took 2.53x).
TORCH_2024_FLASH_ATTENTION_H100 = 0.305
TORCH_2024_FLASH_BACKWARD_FACTOR = 2.5
HARDWARE["h100-96gb-500w"] = dataclasses.replace(
    PRESETS["h100"], name="h100-96gb-500w", memory_bandwidth=2.4e12, memory_bytes=96e9,
    flops_bf16=H100_NVL_DENSE + (H100_SXM_DENSE - H100_NVL_DENSE) * (GRAND_TETON_WATTS - H100_NVL_WATTS)
    / (H100_SXM_WATTS - H100_NVL_WATTS), attention_efficiency=TORCH_2024_FLASH_ATTENTION_H100,
    attention_backward_factor=TORCH_2024_FLASH_BACKWARD_FACTOR)

#: What the A100 rows' error depends on: the A100's sustained GEMM rate has no measurement here (the
#: project's devices are H100 / H200), so ``--sensitivity`` reprices every row with each published
#: A100 figure in turn. The preset uses the one measured as the H100 / H200 presets' figures are
#: (8192^3, random data, at the power limit); picking another because it brings the rows into the band
#: would fit the constant to the validation rows.
A100_GEMM_ALTERNATIVES = (
    # (label, whole-wave GEMM cap as a fraction of 312 TFLOPS, source)
    ("preset: random data at 400 W, 257", PRESETS["a100"].gemm_efficiency,
     "He 2024, 'Strangely, matrix multiplications on GPUs run faster when given predictable data': "
     "8192^3 with torch.randn inputs on A100 SXM, 257 TFLOPS (295 with zeros); 2048 tiles = 18.96 waves"),
    ("MAMF burst, 267.9", 267.9 / 312,
     "Bekman, ml-engineering compute/accelerator MAMF table (torch 2.x, cuBLAS 12): a boost-clock burst, "
     "the maximum over shapes"),
    ("HPL clock 1305 / 1410 x MAMF", 267.9 / 312 * 1305 / 1410,
     "NVIDIA's HPL Rpeak clock for A100 at its power limit, 1305 MHz (Lockwood, 'peak FLOPS' notes); "
     "Bekman's rule MSMF ~ Theory x saturated/boost clock, applied to the MAMF figure: a lower bound, "
     "since on H200 the same rule on MAMF undershoots the measured MSMF by 12%"),
    ("2020 CUTLASS 2.4 kernel, 235", 235.138 / 312,
     "CUTLASS 2.4 docs (media/docs/profiler.md): 3456x4096x8192 f16 tensor-op GEMM on A100, 235.1 TFLOPS, "
     "one kernel, burst; the Megatron 2021 runs' software era (4 whole waves)"),
)

# Bytes each eager op of torchtitan's Llama moves per element (read + written), from its source at the
# benchmarked commit (pytorch/torchtitan 9dec370, 2024-12-26; torchtitan/models/norms.py RMSNorm,
# torchtitan/models/llama/model.py apply_rotary_emb / repeat_kv / Attention.forward, train.py loss):
#: RMSNorm: x.float() (2+4), pow(2) (4+4), mean (4), x * rsqrt (4+4), type_as (4+2), * weight (2+2)
TT_RMSNORM_BYTES = 36
#: RoPE on q and k: .float() (2+4), complex multiply by freqs_cis (4+4), type_as (4+2)
TT_ROPE_BYTES = 20
#: repeat_kv's expand().reshape() copy, per element written (2+2), for keys and values
TT_REPEAT_KV_BYTES = 4
#: the attention output's transpose(1, 2).contiguous() copy (2+2)
TT_TRANSPOSE_BYTES = 4
#: residual add (2+2+2); SwiGLU silu(w1 x) (2+2) * w3 x (2+2+2), per FFN element
TT_ADD_BYTES, TT_SWIGLU_BYTES = 6, 10
#: cross entropy over fp32 logits: forward .float() (2+4) + log_softmax (two reads and a write, 4+4+4);
#: backward nll's zero-filled gradient (4) + log_softmax backward (4+4+4) + the cast back (4+2)
TT_CE_FWD_BYTES, TT_CE_BWD_BYTES = 18, 22
#: torch.optim.AdamW(foreach=True), torchtitan's default (``fused = job_config.optimizer.fused``, off):
#: per fp32 parameter _foreach_mul_ (8), lerp_ (12), mul_ (8), addcmul_ (12), sqrt (8), div_ (8), add_ (8),
#: addcdiv_ (16) = 80 bytes; clip_grad_norm_(max_norm=1.0, foreach): the norm reads (4), _foreach_mul_ (8)
TT_OPTIMIZER_BYTES = 80 + 12
#: FSDP2 (torch.distributed._composable.fsdp, Dec 2024): each all-gather's copy-out into the unsharded
#: parameters (split_with_sizes_copy, 2+2 bytes per bf16 parameter) and each reduce-scatter's copy-in
#: (_chunk_cat with the cast to the fp32 reduce dtype, 2+4), on the GPU's memory like any kernel
FSDP_COPY_OUT_BYTES, FSDP_COPY_IN_BYTES = 4, 6
#: Megatron-LM 2021 with --fp16 (megatron/optimizer/optimizer.py, apex multi-tensor kernels): fp16 grads
#: to fp32 main grads (2+4), unscale and inf check (4+4), grad-norm clip (4 + 4+4), FusedAdam (28),
#: fp32 main params back to the fp16 model (4+2)
MEGATRON_OPTIMIZER_BYTES = 6 + 8 + 12 + 28 + 6


@dataclass
class Run:
    """One published run and its layout."""
    name: str
    hardware: str
    layers: int
    hidden: int
    heads: int
    ffn: int
    vocab: int
    seq: int
    batch: int          # global batch, sequences
    tp: int
    pp: int
    dp: int
    measured: float
    unit: str           # "TFLOP/s/GPU" (Megatron's accounting) or "tok/s/GPU"
    kv_heads: Optional[int] = None
    microbatch: int = 1
    virtual_stages: int = 1          # interleaved 1F1B: model chunks per pipeline rank (Megatron's
                                     # --num-layers-per-virtual-pipeline-stage)
    ddp_overlap: bool = False        # PyTorch DDP: bucketed gradient all-reduce overlapping the last
                                     # microbatch's backward (Megatron --DDP-impl torch); False: after it
    grad_bytes: int = 4              # bytes per gradient element all-reduced (fp16 Megatron 2021: 2)
    gated_mlp: bool = False          # SwiGLU: two up projections
    recompute: str = "full"          # "full", "selective" (torchtitan op-level), "none"
    sequence_parallel: bool = False
    fsdp: bool = False               # parameters sharded over dp, gathered per layer (torchtitan FSDP2)
    flash: bool = True               # fused attention; False: batched GEMMs + softmax (Megatron 2021)
    dropout: bool = False
    source: str = ""

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def params(self) -> float:
        kv = self.kv_heads or self.heads
        hd = self.hidden // self.heads
        attn = self.hidden * (self.hidden + 2 * kv * hd) + self.hidden * self.hidden
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.ffn
        return self.layers * (attn + mlp) + 2 * self.vocab * self.hidden


def megatron_flops(r: Run) -> float:
    """Narayanan et al. 2021, eq. 3: FLOPs per iteration with activation recomputation."""
    B, s, l, h, V = r.batch, r.seq, r.layers, r.hidden, r.vocab
    return 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def collective(kind: str, g: int, m: int, hw, nbytes: float) -> float:
    if g * m <= 1:
        return 0.0
    return min(f + p * nbytes for f, p in nccl_terms(kind, g, m, hw))


def group(size: int, stride: int, hw) -> tuple[int, int]:
    """(members per node, nodes) of a group of ``size`` ranks ``stride`` apart (row-major ranks)."""
    per_node = hw.devices_per_node
    if size * stride <= per_node:
        return size, 1
    g = max(1, min(size, per_node // stride))
    return g, size // g


def layer_times(r: Run, hw) -> dict:
    """Seconds of one transformer layer for one microbatch on one rank: forward compute, backward
    compute, the forward's memory-bound part, and exposed tensor-parallel communication per pass."""
    t, b, s, h = r.tp, r.microbatch, r.seq, r.hidden
    kv = r.kv_heads or r.heads
    hd = h // r.heads
    tok = b * s
    if r.gated_mlp:   # torchtitan: separate wq, wk, wv
        gemms = [gemm_seconds(hw, 1, tok, h // t, h)] + [gemm_seconds(hw, 1, tok, kv * hd // t, h)] * 2
    else:             # Megatron: one fused query_key_value
        gemms = [gemm_seconds(hw, 1, tok, (h + 2 * kv * hd) // t, h)]
    gemms += [gemm_seconds(hw, 1, tok, h, h // t)]                        # output projection
    ups = 2 if r.gated_mlp else 1
    gemms += [gemm_seconds(hw, 1, tok, r.ffn // t, h)] * ups + [gemm_seconds(hw, 1, tok, h, r.ffn // t)]
    gemm_f = sum(gemms)
    heads = r.heads // t
    if r.flash:
        attn_f, attn_b = attention_seconds(hw, b * heads, s, s, hd, causal=True)
        attn_mem = 0.0
    else:  # QK^T and AV batched GEMMs, fused scale-mask-softmax and dropout on the b*heads*s*s scores
        attn_f = (gemm_seconds(hw, b * heads, s, s, hd) + gemm_seconds(hw, b * heads, s, hd, s))
        attn_b = 2 * attn_f
        scores = b * heads * s * s
        attn_mem = memory_seconds(hw, scores * (4 + (5 if r.dropout else 0)))
    act = tok * h * BF16 / (t if r.sequence_parallel else 1)   # what the norms and residuals stream
    ffn_act = tok * r.ffn // t * BF16
    if r.gated_mlp:   # torchtitan's eager ops, bytes per element from its source (TT_* above)
        n_act = tok * h / (t if r.sequence_parallel else 1)   # elements the norms and residuals stream
        q_k = tok * heads * hd + tok * max(1, kv // t) * hd
        elementwise = [memory_seconds(hw, TT_RMSNORM_BYTES * n_act)] * 2 \
            + [memory_seconds(hw, TT_ADD_BYTES * n_act)] * 2 \
            + [memory_seconds(hw, TT_ROPE_BYTES * q_k)] \
            + [memory_seconds(hw, TT_REPEAT_KV_BYTES * tok * heads * hd)] * 2 \
            + [memory_seconds(hw, TT_TRANSPOSE_BYTES * tok * heads * hd)] \
            + [memory_seconds(hw, TT_SWIGLU_BYTES * tok * r.ffn / t)]
    else:             # LayerNorm (2), fused bias-dropout-add (3.5), fused bias-GeLU (2)
        elementwise = [memory_seconds(hw, 2 * act)] * 2 + [memory_seconds(hw, 3.5 * act)] * 2 \
            + [memory_seconds(hw, 2 * ffn_act)]
    mem_f = sum(elementwise) + attn_mem
    fwd = gemm_f + attn_f + mem_f
    bwd = 2 * gemm_f + attn_b + 2 * mem_f
    # two tensor-parallel collectives per pass (all-reduce, or all-gather + reduce-scatter with SP)
    g, m = group(t, 1, hw)
    payload = tok * h * BF16
    if r.sequence_parallel:
        tp_pass = 2 * (collective("all_gather", g, m, hw, payload) + collective("reduce_scatter", g, m, hw, payload))
    else:
        tp_pass = 2 * collective("all_reduce", g, m, hw, payload)
    if r.recompute == "full":
        recompute = fwd
        tp_recompute = tp_pass
    elif r.recompute == "selective":  # torchtitan's op policy: every other matmul and the elementwise ops
        recompute = 0.5 * gemm_f + mem_f
        tp_recompute = 0.0
    else:
        recompute, tp_recompute = 0.0, 0.0
    return {"fwd": fwd, "bwd": bwd + recompute, "tp_fwd": tp_pass, "tp_bwd": tp_pass + tp_recompute}


def head_times(r: Run, hw) -> tuple[float, float]:
    """(forward, backward) seconds of the LM head and the loss for one microbatch on one rank."""
    tok = r.microbatch * r.seq
    logits = gemm_seconds(hw, 1, tok, r.vocab // r.tp, r.hidden)
    n = tok * r.vocab // r.tp
    if r.gated_mlp:   # torchtitan: final RMSNorm, cross entropy over fp32 logits
        norm = memory_seconds(hw, TT_RMSNORM_BYTES * tok * r.hidden / (r.tp if r.sequence_parallel else 1))
        return norm + logits + memory_seconds(hw, TT_CE_FWD_BYTES * n), \
            2 * norm + 2 * logits + memory_seconds(hw, TT_CE_BWD_BYTES * n)
    loss = memory_seconds(hw, n * 4 * 4)  # fp32 softmax: read/write twice per pass
    return logits + loss, 2 * logits + loss


def step_time(r: Run) -> dict:
    """Predicted seconds of one iteration of ``r`` and its parts."""
    hw = HARDWARE[r.hardware]
    lt = layer_times(r, hw)
    per_stage = r.layers / r.pp
    m = r.batch // (r.dp * r.microbatch)
    head_f, head_b = head_times(r, hw)
    # the slowest stage: the last one holds the head and the loss
    f = per_stage * (lt["fwd"] + lt["tp_fwd"]) + head_f
    bwd = per_stage * (lt["bwd"] + lt["tp_bwd"]) + head_b
    params_local = r.params / (r.tp * r.pp)
    slow = compute_slowdown(hw)
    dp_g, dp_m = group(r.dp, r.tp, hw)
    if r.fsdp:  # FSDP2: bf16 weight all-gathers per layer (forward, again in backward), fp32 reduce-scatters
        layer_params = (r.params - 2 * r.vocab * r.hidden) / r.layers / (r.tp * r.pp)
        gather = collective("all_gather", dp_g, dp_m, hw, layer_params * BF16)
        reduce = collective("reduce_scatter", dp_g, dp_m, hw, layer_params * 4)
        emb = 2 * r.vocab * r.hidden / (r.tp * r.pp)
        gather_all = per_stage * gather + collective("all_gather", dp_g, dp_m, hw, emb * BF16)
        reduce_all = per_stage * reduce + collective("reduce_scatter", dp_g, dp_m, hw, emb * 4)
        # FSDP2's copy-out after each gather (forward, backward) and copy-in before each reduce-scatter
        copies = memory_seconds(hw, layer_params * FSDP_COPY_OUT_BYTES)
        compute_f = per_stage * (lt["fwd"] + copies) + head_f
        compute_b = per_stage * (lt["bwd"] + copies + memory_seconds(hw, layer_params * FSDP_COPY_IN_BYTES)) + head_b
        tp_comm = per_stage * (lt["tp_fwd"] + lt["tp_bwd"])
        ov = overlap_step(fwd_compute=compute_f * m, bwd_compute=compute_b * m, exposed=tp_comm * m,
                          fwd_prefetch=gather_all * m, bwd_prefetch=gather_all * m, bwd_reduce=reduce_all * m,
                          blocks=int(per_stage) * m, slowdown=slow)
        body = ov.step_time
        grad_sync = 0.0
        opt = optimizer_seconds(hw, params_local / r.dp, bytes_per_param=TT_OPTIMIZER_BYTES)
        exposed, hidden = ov.exposed, ov.hidden
    else:
        p2p = 0.0
        v = r.virtual_stages
        if r.pp > 1:  # activations (scattered over the TP ranks, Megatron's scatter/gather) to the next
            # stage and gradients back; an interleaved schedule crosses stages v times per microbatch
            msg = r.microbatch * r.seq * r.hidden * BF16 / r.tp
            same_node = r.tp * r.pp <= hw.devices_per_node
            p2p = 2 * v * nccl_p2p_seconds(hw, msg, same_node)
        slot = f + bwd + p2p
        # 1F1B: m slots plus the fill and drain bubble, (p - 1) / v slots with v model chunks per rank
        body = (m + (r.pp - 1) / v) * slot
        grad_sync = collective("all_reduce", dp_g, dp_m, hw, params_local * r.grad_bytes)
        if r.pp > 1:  # the tied word embedding's gradient, all-reduced between the first and the last
            # stage after the backward (Megatron-LM 2021 megatron/training.py train_step)
            same_node = r.tp * r.pp <= hw.devices_per_node
            grad_sync += collective("all_reduce", 2 if same_node else 1, 1 if same_node else 2, hw,
                                    r.vocab * r.hidden / r.tp * r.grad_bytes)
        opt = optimizer_seconds(hw, params_local, bytes_per_param=MEGATRON_OPTIMIZER_BYTES)
        hidden = 0.0
        if r.ddp_overlap and r.pp == 1:
            # DDP's buckets all-reduce during the last microbatch's backward (no_sync before it)
            tp_last = per_stage * (lt["tp_fwd"] + lt["tp_bwd"])
            ov = overlap_step(fwd_compute=f - per_stage * lt["tp_fwd"], bwd_compute=bwd - per_stage * lt["tp_bwd"],
                              exposed=tp_last, bwd_reduce=grad_sync, blocks=int(per_stage), slowdown=slow)
            body = (m - 1) * slot + ov.step_time
            hidden = ov.hidden
            grad_sync = 0.0
        exposed = (m + (r.pp - 1) / v) * (per_stage * (lt["tp_fwd"] + lt["tp_bwd"]) + p2p) + grad_sync
    total = body + grad_sync + opt
    return {"step": total, "optimizer": opt, "grad_sync": grad_sync, "exposed_comm": exposed,
            "hidden_comm": hidden, "microbatches": m}


def predicted(r: Run, t: float) -> float:
    if r.unit == "TFLOP/s/GPU":
        return megatron_flops(r) / t / r.gpus / 1e12
    return r.batch * r.seq / t / r.gpus


def _megatron(name, heads, h, layers, tp, pp, gpus, batch, measured, mbs, virtual, ddp) -> Run:
    return Run(name, "a100", layers, h, heads, 4 * h, 51200, 2048, batch, tp, pp, gpus // (tp * pp), measured,
               "TFLOP/s/GPU", microbatch=mbs, virtual_stages=virtual, ddp_overlap=ddp == "torch", grad_bytes=2,
               flash=False, dropout=True, recompute="full",
               source="Narayanan et al. 2021 (SC21), Table 1; layout, microbatch, virtual stages and DDP as in "
                      "Megatron-LM examples/sc21/run_table_1.sh")


RUNS = [
    _megatron("Megatron 1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1, "torch"),
    _megatron("Megatron 3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1, "torch"),
    _megatron("Megatron 7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1, "torch"),
    _megatron("Megatron 18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1, "torch"),
    _megatron("Megatron 39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1, "local"),
    _megatron("Megatron 76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3, "local"),
    _megatron("Megatron 145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2, "local"),
    _megatron("Megatron 310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2, "local"),
    _megatron("Megatron 529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3, "local"),
    _megatron("Megatron 1T", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1, "local"),
    Run("torchtitan Llama-3.1 8B", "h100-96gb-500w", 32, 4096, 32, 14336, 128256, 8192, 16, 1, 1, 8, 5762, "tok/s/GPU",
        kv_heads=8, microbatch=2, gated_mlp=True, recompute="selective", fsdp=True,
        source="torchtitan docs/performance.md (FSDP 8, selective AC)"),
    Run("torchtitan Llama-3 70B", "a100", 80, 8192, 64, 28672, 128256, 8192, 64, 1, 1, 64, 331, "tok/s/GPU",
        kv_heads=8, microbatch=1, gated_mlp=True, recompute="full", fsdp=True,
        source="torchtitan docs/performance.md (FSDP 64, full AC)"),
    Run("torchtitan Llama-3.1 405B", "h100-96gb-500w", 126, 16384, 128, 53248, 128256, 8192, 32, 8, 1, 16, 109, "tok/s/GPU",
        kv_heads=8, microbatch=2, gated_mlp=True, recompute="full", fsdp=True, sequence_parallel=True,
        source="torchtitan docs/performance.md (FSDP 16 x TP 8, full AC)"),
]


def spearman(xs: list, ys: list) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out
    rx, ry = ranks(xs), ranks(ys)
    n = len(xs)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="", help="write the residuals here")
    ap.add_argument("--sensitivity", action="store_true",
                    help="also reprice every row with each published A100 GEMM figure (none is applied)")
    args = ap.parse_args()
    rows = []
    print(f"{'run':<28} {'GPUs':>5} {'layout':<22} {'measured':>16} {'predicted':>10} {'error':>7}  step s")
    for r in RUNS:
        parts = step_time(r)
        pred = predicted(r, parts["step"])
        err = pred / r.measured - 1
        rows.append((r, pred, err, parts))
        layout = f"tp{r.tp} pp{r.pp} dp{r.dp}" + (" fsdp" if r.fsdp else "") + f" m{parts['microbatches']}"
        print(f"{r.name:<28} {r.gpus:>5} {layout:<22} {r.measured:>7g} {r.unit:<9}{pred:>9.1f} {100 * err:>+6.1f}%"
              f"  {parts['step']:.3f}")
    errs = [e for _, _, e, _ in rows]
    # rank correlation over the rows of one unit each (ranks across units mean nothing)
    within, mean_abs, rhos = summary([(r, pred, err) for r, pred, err, _ in rows])
    print(f"\nrows within +-15%: {within}/{len(errs)} [goal: all]; mean |error| {100 * mean_abs:.1f}% "
          f"[goal <= 10%]; Spearman (measured vs predicted) " + ", ".join(f"{u} {v:.2f}" for u, v in rhos.items())
          + " [goal >= 0.9]")
    print(f"signed errors: median {100 * sorted(errs)[len(errs) // 2]:+.1f}%, min {100 * min(errs):+.1f}%, "
          f"max {100 * max(errs):+.1f}%")
    if args.sensitivity:
        sensitivity()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({r.name: {"measured": r.measured, "predicted": pred, "error": err} for r, pred, err, _ in rows},
                      fh, indent=1)


def summary(rows: list) -> tuple[int, float, dict]:
    """(rows within +-15%, mean |error|, Spearman per unit) of ``(run, predicted, error)`` rows."""
    errs = [e for _, _, e in rows]
    groups = {}
    for r, pred, _ in rows:
        groups.setdefault(r.unit, []).append((r.measured, pred))
    rhos = {u: spearman([a for a, _ in v], [b for _, b in v]) for u, v in groups.items() if len(v) > 2}
    return sum(abs(e) <= 0.15 for e in errs), sum(abs(e) for e in errs) / len(errs), rhos


def sensitivity() -> None:
    """Every row repriced with each figure of ``A100_GEMM_ALTERNATIVES`` as the A100's GEMM cap."""
    print("\nA100 GEMM sensitivity (the first is the preset; only the A100 rows change):")
    print(f"{'A100 GEMM cap':<32} {'of peak':>7}  {'within':>6}  {'mean':>6}  Megatron signed errors")
    preset = HARDWARE["a100"]
    try:
        for label, cap, _source in A100_GEMM_ALTERNATIVES:
            HARDWARE["a100"] = dataclasses.replace(preset, gemm_efficiency=cap)
            rows = []
            for r in RUNS:
                pred = predicted(r, step_time(r)["step"])
                rows.append((r, pred, pred / r.measured - 1))
            within, mean_abs, _ = summary(rows)
            megatron = [e for r, _, e in rows if r.unit == "TFLOP/s/GPU"]
            print(f"{label:<32} {cap:>7.3f}  {within:>3}/{len(rows):<2}  {100 * mean_abs:>5.1f}%  "
                  f"{100 * min(megatron):+.1f}% .. {100 * max(megatron):+.1f}%")
    finally:
        HARDWARE["a100"] = preset
    for label, _cap, source in A100_GEMM_ALTERNATIVES:
        print(f"  {label}: {source}")


if __name__ == "__main__":
    main()
