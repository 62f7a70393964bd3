"""Published large-scale training runs priced from their own layouts, predicted next to measured.

    python benchmarks/literature.py [--json residuals.json]

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
  8 per node, 8 x HDR 200 Gb/s), sequence 2048, vocabulary 51200, TP and PP as published, full
  activation recomputation, 1F1B, fp16 with fp32 main gradients all-reduced after the backward
  (no overlap in 2021's Megatron), attention unfused (two batched GEMMs + fused softmax + dropout).
  The measured figure is their TFLOP/s per GPU with their accounting
  ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` per iteration. Microbatch size 1 (not in Table 1:
  an assumption).
- torchtitan (PyTorch, docs/performance.md as quoted in issue 16): Llama-3.1 8B on 8 H100 (FSDP,
  selective op-level AC: every other matmul output saved), Llama-3 70B on 64 A100 (FSDP, full AC),
  Llama-3.1 405B on 128 H100 (FSDP 16 x TP 8 with sequence parallel, full AC); bf16 compute, fp32
  gradient reduction, eager, flash attention through SDPA; tokens/s per GPU.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from typing import Optional

from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.cost.kernels import attention_seconds, gemm_seconds, memory_seconds, optimizer_seconds
from autoshard.passes.cost.nccl import nccl_p2p_seconds, nccl_terms
from autoshard.passes.cost.overlap import compute_slowdown, overlap_step

BF16 = 2


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
    gemms = [gemm_seconds(hw, 1, tok, (h + 2 * kv * hd) // t, h),       # q, k, v
             gemm_seconds(hw, 1, tok, h, h // t)]                         # output projection
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
    if r.gated_mlp:   # eager RMSNorm in fp32 (~6 passes), residual adds (3), RoPE on q, k (4), SwiGLU (5)
        elementwise = [memory_seconds(hw, 6 * act)] * 2 + [memory_seconds(hw, 3 * act)] * 2 \
            + [memory_seconds(hw, 4 * tok * (h + kv * hd) // t * BF16)] + [memory_seconds(hw, 5 * ffn_act)]
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
    loss = memory_seconds(hw, tok * r.vocab // r.tp * 4 * 4)  # fp32 softmax: read/write twice per pass
    return logits + loss, 2 * logits + loss


def step_time(r: Run) -> dict:
    """Predicted seconds of one iteration of ``r`` and its parts."""
    hw = PRESETS[r.hardware]
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
        compute_f = per_stage * lt["fwd"] + head_f
        compute_b = per_stage * lt["bwd"] + head_b
        tp_comm = per_stage * (lt["tp_fwd"] + lt["tp_bwd"])
        ov = overlap_step(fwd_compute=compute_f * m, bwd_compute=compute_b * m, exposed=tp_comm * m,
                          fwd_prefetch=gather_all * m, bwd_prefetch=gather_all * m, bwd_reduce=reduce_all * m,
                          blocks=int(per_stage) * m, slowdown=slow)
        body = ov.step_time
        grad_sync = 0.0
        opt = optimizer_seconds(hw, params_local / r.dp)
        exposed, hidden = ov.exposed, ov.hidden
    else:
        p2p = 0.0
        if r.pp > 1:  # activations (scattered over the TP ranks, Megatron's scatter/gather) to the next stage
            msg = r.microbatch * r.seq * r.hidden * BF16 / r.tp
            same_node = r.tp * r.pp <= hw.devices_per_node
            p2p = 2 * nccl_p2p_seconds(hw, msg, same_node)
        slot = f + bwd + p2p
        body = (m + r.pp - 1) * slot
        grad_sync = collective("all_reduce", dp_g, dp_m, hw, params_local * 4)   # fp32 main grads
        opt = optimizer_seconds(hw, params_local, bytes_per_param=28 + 2 + 4)    # + fp16 copy, grad read
        exposed = (m + r.pp - 1) * (per_stage * (lt["tp_fwd"] + lt["tp_bwd"]) + p2p) + grad_sync
        hidden = 0.0
    total = body + grad_sync + opt
    return {"step": total, "optimizer": opt, "grad_sync": grad_sync, "exposed_comm": exposed,
            "hidden_comm": hidden, "microbatches": m}


def predicted(r: Run, t: float) -> float:
    if r.unit == "TFLOP/s/GPU":
        return megatron_flops(r) / t / r.gpus / 1e12
    return r.batch * r.seq / t / r.gpus


def _megatron(name, heads, h, layers, tp, pp, gpus, batch, measured) -> Run:
    return Run(name, "a100", layers, h, heads, 4 * h, 51200, 2048, batch, tp, pp, gpus // (tp * pp), measured,
               "TFLOP/s/GPU", flash=False, dropout=True, recompute="full",
               source="Narayanan et al. 2021 (SC21), Table 1")


RUNS = [
    _megatron("Megatron 1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    _megatron("Megatron 3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    _megatron("Megatron 7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    _megatron("Megatron 18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _megatron("Megatron 39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    _megatron("Megatron 76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _megatron("Megatron 145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _megatron("Megatron 310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _megatron("Megatron 529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _megatron("Megatron 1T", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    Run("torchtitan Llama-3.1 8B", "h100", 32, 4096, 32, 14336, 128256, 8192, 16, 1, 1, 8, 5762, "tok/s/GPU",
        kv_heads=8, microbatch=2, gated_mlp=True, recompute="selective", fsdp=True,
        source="torchtitan docs/performance.md (FSDP 8, selective AC)"),
    Run("torchtitan Llama-3 70B", "a100", 80, 8192, 64, 28672, 128256, 8192, 64, 1, 1, 64, 331, "tok/s/GPU",
        kv_heads=8, microbatch=1, gated_mlp=True, recompute="full", fsdp=True,
        source="torchtitan docs/performance.md (FSDP 64, full AC)"),
    Run("torchtitan Llama-3.1 405B", "h100", 126, 16384, 128, 53248, 128256, 8192, 32, 8, 1, 16, 109, "tok/s/GPU",
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
    within = sum(abs(e) <= 0.15 for e in errs)
    mean_abs = sum(abs(e) for e in errs) / len(errs)
    # rank correlation over the rows of one unit each (ranks across units mean nothing), averaged
    groups = {}
    for r, pred, _, _ in rows:
        groups.setdefault(r.unit, []).append((r.measured, pred))
    rhos = {u: spearman([a for a, _ in v], [b for _, b in v]) for u, v in groups.items() if len(v) > 2}
    print(f"\nrows within +-15%: {within}/{len(errs)} [goal: all]; mean |error| {100 * mean_abs:.1f}% "
          f"[goal <= 10%]; Spearman (measured vs predicted) " + ", ".join(f"{u} {v:.2f}" for u, v in rhos.items())
          + " [goal >= 0.9]")
    print(f"signed errors: median {100 * sorted(errs)[len(errs) // 2]:+.1f}%, min {100 * min(errs):+.1f}%, "
          f"max {100 * max(errs):+.1f}%")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({r.name: {"measured": r.measured, "predicted": pred, "error": err} for r, pred, err, _ in rows},
                      fh, indent=1)


if __name__ == "__main__":
    main()
