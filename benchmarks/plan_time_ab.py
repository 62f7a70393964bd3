"""Plan time of two trees side by side, alternately, on a shared machine: this checkout and another
(e.g. its base commit), so both see the same load. CPU seconds (this process, CP-SAT's threads
included) are the figure the load disturbs least.

    git archive <commit> | tar -x -C /tmp/base
    python benchmarks/plan_time_ab.py --base /tmp/base --bench 8b --rounds 2
    python benchmarks/plan_time_ab.py --base /tmp/base --bench 175b --rounds 1

``8b``: Llama-3 8B on (8, 8) as ``plan_time.py`` (trace and solve timed apart); ``175b``: GPT-3 175B
on (128, 8) through ``autoshard.plan(pp="auto")`` as ``plan_3d.py`` (trace included); ``405b``: Llama 3 405B on
(2048, 8) the same way, as ``plan_llama3_405b.py`` (the model built outside the timing). Each run prints
one line: wall (CPU) seconds, the load average before and after, and the plan's decisions (with a
digest of the whole plan, search statistics left out), so a speedup that changed the plan shows.
The other tree is imported in place of this one by pointing the editable install's finder at it (the package maps ``autoshard.passes`` to ``passes/``), in a fresh
interpreter per run.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_PRELUDE = """
import sys, os, time, json, hashlib
root = {root!r}
# ``python -c`` puts the working directory first on sys.path: run from a checkout, its autoshard/ would
# shadow the other tree's front door (the finder below maps only what the path does not find)
sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]
try:
    import __editable___autoshard_0_1_0_finder as finder
    for key, path in list(finder.MAPPING.items()):
        finder.MAPPING[key] = path.replace({here!r}, root)
except ImportError:
    pass
sys.path.insert(0, os.path.join(root, "benchmarks"))
import torch
"""

_8B = """
import torch.nn.functional as F
import plan_time
from autoshard.api import plan_captured
from autoshard.passes.capture.export import capture
from autoshard.passes.mesh import Mesh
model = plan_time.llama3_8b(32, 8192)
ids = torch.empty(8, 8192, dtype=torch.long, device="meta")
def loss_fn(out, target):
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
l0 = os.getloadavg()[0]
t1, c1 = time.perf_counter(), time.process_time()
captured = capture(model, (ids,), loss_fn=loss_fn, target=ids)
t2, c2 = time.perf_counter(), time.process_time()
plan = plan_captured(captured, Mesh((8, 8)), hardware="h100", time_limit_s=60)
t3, c3 = time.perf_counter(), time.process_time()
sol = plan.to_json()["solution"]
sol.pop("solver_stats", None)
digest = hashlib.sha1(json.dumps(sol, sort_keys=True).encode()).hexdigest()[:12]
print(f"{{label}}: trace {{t2-t1:.2f}} s ({{c2-c1:.2f}}) solve {{t3-t2:.2f}} s ({{c3-c2:.2f}}) total {{t3-t1:.2f}} s "
      f"({{c3-c1:.2f}}); load {{l0:.1f}} -> {{os.getloadavg()[0]:.1f}}; step {{plan.estimated_step_time:.9f}} s, "
      f"solution {{digest}}", flush=True)
"""

#: the pipeline benches' common part: plan with pp="auto", print the time, the choice and a digest of the plan
_PIPELINE = """
l0 = os.getloadavg()[0]
t, c = time.perf_counter(), time.process_time()
plan = autoshard.plan(model, mesh, example_inputs=(ids,), loss_fn=plan_3d.loss_fn, example_target=ids.clone(),
                      hardware="h100", pp="auto", time_limit_s=60)
wall, cpu = time.perf_counter() - t, time.process_time() - c
search = plan.stages[0].solution.solver_stats.get("pipeline_search", {{}})
def decisions(d):  # the plan without its search statistics (which differ when a search skips work)
    if isinstance(d, dict):
        return {{k: decisions(v) for k, v in d.items() if k != "solver_stats"}}
    return [decisions(v) for v in d] if isinstance(d, list) else d
digest = hashlib.sha1(json.dumps(decisions(plan.to_json()), sort_keys=True, default=str).encode()).hexdigest()[:12]
print(f"{{label}}: plan {{wall:.1f}} s ({{cpu:.1f}}); load {{l0:.1f}} -> {{os.getloadavg()[0]:.1f}}; "
      f"pp {{plan.pp}} submesh {{plan.stages[0].mesh.shape}} {{plan.schedule}} m {{plan.microbatches}} "
      f"recompute {{sum(s.recompute for s in plan.stages)}} step {{plan.estimated_step_time:.6f}} s; stage search "
      f"{{search.get('wall_s')}} s, ilp {{search.get('ilp')}}, even cuts simulated {{search.get('even')}}, timed out "
      f"{{search.get('timed_out', False)}}; plan {{digest}}", flush=True)
"""

_175B = """
import autoshard, plan_3d
model = plan_3d.gpt3(96, 12288, 96, 2048, 51200)
ids = torch.empty(1536, 2048, dtype=torch.long, device="meta")
mesh = (128, 8)
""" + _PIPELINE

_405B = """
import autoshard, plan_3d, published_layouts
model = published_layouts.llama(126, 16384, 53248, 128, 8, 8192, dtype=torch.bfloat16)
ids = torch.empty(2048, 8192, dtype=torch.long, device="meta")
mesh = (2048, 8)
""" + _PIPELINE


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the other tree (a checkout or `git archive` of a commit)")
    ap.add_argument("--bench", choices=("8b", "175b", "405b"), default="8b")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--only", choices=("base", "this"), default=None,
                    help="run one tree only (two such commands started together compare under the same load)")
    args = ap.parse_args()
    body = {"8b": _8B, "175b": _175B, "405b": _405B}[args.bench]
    for r in range(args.rounds):
        for label, root in (("base", os.path.abspath(args.base)), ("this", HERE)):
            if args.only not in (None, label):
                continue
            code = (_PRELUDE + body).format(root=root, here=HERE)
            subprocess.run([sys.executable, "-c", code.replace("{label}", f"round {r + 1} {label}")], check=True)


if __name__ == "__main__":
    main()
