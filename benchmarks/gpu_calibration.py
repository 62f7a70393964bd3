"""GPU calibration: what one accelerator really does, next to what the cost model predicts for it.

Two halves, so the device only measures and the pricing runs anywhere:

    python benchmarks/gpu_calibration.py --measure h100.json     # on the GPU (about 3 minutes on an H100)
    python benchmarks/gpu_calibration.py --report h100.json      # anywhere: predicted vs measured

``--measure`` writes the kernel tables of ``autoshard/profiling/kernel_tables.py`` (bf16 GEMMs at
Llama-3 shapes, flash attention forward and backward, copies, the fused AdamW step) and whole
training steps of a Hugging Face Llama-3-8B-shaped model (d 4096, 32 heads, 8 KV heads, FFN 14336,
vocab 128256, bf16) with 2 and 4 layers at 2 x 8192 tokens, with and without full activation
checkpointing, so a layer's and the embedding/head's share of a step can be told apart.
``--report`` prices every row with the cost model's preset for that GPU (``--hardware``, default
h100; ``h100+tables`` replaces the preset's compute constants by the file's own kernel tables, as a
GPU profile from ``autoshard profile`` does, so its kernel rows are in-sample and its Llama steps not): kernels through ``passes/cost/kernels.py``, the Llama steps through ``autoshard.plan`` on a
meta-device copy of the same model on a one-device mesh.
``--tiny`` shrinks every shape so the script can be checked on a CPU in seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)
LLAMA_TINY = dict(hidden_size=64, intermediate_size=224, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=512, max_position_embeddings=128, rope_theta=500000.0, rms_norm_eps=1e-5)


def llama(layers: int, tiny: bool, device, dtype=torch.bfloat16):
    """A Hugging Face Llama with the 8B recipe's widths (or tiny ones) and ``layers`` layers."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(num_hidden_layers=layers, tie_word_embeddings=False, **(LLAMA_TINY if tiny else LLAMA_8B))
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    return model.to(dtype)


def loss_fn(out, target):
    """Cross entropy over the logits in fp32, as torchtitan and Hugging Face compute it."""
    return F.cross_entropy(out.logits.flatten(0, 1).float(), target.flatten())


def _median_seconds(fn, device, repeats: int = 5, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_llama_steps(device, tiny: bool, log) -> list:
    """Rows {layers, checkpoint, batch, seq, step_s, fwd_bwd_s, peak_bytes}: one AdamW training step of
    the Llama above (forward, fp32 loss, backward, fused AdamW, zero_grad) and its forward + backward alone."""
    batch, seq = (2, 64) if tiny else (2, 8192)
    rows = []
    for layers in (2, 4):
        for checkpoint in (False, True):
            torch.manual_seed(0)
            model = llama(layers, tiny, device)
            if checkpoint:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
            vocab = model.config.vocab_size
            ids = torch.randint(0, vocab, (batch, seq), device=device)
            target = torch.randint(0, vocab, (batch, seq), device=device)

            def fwd_bwd():
                loss_fn(model(input_ids=ids), target).backward()

            def step():
                fwd_bwd()
                opt.step()
                opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            step_s = _median_seconds(step, device)
            peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
            fb_s = _median_seconds(lambda: (fwd_bwd(), opt.zero_grad(set_to_none=True)), device)
            rows.append({"layers": layers, "checkpoint": "full" if checkpoint else "none", "batch": batch, "seq": seq,
                         "step_s": step_s, "fwd_bwd_s": fb_s, "peak_bytes": peak})
            log(f"llama {layers} layers checkpoint={checkpoint}: step {step_s * 1e3:.1f} ms, fwd+bwd {fb_s * 1e3:.1f} ms, "
                f"peak {peak / 2**30:.1f} GiB")
            del model, opt, ids, target
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def measure(path: str, tiny: bool) -> None:
    """Measure everything on this machine's accelerator (or the CPU with ``tiny``) into ``path``,
    rewriting it after each part so a run cut short keeps what it measured."""
    from autoshard.profiling.kernel_tables import measure_kernel_tables
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    log = lambda m: print(f"gpu_calibration: {m}", flush=True)  # noqa: E731
    data = {"format": "autoshard-gpu-calibration", "version": 1, "torch": torch.__version__, "tiny": tiny,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}

    def save():
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        data["device"] = {"name": props.name, "sm_count": props.multi_processor_count,
                          "memory_bytes": float(props.total_memory), "cuda": torch.version.cuda}
    save()
    data["llama_steps"] = measure_llama_steps(device, tiny, log)
    save()
    data.update(measure_kernel_tables(device, quick=tiny, log=log))
    save()
    log(f"wrote {path}")


# ----------------------------------------------------------------------------------------------- report
def _pct(pred: float, meas: float) -> str:
    return f"{(pred / meas - 1) * 100:+.1f}%" if meas > 0 else "n/a"


def predicted_llama_step(layers: int, checkpoint: str, batch: int, seq: int, tiny: bool, hardware) -> dict:
    """``autoshard.plan`` of the same Llama on a one-device mesh, meta-device, levers pinned."""
    import autoshard
    model = llama(layers, tiny, "meta")
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), device="meta")
    plan = autoshard.plan(model, (1,), example_inputs=(ids,), loss_fn=loss_fn, example_target=ids.clone(),
                          hardware=hardware, checkpoint=checkpoint, accumulation=1, reshard_after_forward=False)
    return {"step_s": plan.estimated_step_time, "memory": plan.estimated_memory,
            "breakdown": dict(plan.solution.time_breakdown)}


