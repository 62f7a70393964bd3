"""Plans cached on disk by world size and model fingerprint, so an elastic run re-plans in seconds.

An elastic run (``autoshard.elastic``) meets the same world sizes again and again: 4 devices, a node
dies, 2, the node comes back, 4. Solving the ILP each time costs seconds to minutes on a real model;
the plan for a world it has seen is a JSON file away. The cache lives under the run's checkpoint
directory::

    <checkpoint_dir>/plans/world<W>-mesh<a>x<b>-<fingerprint>.json

``fingerprint`` is ``model_fingerprint``: the hash of the global-batch training program (node names,
ops, shapes), the same on every world size, so a plan cached for another model or another batch shape
is never found. Plans are written to a temporary file and moved into place (``os.replace``), so a
process killed while writing one leaves no half file behind. Reading never executes code.

``cached_or_planned`` runs on ONE rank (``compile``'s rank 0 via ``run_and_broadcast``); every rank
then compiles the plan it returns, so all ranks run the same plan.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Optional

from autoshard.passes.capture.export import capture
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.plan_file import graph_fingerprint
from autoshard.plans import Plan, load_plan

__all__ = ["model_fingerprint", "cached_plan_path", "cached_or_planned", "PLANS_DIR"]

PLANS_DIR = "plans"


def model_fingerprint(model, example_inputs, loss_fn=None, example_target=None) -> str:
    """The graph fingerprint of ``model``'s training program on the global batch: what identifies "the
    same model and batch shape" across world sizes (the plan's own fingerprint may be of a microstep)."""
    return graph_fingerprint(capture(model, example_inputs, loss_fn=loss_fn, target=example_target))


def cached_plan_path(checkpoint_dir: str, mesh: Mesh, fingerprint: str) -> str:
    """Where the plan for ``mesh`` (its size is the world) and ``fingerprint`` is cached."""
    shape = "x".join(str(s) for s in mesh.shape)
    return os.path.join(checkpoint_dir, PLANS_DIR, f"world{mesh.size}-mesh{shape}-{fingerprint}.json")


def cached_or_planned(make_plan: Callable[[], Plan], checkpoint_dir: str, mesh: Mesh, fingerprint: str
                      ) -> tuple[Plan, bool, float]:
    """(plan, came_from_cache, seconds): the cached plan for (``mesh``, ``fingerprint``) if there is
    one, else ``make_plan()`` (which must plan for ``mesh``), saved to the cache before it returns."""
    t0 = time.perf_counter()
    path = cached_plan_path(checkpoint_dir, mesh, fingerprint)
    if os.path.exists(path):
        found = load_plan(path)
        if found.pipelined or found.mesh.shape != mesh.shape:
            raise ValueError(f"{path} holds a plan for another mesh or a pipelined plan: delete it to plan again")
        return found, True, time.perf_counter() - t0
    made = make_plan()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    made.save(tmp)
    os.replace(tmp, path)
    return made, False, time.perf_counter() - t0


def plan_line(plan: Optional[Any]) -> str:
    """One short line naming a plan: its mesh, how parameters are stored, its levers, its estimate."""
    if plan is None:
        return "none"
    placements: dict[str, int] = {}
    for pls in plan.param_placements.values():
        key = ",".join(str(p) for p in pls)
        placements[key] = placements.get(key, 0) + 1
    stored = " ".join(f"{n}x[{k}]" for k, n in sorted(placements.items(), key=lambda kv: -kv[1]))
    levers = plan.solution.levers
    return (f"mesh {plan.mesh.shape} {'x'.join(plan.mesh.axis_names)}, params {stored}, "
            f"accumulation {levers.accumulation}")
