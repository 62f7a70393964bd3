"""What a world change costs an elastic run: re-plan seconds, reshard seconds, estimated step time before/after.

    python benchmarks/elastic_replan.py --example        # the small GPT of examples/train_elastic.py: 1 -> 4 -> 2 ranks
    python benchmarks/elastic_replan.py --llama70b       # plan only: Llama-3 70B on 64 H100 -> 56 (a node lost)

``--example`` runs ``examples/train_elastic.py`` three times on one checkpoint directory, as an elastic
job's starts would: alone (world 1) to step 10, under torchrun with 4 ranks as 2 "nodes" of 2 (mesh
(2, 2)) to step 20, then with 2 ranks (one node lost, mesh (2,)) to step 30, and prints each start's
record (``elastic_log.jsonl``): re-plan seconds (fingerprint capture + plan solved or loaded from the
cache, on rank 0) and reshard seconds (loading the checkpoint into the new plan). A fourth start on
world 4 shows the cached plan's re-plan time.

``--llama70b`` builds Hugging Face's ``LlamaForCausalLM`` (Llama-3 70B config, as in
``benchmarks/torchtitan_recipes.py``) on the meta device with torchtitan's 70B global batch (64 x
8192), bf16 compute / fp32 masters, AdamW, on the ``h100`` preset (80 GB), and does what
``autoshard.elastic.run`` does on rank 0 when a node of 8 is lost: capture and fingerprint the
program, solve the plan for ``Mesh.for_world(56, 8)`` = (7, 8), after (8, 8) for 64. A batch of 64
does not divide over 7 (nor does any dimension but the MLP's 28672), so also (``--cases``): 48 GPUs
(6, 8) and 32 GPUs (4, 8) with the same batch, and 56 GPUs with a batch of 56. Printed: capture and solve seconds, the
seconds of loading the cached plan, and the estimated step time against world 64's. Nothing is
measured on GPUs: the step times are the cost model's estimates.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLE = os.path.join(HERE, "..", "examples", "train_elastic.py")


def example() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        base = [EXAMPLE, "--checkpoint-dir", "ck", "--steps", "40", "--every", "10", "--devices-per-node", "2"]
        runs = [([], "10"), (["4"], "20"), (["2"], "30"), (["4"], "40")]
        for procs, stop in runs:
            launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", procs[0],
                         "--max-restarts", "0"] if procs else [sys.executable])
            t0 = time.perf_counter()
            done = subprocess.run(launcher + base + ["--stop-after", stop], cwd=tmp, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(done.stdout[-2000:] + done.stderr[-3000:])
            print(f"world {procs[0] if procs else 1}: wall {time.perf_counter() - t0:.1f} s for the whole start")
        with open(os.path.join(tmp, "ck", "elastic_log.jsonl")) as f:
            records = [json.loads(line) for line in f]
    print("| start | world | plan | estimated step | re-plan s | reshard s |")
    print("|---|---|---|---|---|---|")
    for r in records:
        print(f"| step {r['resumed_step']} | {r['old_world']} -> {r['new_world']} | {r['new_plan']} | "
              f"{r['new_step_time'] * 1e3:.2f} ms | {r['replan_seconds']:.2f} "
              f"({'cached' if r['plan_cached'] else 'solved'}) | {r['reshard_seconds']:.2f} |")


def llama70b(time_limit: float, cases: list) -> None:
    import torch

    sys.path.insert(0, HERE)
    import autoshard
    from autoshard.plan_cache import cached_or_planned, plan_line
    from autoshard.passes.pipeline.plan_file import graph_fingerprint
    from autoshard.api import plan_captured
    from autoshard.passes.capture.export import capture
    from torchtitan_recipes import BF16, GB, RECIPES, build, lm_loss

    r = RECIPES["70b"]
    model = build(r)
    captured_by_batch, before = {}, None
    with tempfile.TemporaryDirectory() as cache:
        for world, batch in cases:
            mesh = autoshard.Mesh.for_world(world, 8)
            if batch not in captured_by_batch:
                ids = torch.empty(batch, r.seq, dtype=torch.long, device="meta")
                t0 = time.perf_counter()
                captured = capture(model, (ids,), loss_fn=lm_loss, target=ids, param_dtype=torch.bfloat16)
                captured_by_batch[batch] = (captured, graph_fingerprint(captured), time.perf_counter() - t0)
            captured, fp, capture_s = captured_by_batch[batch]
            t1 = time.perf_counter()
            head = f"world {world}, mesh {mesh.shape}, batch {batch} x {r.seq}: capture {capture_s:.1f} s"
            try:
                plan, _, _ = cached_or_planned(lambda: plan_captured(
                    captured, mesh, hardware="h100", memory_limit=80 * GB, optimizer="adamw",
                    time_limit_s=time_limit, mixed_precision=BF16), cache, mesh, fp)
            except autoshard.InfeasiblePlanError as e:
                print(f"{head}, solve {time.perf_counter() - t1:.1f} s: InfeasiblePlanError: {str(e)[:420]}")
                continue
            t2 = time.perf_counter()
            _, cached, load_s = cached_or_planned(lambda: None, cache, mesh, fp)
            assert cached
            tokens = batch * r.seq / world / plan.estimated_step_time
            before = before or plan.estimated_step_time
            print(f"{head}, solve {t2 - t1:.1f} s, re-plan (capture + solve) {capture_s + t2 - t1:.1f} s; from the "
                  f"cache {capture_s + load_s:.1f} s (load {load_s:.1f} s); estimated step {plan.estimated_step_time:.3f} s"
                  f" (x{plan.estimated_step_time / before:.3f} of world 64), {tokens:.0f} tok/s/GPU, memory "
                  f"{plan.estimated_memory / 2**30:.1f} GiB; {plan_line(plan)}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--example", action="store_true")
    ap.add_argument("--llama70b", action="store_true")
    ap.add_argument("--time-limit", type=float, default=60.0, help="solver seconds per plan")
    ap.add_argument("--cases", default="64:64,56:64,48:64,32:64,56:56",
                    help="world:global batch pairs for --llama70b (step times are compared with the first)")
    args = ap.parse_args()
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    if args.example or not args.llama70b:
        example()
    if args.llama70b or not args.example:
        llama70b(args.time_limit, [tuple(int(v) for v in c.split(":")) for c in args.cases.split(",")])


if __name__ == "__main__":
    main()