def report(path: str, hardware: str) -> str:
    """Markdown tables: every measured row next to the cost model's prediction on ``hardware``."""
    from autoshard.passes.cost.hardware_lookup import get_hardware
    from autoshard.passes.cost.kernels import attention_seconds, gemm_seconds, memory_seconds, optimizer_seconds
    with open(path) as f:
        data = json.load(f)
    if hardware.endswith("+tables"):  # the preset, its compute replaced by this file's own kernel tables
        import dataclasses
        from autoshard.passes.cost.profile_format import kernel_table_fields
        hw = dataclasses.replace(get_hardware(hardware[:-len("+tables")]), name=hardware, **kernel_table_fields(data))
    else:
        hw = get_hardware(hardware)
    out = [f"measured: {data.get('device', {}).get('name', 'cpu')}, torch {data.get('torch')}, {data.get('date')}; "
           f"predicted: preset {hw.name!r}", ""]
    errs = {}

    def add(kind, pred, meas):
        errs.setdefault(kind, []).append(pred / meas - 1 if meas > 0 else 0.0)

    out += ["| GEMM m x n x k | layout | measured TFLOP/s | predicted TFLOP/s | time error |", "|---|---|---|---|---|"]
    for m, n, k, layout, sec in data.get("gemm_table", {}).get("rows", []):
        flops = 2.0 * m * n * k
        pred = gemm_seconds(hw, 1, m, n, k, 2)
        add("gemm", pred, sec)
        out.append(f"| {m} x {n} x {k} | {layout} | {flops / sec / 1e12:.0f} | {flops / pred / 1e12:.0f} | {_pct(pred, sec)} |")
    out += ["", "| attention b, h, s, d | causal | fwd measured ms | fwd predicted | bwd measured ms | bwd predicted |",
            "|---|---|---|---|---|---|"]
    for b, h, s, d, causal, fwd, bwd in data.get("attention_table", {}).get("rows", []):
        pf, pb = attention_seconds(hw, b * h, s, s, d, causal)
        add("attention fwd", pf, fwd)
        add("attention bwd", pb, bwd)
        out.append(f"| {b}, {h}, {s}, {d} | {causal} | {fwd * 1e3:.2f} | {pf * 1e3:.2f} ({_pct(pf, fwd)}) | "
                   f"{bwd * 1e3:.2f} | {pb * 1e3:.2f} ({_pct(pb, bwd)}) |")
    out += ["", "| memory-bound | size | measured | predicted | error |", "|---|---|---|---|---|"]
    for moved, sec in data.get("copy_table", {}).get("rows", []):
        pred = memory_seconds(hw, moved)
        add("copy", pred, sec)
        out.append(f"| copy | {moved / 2**30:.2f} GiB moved | {moved / sec / 1e12:.2f} TB/s | {moved / pred / 1e12:.2f} TB/s | "
                   f"{_pct(pred, sec)} |")
    for numel, sec in data.get("adamw_table", {}).get("rows", []):
        pred = optimizer_seconds(hw, numel)
        add("adamw", pred, sec)
        out.append(f"| fused AdamW fp32 | {numel / 1e6:.0f} M params | {sec * 1e3:.2f} ms | {pred * 1e3:.2f} ms | "
                   f"{_pct(pred, sec)} |")
    steps = data.get("llama_steps", [])
    if steps:
        out += ["", "| Llama-3-8B-shaped, HF sdpa, bf16 | measured step | predicted step (autoshard.plan, (1,)) | error | "
                "measured peak | predicted peak |", "|---|---|---|---|---|---|"]
        by = {}
        for r in steps:
            pred = predicted_llama_step(r["layers"], r["checkpoint"], r["batch"], r["seq"], data.get("tiny", False), hw)
            by[(r["layers"], r["checkpoint"])] = (r["step_s"], pred["step_s"])
            add("llama step", pred["step_s"], r["step_s"])
            out.append(f"| {r['layers']} layers, {r['batch']} x {r['seq']}, checkpoint {r['checkpoint']} | "
                       f"{r['step_s'] * 1e3:.1f} ms | {pred['step_s'] * 1e3:.1f} ms | {_pct(pred['step_s'], r['step_s'])} | "
                       f"{r['peak_bytes'] / 2**30:.1f} GiB | {pred['memory'] / 2**30:.1f} GiB |")
        for ckpt in ("none", "full"):
            if (2, ckpt) in by and (4, ckpt) in by:
                (m2, p2), (m4, p4) = by[(2, ckpt)], by[(4, ckpt)]
                ml, pl = (m4 - m2) / 2, (p4 - p2) / 2
                mh, ph = m2 - 2 * ml, p2 - 2 * pl
                out.append(f"| one layer (4 - 2 layers) / 2, checkpoint {ckpt} | {ml * 1e3:.1f} ms | {pl * 1e3:.1f} ms | "
                           f"{_pct(pl, ml)} | | |")
                out.append(f"| embedding + head + loss + rest, checkpoint {ckpt} | {mh * 1e3:.1f} ms | {ph * 1e3:.1f} ms | "
                           f"{_pct(ph, mh)} | | |")
                if not data.get("tiny"):
                    tok = 2 * 8192
                    out.append(f"| => 32-layer 8B step on one GPU, checkpoint {ckpt} | {tok / (32 * ml + mh):,.0f} tok/s | "
                               f"{tok / (32 * pl + ph):,.0f} tok/s | {_pct((32 * ml + mh), (32 * pl + ph))} (rate) | | |")
    out += ["", "| kind | rows | median time error | range |", "|---|---|---|---|"]
    for kind, e in errs.items():
        out.append(f"| {kind} | {len(e)} | {statistics.median(e) * 100:+.1f}% | {min(e) * 100:+.1f}% .. {max(e) * 100:+.1f}% |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measure", metavar="OUT", help="measure this machine's accelerator into OUT (JSON)")
    ap.add_argument("--report", metavar="IN", help="print measured vs predicted for a measurement file")
    ap.add_argument("--hardware", default="h100",
                    help="the preset or profile to predict with (default h100); PRESET+tables: the preset with its "
                         "compute fields replaced by the measurement file's own kernel tables")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (check the script on a CPU)")
    args = ap.parse_args(argv)
    if not (args.measure or args.report):
        ap.error("give --measure OUT or --report IN")
    if args.measure:
        measure(args.measure, args.tiny)
    if args.report:
        print(report(args.report, args.hardware))
    return 0


if __name__ == "__main__":
    sys.exit(main())
