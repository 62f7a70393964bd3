"""Published large-scale training runs priced through ``autoshard.plan(layout=...)``, predicted next to
measured.

    python benchmarks/literature.py [--only 1.7B,8B] [--json residuals.json] [--sensitivity]
    python benchmarks/literature.py --held-out [--microbatch 2]

Each row is a published run: its model, built on the meta device from the run's shape with the kernels
the run executed, its cluster, and its parallel layout as an ``autoshard.layouts`` value. The step is
what ``autoshard.plan(model, mesh, layout=..., hardware=...)`` estimates: the path that chooses plans,
with the cost model's per-op prices (``passes/cost``), collectives, schedule simulator and all. Nothing
here is fitted to these rows: the hardware constants are the presets' cited ones, the kernel classes
``passes/cost/kernel_classes.py``'s, and the models' kernels and bytes are the runs' own code's.

Rows:
- Megatron-LM 2021 (Narayanan et al., SC21, Table 1): ten GPT models on 32-3072 A100 80GB (Selene,
  8 per node, 8 x HDR 200 Gb/s), sequence 2048, vocabulary 51200, full activation recomputation,
  fp16 (loss-scaled), the model ``megatron_gpt_2021.py`` builds (Megatron's fused kernels, unfused
  attention, PyTorch 1.8's bias add, the context's permute copy). TP, PP, microbatch size,
  interleaved virtual stages and the DDP implementation as in the paper's own launch script
  (Megatron-LM ``examples/sc21/run_table_1.sh``): PyTorch DDP (``--DDP-impl torch``: the gradient
  all-reduce overlapped with the backward, ``overlap_grad_reduce=True``) for the pp=1 rows,
  Megatron's local DDP (after the backward) for the others; no sequence parallelism (2022); fp16
  gradients accumulated and all-reduced; Megatron's mixed-precision Adam (``optimizer="megatron_adam"``).
  The measured figure is their TFLOP/s per GPU with their accounting
  ``96 B s l h^2 (1 + s/(6h) + V/(16 l h))`` per iteration.
- torchtitan (PyTorch; docs/performance.md of 2024-12 and benchmarks/llama3_h100_202412_torchtitan.md):
  Llama-3.1 8B on 8 H100 (FSDP, torchtitan's selective op AC: ``checkpoint="selective_op"``, attention
  and every other matmul output kept, the rest recomputed), Llama-3 70B on 64 A100 (FSDP, full AC), Llama-3.1 405B on 128 H100 (FSDP 16 x TP 8
  with sequence parallel, full AC); the model ``torchtitan_llama_2024.py``
  builds, bf16 compute with fp32 masters and reductions (``MixedPrecision``), foreach AdamW; tokens/s
  per GPU. The H100 rows run on the cards torchtitan names (96 GB HBM2e, 500 W:
  ``HARDWARE["h100-96gb-500w"]``) with the attention kernel its torch ran.

A pipelined row's step is the schedule simulator's; a row without a pipeline takes the plan's
overlapped step (``estimated["overlapped_step_s"]``) when the layout's runtime overlaps its data-
parallel collectives (``Layout.overlaps_communication``: FSDP2, PyTorch DDP), else its additive one.
Published layouts ran, so rows are priced without the memory limit; the estimated peak is printed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

import autoshard
from autoshard import layouts
from autoshard.passes.cost.hardware import PRESETS, Hardware

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from megatron_gpt_2021 import lm_loss as megatron_loss, megatron_gpt  # noqa: E402
from torchtitan_llama_2024 import lm_loss as torchtitan_loss, torchtitan_llama  # noqa: E402

GiB = 2 ** 30

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
#: The attention kernel torchtitan's torch ran: SDPA's priority order in late 2024 put the flash kernel
#: (FlashAttention-2) first and cuDNN attention last (the order quoted in pytorch/pytorch#138907,
#: 2024-10); torch 2.11, which the h100 preset's attention fields describe, picks cuDNN attention first on H100.
#: Measured with SDPA held to its flash kernel, causal 2 x 32 x 8192 x 128, forward + backward:
#: 0.305 of peak (benchmarks/gpu_layer_probe.py, benchmarks/gpu_layer_probe_h100.json), counting the
#: backward as FlashAttention-2's 2.5x the forward (Dao 2023; the probe's flash kernel took 2.53x).
TORCH_2024_FLASH_ATTENTION_H100 = 0.305
TORCH_2024_FLASH_BACKWARD_FACTOR = 2.5
HARDWARE: dict[str, Hardware] = dict(PRESETS)
HARDWARE["h100-96gb-500w"] = dataclasses.replace(
    PRESETS["h100"], name="h100-96gb-500w", memory_bandwidth=2.4e12, memory_bytes=96e9,
    flops_bf16=H100_NVL_DENSE + (H100_SXM_DENSE - H100_NVL_DENSE) * (GRAND_TETON_WATTS - H100_NVL_WATTS)
    / (H100_SXM_WATTS - H100_NVL_WATTS), attention_efficiency=TORCH_2024_FLASH_ATTENTION_H100,
    attention_backward_factor=TORCH_2024_FLASH_BACKWARD_FACTOR)

#: Jean Zay's A100 partition, where BLOOM trained (BigScience 2022, "BLOOM", sec. 3.4 / the model card's
#: "Compute infrastructure"): 8 A100 80GB SXM per node on NVLink, and between nodes four Omni-Path
#: 100 Gb/s links per node, shared by its 8 GPUs: 4 x 12.5 GB/s / 8 = 6.25 GB/s per GPU. The rest is the
#: a100 preset (its NIC efficiency included: no published Omni-Path NCCL figure is used here).
JEAN_ZAY_OMNIPATH_PER_GPU = 4 * 12.5e9 / 8
HARDWARE["a100-jean-zay"] = dataclasses.replace(PRESETS["a100"], name="a100-jean-zay",
                                                inter_node_bandwidth=JEAN_ZAY_OMNIPATH_PER_GPU)

#: What the A100 rows' error depends on: the A100's sustained GEMM rate has no measurement here (the
#: project's devices are H100 / H200), so ``--sensitivity`` reprices the A100 rows with each published
#: A100 figure in turn. The preset uses the one measured as the H100 / H200 presets' figures are
#: (8192^3, random data, at the power limit); picking another because it brings the rows into the band
#: would fit the constant to the validation rows. Each figure is the whole-wave cap: the measured rate
#: times the waves the measured shape paid over the waves its tiles fill.
A100_GEMM_ALTERNATIVES = (
    # (label, whole-wave GEMM cap as a fraction of 312 TFLOPS, source)
    ("preset: random data at 400 W, 257", PRESETS["a100"].gemm_efficiency,
     "He 2024, 'Strangely, matrix multiplications on GPUs run faster when given predictable data': "
     "8192^3 with torch.randn inputs on A100 SXM, 257 TFLOPS (295 with zeros); 2048 tiles = 18.96 waves"),
    ("MAMF burst, 267.9", 267.9 / 312 * 19 / (2048 / 108),
     "Bekman, ml-engineering compute/accelerator MAMF table (torch 2.x, cuBLAS 12): a boost-clock burst, "
     "the maximum over shapes (taken as 8192^3's 18.96 waves)"),
    ("HPL clock 1305 / 1410 x MAMF", 267.9 / 312 * 1305 / 1410 * 19 / (2048 / 108),
     "NVIDIA's HPL Rpeak clock for A100 at its power limit, 1305 MHz (Lockwood, 'peak FLOPS' notes); "
     "Bekman's rule MSMF ~ Theory x saturated/boost clock, applied to the MAMF figure"),
    ("2020 CUTLASS 2.4 kernel, 235", 235.138 / 312 * 5 / (448 / 108),
     "CUTLASS 2.4 docs (media/docs/profiler.md): 3456x4096x8192 f16 tensor-op GEMM on A100, 235.1 TFLOPS, "
     "one kernel, burst, the Megatron 2021 runs' software era; its 256x128 tiles: 14 x 32 = 448 tiles on "
     "108 SMs = 4.15 waves, paid as 5 (this table said 4 before: it mis-stated the kernel as a low rate)"),
)


@dataclass
class Row:
    """One published run and how it is planned."""
    name: str
    gpus: int
    build: Callable[[], torch.nn.Module]
    loss_fn: Callable
    batch: int
    seq: int
    mesh: tuple
    layout: layouts.Layout
    hardware: str
    measured: float
    unit: str                      # "TFLOP/s/GPU" (Megatron's accounting) or "tok/s/GPU"
    optimizer: str = "adamw"
    mixed_precision: Optional[autoshard.MixedPrecision] = None
    flops: float = 0.0             # per iteration, the paper's accounting (TFLOP/s rows)
    source: str = ""

    def predicted(self, step: float) -> float:
        if self.unit == "TFLOP/s/GPU":
            return self.flops / step / self.gpus / 1e12
        return self.batch * self.seq / step / self.gpus

    def measured_step(self) -> float:
        if self.unit == "TFLOP/s/GPU":
            return self.flops / (self.measured * 1e12 * self.gpus)
        return self.batch * self.seq / (self.measured * self.gpus)


def megatron_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Narayanan et al. 2021, eq. 3: FLOPs per iteration with activation recomputation."""
    return 96 * batch * seq * layers * hidden ** 2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


