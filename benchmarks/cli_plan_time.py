"""``autoshard plan`` wall time from the command line: the Llama-3 8B config on an (8, 8) H100 mesh.

    python benchmarks/cli_plan_time.py [--seq 8192] [--batch 8] [--runs 1]

Writes Llama-3 8B's Hugging Face config.json (32 layers, hidden 4096, 14336 intermediate, 32 / 8 heads,
vocab 128256, untied) to a temporary directory and times, from outside, the whole command a user types:

    autoshard plan config.json --mesh 8x8 --batch 8 --seq 8192 --hardware h100 --dtype bf16 --out plan.json

(interpreter start and imports included). Prints the wall and CPU time per run and the command's own line
("planned in N s": model built on meta, traced, solved; the build includes importing transformers, which
benchmarks/plan_time.py does outside its timing) and the plan's status.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time

LLAMA3_8B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
             "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False, "hidden_act": "silu",
             "torch_dtype": "bfloat16"}


def _children_cpu() -> float:
    """User + system CPU seconds of this process's finished children (on a loaded machine the CPU
    time moves far less than the wall time)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="autoshard_cli_")
    config = os.path.join(root, "config.json")
    with open(config, "w") as f:
        json.dump(LLAMA3_8B, f)
    exe = os.path.join(os.path.dirname(sys.executable), "autoshard")  # this interpreter's own entry point
    base = [exe] if os.path.exists(exe) else [sys.executable, "-m", "autoshard.cli"]
    cmd = base + ["plan", config, "--mesh", "8x8", "--batch", str(args.batch), "--seq", str(args.seq),
                  "--hardware", "h100", "--dtype", "bf16", "--out", os.path.join(root, "plan.json")]
    print("$ autoshard " + " ".join(cmd[len(base):]).replace(root + "/", ""))
    for run in range(args.runs):
        t0, c0 = time.perf_counter(), _children_cpu()
        done = subprocess.run(cmd, capture_output=True, text=True)
        wall, cpu = time.perf_counter() - t0, _children_cpu() - c0
        if done.returncode:
            sys.exit(done.stdout + done.stderr)
        own = re.search(r"planned in ([0-9.]+) s", done.stdout)
        status = re.search(r"status (\w+)", done.stdout)
        progress = [line for line in done.stderr.splitlines() if line.startswith("autoshard plan:")]
        print(f"run {run}: wall {wall:.2f} s, CPU {cpu:.2f} s (user + sys; the command's own: built + traced + solved in "
              f"{own.group(1) if own else '?'} s; status {status.group(1) if status else '?'}; "
              f"{len(progress)} progress lines)")
    print(done.stdout.splitlines()[0])
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