def _megatron(name, heads, h, layers, tp, pp, gpus, batch, measured, mbs, virtual, ddp) -> Row:
    seq, vocab = 2048, 51200
    layout = layouts.megatron(tp=tp, pp=pp, microbatch_size=mbs, virtual_stages=virtual, recompute="full",
                              sequence_parallel=False, overlap_grad_reduce=ddp == "torch")
    return Row(name, gpus, lambda: megatron_gpt(layers, h, heads, seq, vocab), megatron_loss, batch, seq,
               (gpus // tp, tp), layout, "a100", measured, "TFLOP/s/GPU", optimizer="megatron_adam",
               flops=megatron_flops(batch, seq, layers, h, vocab),
               source="Narayanan et al. 2021 (SC21), Table 1; layout, microbatch, virtual stages and DDP as in "
                      "Megatron-LM examples/sc21/run_table_1.sh")


BF16 = autoshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _torchtitan(name, gpus, hw, shape, batch, mesh, layout, measured) -> Row:
    layers, dim, heads, kv, ffn = shape
    return Row(name, gpus, lambda: torchtitan_llama(layers, dim, heads, kv, ffn, 128256, 8192), torchtitan_loss,
               batch, 8192, mesh, layout, hw, measured, "tok/s/GPU", optimizer="adamw", mixed_precision=BF16,
               source="torchtitan docs/performance.md and benchmarks/llama3_h100_202412_torchtitan.md (2024-12)")


ROWS = [
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
    _torchtitan("torchtitan Llama-3.1 8B", 8, "h100-96gb-500w", (32, 4096, 32, 8, 14336), 16, (8,),
                layouts.fsdp(checkpoint="selective_op"), 5762),
    _torchtitan("torchtitan Llama-3 70B", 64, "a100", (80, 8192, 64, 8, 28672), 64, (64,),
                layouts.fsdp(checkpoint="full"), 331),
    _torchtitan("torchtitan Llama-3.1 405B", 128, "h100-96gb-500w", (126, 16384, 128, 8, 53248), 32, (16, 8),
                layouts.fsdp(tp=8, checkpoint="full"), 109),
]


def _mt_nlg(nodes: int, step_s: float, measured: float) -> Row:
    """Megatron-Turing NLG 530B (Smith et al. 2022, sec. 2.4): 105 blocks of 20480, 128 heads, sequence
    2048, batch 1920 on DGX A100 nodes, tensor 8 x pipeline 35 x data (nodes x 8 / 280), full recomputation,
    gradients reduced after the backward; the paper's iteration time and TFLOP/s per GPU (its accounting,
    eq. 3 above). Its pipeline is DeepSpeed's engine (deepspeed/runtime/pipe/):
    - ``TrainSchedule`` runs each stage's forwards and backwards in 1F1B's order (schedule.py
      ``_step_to_micro_batch``; tests/passes/pipeline/test_deepspeed_train_order.py) and issues each send
      and receive as its own blocking ``dist.send`` / ``dist.recv`` (p2p.py): ``blocking_p2p``;
    - with tensor parallelism it sends a stage's output as each tp rank's 1/tp piece (plus a small
      metadata tensor) and the receiver all-gathers it over tp (engine.py: ``is_pipe_partitioned =
      is_model_parallel``, ``PartitionedTensor``, since the engine's first release of 2020-09; gradients
      partitioned the same way since 2021-09-29, DeepSpeed #1407): ``scatter_gather_tensors_in_pipeline``;
    - those pieces are ``PartitionedTensor``s: each gather (``full()``) fills, copies and clones the whole
      tensor around its all-gather, each send clones its piece out first, and the sender all-gathers its
      own output again before its backward (``part_output.full()``): ``deepspeed_partitioned_tensors``
      (``passes/pipeline/stages/partitioned_tensors.py``).
    The paper does not give the microbatch size (``--microbatch`` reprices at another); 1 is assumed, as
    in Megatron-LM's own 530B run (Table 1 above)."""
    layers, h, heads, seq, vocab, batch = 105, 20480, 128, 2048, 50272, 1920
    gpus = nodes * 8
    layout = layouts.megatron(tp=8, pp=35, microbatch_size=1, recompute="full", sequence_parallel=False,
                              scatter_gather_tensors_in_pipeline=True, blocking_p2p=True,
                              deepspeed_partitioned_tensors=True)
    return Row(f"MT-NLG 530B, {nodes} nodes ({step_s} s)", gpus, lambda: megatron_gpt(layers, h, heads, seq, vocab),
               megatron_loss, batch, seq, (gpus // 8, 8), layout, "a100", measured, "TFLOP/s/GPU",
               optimizer="megatron_adam", flops=megatron_flops(batch, seq, layers, h, vocab),
               source="Smith et al. 2022, 'Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B', sec. 2.4")


def _bloom() -> Row:
    """BLOOM 176B (BigScience 2022) as it trained on Jean Zay, 384 A100 80GB (48 nodes): the run's launch
    script (bigscience-workshop/bigscience ``train/tr11-176B-ml/tr11-176B-ml.slurm``): 70 blocks of 14336,
    112 heads, sequence 2048, vocabulary padded to 250880, global batch 2048 in microbatches of 2, tensor 4
    x pipeline 12 x data 8, full recomputation (``--checkpoint-activations``), bf16 with DeepSpeed's
    ``BF16_Optimizer`` (its own ZeRO-1: optimizer state split over the data axis, ``distributed_optimizer``),
    the pipeline DeepSpeed's engine as in the MT-NLG rows (blocking p2p, ``PartitionedTensor`` boundaries),
    cut by ``--pp-partition-method 'type:transformer|embedding'``: 72 units (the tied embedding at both
    ends) over 12 stages, so the first and the last stage hold 5 blocks. Measured: the run's log of
    2022-03-18 (``chronicles.md``, iteration 12695 at global batch 2048): 105.22 s per iteration, 149.02
    TFLOP/s per GPU (Megatron-DeepSpeed's accounting, eq. 3 above). ``BF16_Optimizer`` keeps fp32 gradients
    (deepspeed/runtime/bf16_optimizer.py: ``update_hp_grads`` adds each microbatch's bf16 ``.grad`` into an
    fp32 gradient, ``get_grads_for_reduction`` hands the fp32 flat gradients to the data-parallel
    reduction): ``accumulate_allreduce_grads_in_fp32``, as Megatron-LM forces it with ``--bf16``.
    Not priced: ALiBi's score bias and the embedding LayerNorm (the model is Megatron's 2021 GPT with
    learned positions), ``CUDA_LAUNCH_BLOCKING=1`` (set in the script), and the bf16 gradients DeepSpeed's
    pipeline engine keeps beside the fp32 ones (it calls ``update_hp_grads(clear_lp_grads=False)`` after
    each backward; Megatron-LM frees each ``.grad`` once added, which is what the flag prices): 2 B per
    element, about 5 GiB per GPU more than the estimate on a middle stage."""
    layers, h, heads, seq, vocab, batch = 70, 14336, 112, 2048, 250880, 2048
    tp, pp, gpus = 4, 12, 384
    layout = layouts.megatron(tp=tp, pp=pp, microbatch_size=2, recompute="full", sequence_parallel=False,
                              distributed_optimizer=True, decoder_first_pipeline_num_layers=5,
                              decoder_last_pipeline_num_layers=5, scatter_gather_tensors_in_pipeline=True,
                              blocking_p2p=True, deepspeed_partitioned_tensors=True,
                              accumulate_allreduce_grads_in_fp32=True)
    return Row("BLOOM 176B (105.22 s)", gpus, lambda: megatron_gpt(layers, h, heads, seq, vocab, torch.bfloat16),
               megatron_loss, batch, seq, (gpus // tp, tp), layout, "a100-jean-zay", 149.02, "TFLOP/s/GPU",
               optimizer="megatron_adam", flops=megatron_flops(batch, seq, layers, h, vocab),
               source="BigScience, tr11-176B-ml.slurm and chronicles.md (2022-03-18 log line)")


#: Held out: published runs not used while building the cost model (``--held-out``).
HELD_OUT = [_mt_nlg(280, 60.1, 126), _mt_nlg(350, 50.2, 121), _mt_nlg(420, 44.4, 113), _bloom()]


def price(row: Row, hardware: Union[str, Hardware, None] = None) -> dict:
    """Plan ``row``'s layout through ``autoshard.plan`` and return its step and what makes it up."""
    model = row.build()
    ids = torch.empty(row.batch, row.seq, dtype=torch.long, device="meta")
    hw = HARDWARE[row.hardware] if hardware is None else hardware
    t0, c0 = time.perf_counter(), time.process_time()
    plan = autoshard.plan(model, row.mesh, example_inputs=(ids,), loss_fn=row.loss_fn, example_target=ids,
                          layout=row.layout, hardware=hw, optimizer=row.optimizer,
                          mixed_precision=row.mixed_precision, memory_limit=1e15)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    if plan.pipelined:
        step = plan.estimated_step_time
        parts = {"bubble": plan.bubble_fraction}
        how = f"pp {plan.pp} x v{plan.virtual} {plan.schedule}, m {plan.microbatches}, simulated"
    else:
        est = plan.solution.estimated
        overlapped = row.layout.overlaps_communication and "overlapped_step_s" in est
        step = est["overlapped_step_s"] if overlapped else plan.estimated_step_time
        parts = {k: v for k, v in plan.solution.time_breakdown.items()}
        how = f"k {plan.solution.levers.accumulation}, " + ("overlapped" if overlapped else "additive")
    return {"step": step, "plan_s": seconds, "cpu_s": cpu, "memory": plan.estimated_memory, "parts": parts,
            "how": how, "m": plan.microbatches if plan.pipelined else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated substrings of row names")
    ap.add_argument("--json", default="", help="write the residuals here")
    ap.add_argument("--held-out", action="store_true", help="price the held-out published runs instead (HELD_OUT)")
    ap.add_argument("--microbatch", type=int, default=0,
                    help="what-if: price the rows at this microbatch size instead of their own (the MT-NLG paper "
                         "does not state its own)")
    ap.add_argument("--sensitivity", action="store_true",
                    help="also reprice the A100 rows with each published A100 GEMM figure (none is applied)")
    args = ap.parse_args()
    rows = [r for r in (HELD_OUT if args.held_out else ROWS)
            if not args.only or any(k.strip() in r.name for k in args.only.split(","))]
    if args.microbatch:
        rows = [dataclasses.replace(r, name=f"{r.name} mbs {args.microbatch}",
                                    layout=dataclasses.replace(r.layout, microbatch_size=args.microbatch))
                for r in rows]
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}; "
          "every row through autoshard.plan(layout=...)")
    print(f"{'run':<27} {'GPUs':>5} {'measured':>17} {'predicted':>9} {'error':>7}  {'step s (meas.)':>16} "
          f"{'step err':>8}  {'plan s (CPU)':>13} {'peak GiB':>8}  how")
    out, t_all, c_all = [], time.perf_counter(), time.process_time()
    for r in rows:
        got = price(r)
        pred = r.predicted(got["step"])
        err = pred / r.measured - 1
        out.append((r, pred, err, got))
        print(f"{r.name:<27} {r.gpus:>5} {r.measured:>7g} {r.unit:<9} {pred:>9.1f} {100 * err:>+6.1f}%  "
              f"{got['step']:>7.3f} ({r.measured_step():>6.3f}) {100 * (got['step'] / r.measured_step() - 1):>+7.1f}%  "
              f"{got['plan_s']:>6.1f} ({got['cpu_s']:>4.0f}) "
              f"{got['memory'] / GiB:>8.1f}  "
              f"{r.layout.describe().split(':', 1)[0]} {got['how']}", flush=True)
    total, cpu = time.perf_counter() - t_all, time.process_time() - c_all
    within, mean_abs, rhos = summary([(r, p, e) for r, p, e, _ in out])
    errs = [e for _, _, e, _ in out]
    step_errs = [g["step"] / r.measured_step() - 1 for r, _, _, g in out]
    print(f"\nstep time: rows within +-15%: {sum(abs(e) <= 0.15 for e in step_errs)}/{len(out)} [goal: all]; "
          f"mean |error| {100 * sum(abs(e) for e in step_errs) / len(out):.1f}% [goal <= 10%]")
    print(f"throughput: rows within +-15%: {within}/{len(out)}; mean |error| {100 * mean_abs:.1f}%; "
          "Spearman (measured vs predicted) " + ", ".join(f"{u} {v:.2f}" for u, v in rhos.items()) + " [goal >= 0.9]")
    print(f"throughput signed errors: median {100 * sorted(errs)[len(errs) // 2]:+.1f}%, min {100 * min(errs):+.1f}%, "
          f"max {100 * max(errs):+.1f}%; all rows planned in {total:.0f} s wall, {cpu:.0f} CPU s of this process "
          f"[goal <= 600 s on 2 quiet cores; load average now {os.getloadavg()[0]:.1f}]")
    fit_per_microbatch(out)
    if args.sensitivity:
        sensitivity([r for r in rows if r.hardware == "a100"])
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({r.name: {"measured": r.measured, "predicted": p, "error": e, "step_s": g["step"],
                                "plan_s": g["plan_s"]} for r, p, e, g in out}, fh, indent=1)


def fit_per_microbatch(out: list) -> None:
    """Where several pipelined rows run one model and pipeline at different microbatch counts m (the
    held-out MT-NLG runs), the least-squares line step = a m + b through the measured steps and through
    the predicted ones: a is what one more microbatch costs, b what a step costs whatever m (bubble,
    gradient sync, optimizer)."""
    groups: dict = {}
    for r, _pred, _err, got in out:
        if got["m"]:
            groups.setdefault((r.layout.pp, r.layout.microbatch_size, r.batch), []).append((got["m"], r.measured_step(),
                                                                                            got["step"]))
    for (pp, mbs, _batch), pts in groups.items():
        if len({m for m, _, _ in pts}) < 2:
            continue
        lines = []
        for label, k in (("measured", 1), ("predicted", 2)):
            n = len(pts)
            mx, my = sum(p[0] for p in pts) / n, sum(p[k] for p in pts) / n
            a = sum((p[0] - mx) * (p[k] - my) for p in pts) / sum((p[0] - mx) ** 2 for p in pts)
            lines.append(f"{label} {a:.4f} s x m + {my - a * mx:.2f} s")
        print(f"pp {pp}, microbatch {mbs}, m = {sorted(m for m, _, _ in pts)}: step = " + "; ".join(lines))


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
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / den if den else float("nan")


def summary(rows: list) -> tuple[int, float, dict]:
    """(rows within +-15%, mean |error|, Spearman per unit) of ``(row, predicted, error)`` rows."""
    errs = [e for _, _, e in rows]
    groups: dict = {}
    for r, pred, _ in rows:
        groups.setdefault(r.unit, []).append((r.measured, pred))
    rhos = {u: spearman([a for a, _ in v], [b for _, b in v]) for u, v in groups.items() if len(v) > 2}
    return sum(abs(e) <= 0.15 for e in errs), sum(abs(e) for e in errs) / len(errs), rhos


def sensitivity(rows: list) -> None:
    """The A100 rows repriced with each figure of ``A100_GEMM_ALTERNATIVES`` as the A100's GEMM cap."""
    print("\nA100 GEMM sensitivity (the first is the preset; only the A100 rows are repriced):")
    print(f"{'A100 GEMM cap':<32} {'of peak':>7}  signed errors, row by row")
    for label, cap, _source in A100_GEMM_ALTERNATIVES:
        hw = dataclasses.replace(PRESETS["a100"], gemm_efficiency=min(1.0, cap))
        errs = [r.predicted(price(r, hw)["step"]) / r.measured - 1 for r in rows]
        print(f"{label:<32} {cap:>7.3f}  " + " ".join(f"{100 * e:+.1f}%" for e in errs), flush=True)
    for label, _cap, source in A100_GEMM_ALTERNATIVES:
        print(f"  {label}: {source}")


if __name__ == "__main__":
    main()
