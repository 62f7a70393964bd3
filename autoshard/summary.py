"""Text summaries of plans: estimates, throughput and MFU, placements (repeated blocks folded), collectives,
and the ops that run replicated for lack of a sharding rule with what that costs.

``plan_summary`` for any ``Plan``: one program on one mesh, or a pipeline's stages on rank groups (its
schedule and stages shown only then). It prints the estimated tokens (or samples) per second per
device and the MFU against the hardware's dense peak, as ``passes.pipeline.plan_work`` defines them.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Optional

from autoshard.passes.solve.clustering import block_instance
from autoshard.passes.pipeline.plan_work import known_hardware
from autoshard.passes.cost.kernels import achievable
from autoshard.passes.cost.validation import error_band_line
from autoshard.passes.errors import AutoshardError
from autoshard.passes.cost.moe import capacity_factor_of, moe_nodes
from autoshard.passes.sharding.rules.moe import moe_role
from autoshard.passes.solve.replicated_ops import REGISTER_HINT, replicated_op_costs
from autoshard.passes.spec import fmt
from autoshard.passes.units import human_bytes, human_time
from autoshard.verdict import placeholder_kinds, plan_verdict, zero_forms

__all__ = ["plan_summary", "throughput_line", "fold_name", "fold_names", "placement_lines",
           "moe_lines", "lever_text"]


def fold_name(name: str) -> str:
    """``transformer.h.3.attn.weight`` -> ``transformer.h.#.attn.weight`` (repeated blocks folded)."""
    return re.sub(r"\.\d+\.", ".#.", name)


def throughput_line(plan) -> str:
    """``estimated throughput: 1,234 tokens/s per device, MFU 41.2% (...)``, or why it is unknown."""
    work = plan.work
    if work is None:
        return "  estimated throughput: unknown (the plan's hardware peak and model FLOPs were not recorded)"
    rate = work.rate(plan.estimated_step_time)
    mfu = work.mfu(plan.estimated_step_time)
    if rate is None:
        return "  estimated throughput: unknown (no step time)"
    return (f"  estimated throughput: {rate:,.4g} {work.rate_unit}/s per device, MFU {100 * mfu:.1f}% "
            f"(model FLOPs {work.flops:.3g} per step: matmul FLOPs x{3 if work.training else 1}; "
            f"dense peak {work.peak_flops / 1e12:.4g} TFLOP/s per device)")


def placement_lines(named: dict, out: list, indent: str = "    ", forms: Optional[dict] = None) -> None:
    """One line per parameter, repeated blocks folded (``fold_names``); a folded name whose members
    differ in placement is listed member by member, so no folded name appears twice. ``forms``: FQN ->
    its ZeRO storage form per axis (``verdict.zero_forms``), shown after that axis' placement (``R/zero1``)."""
    forms = forms or {}

    def shown(pls, fqn):
        shown = [fmt(p) + (f"/{f}" if f else "") for p, f in zip(pls, forms.get(fqn) or (None,) * len(pls))]
        return "(" + ", ".join(shown) + ")"

    named = {m: shown(pls, m) for m, pls in named.items()}
    folded_of = fold_names(list(named))
    groups: dict[str, list[str]] = {}
    for name in named:
        groups.setdefault(folded_of[name], []).append(name)
    rows: list[tuple[str, str, int]] = []
    for folded, members in groups.items():
        placements = {named[m] for m in members}
        if len(placements) == 1:
            rows.append((folded, placements.pop(), len(members)))
        else:
            rows += [(m, named[m], 1) for m in members]
    width = max((len(r[0]) for r in rows), default=10)
    for name, pls, count in rows:
        out.append(f"{indent}{name:<{width}}  {pls}" + (f"  x{count}" if count > 1 else ""))


def fold_names(names: list[str]) -> dict[str, str]:
    """Each name with its repeated-block indices replaced by ``#``. An index is folded only where the
    numbered siblings are alike (the same parameter names below each number): ``layers.3.attn.weight``
    -> ``layers.#.attn.weight``, but a ``Sequential(conv, BatchNorm)``'s ``0.weight`` and ``1.weight``
    stay apart, and so do a ResNet stage's first block (with its downsample) and the next."""
    below: dict[str, dict[str, set]] = {}  # prefix -> index -> the names below that index
    for name in names:
        parts = name.split(".")
        for i, part in enumerate(parts[1:-1], start=1):
            if part.isdigit():
                prefix = ".".join(parts[:i])
                below.setdefault(prefix, {}).setdefault(part, set()).add(".".join(parts[i + 1:]))
    alike = {prefix for prefix, children in below.items()
             if len(children) > 1 and len({frozenset(v) for v in children.values()}) == 1}
    out = {}
    for name in names:
        parts = name.split(".")
        out[name] = ".".join("#" if 0 < i < len(parts) - 1 and p.isdigit() and ".".join(parts[:i]) in alike else p
                             for i, p in enumerate(parts))
    return out


def overlap_lines(sol, hardware=None) -> list[str]:
    """The step re-scored with compute and communication on separate streams
    (``passes/cost/overlap.py``): exposed vs hidden communication; then, on hardware priced by the
    calibrated GPU model, its known error against published runs. Nothing when not estimated."""
    est = getattr(sol, "estimated", {}) or {}
    if "overlapped_step_s" not in est:
        return []
    band = []
    try:
        hw = known_hardware(hardware) if hardware is not None else None
        if hw is not None and achievable(hw):
            band = [error_band_line()]
    except AutoshardError:
        band = []
    return band + _finalists_lines(sol) + [f"  with overlap (communication on its own stream): step {human_time(est['overlapped_step_s'])}; "
            f"communication exposed {human_time(est['exposed_communication_s'])}, hidden under compute "
            f"{human_time(est['hidden_communication_s'])}; compute slowed {human_time(est['overlap_slowdown_s'])} "
            f"by collectives sharing the SMs"]


def _finalists_lines(sol) -> list[str]:
    """How the plan was picked among the lever search's finalists (``passes/solve/finalists.py``)."""
    rec = (getattr(sol, "solver_stats", None) or {}).get("finalists")
    if not rec:
        return []
    line = (f"  chosen by the overlap model's step among {rec['count']} finalist(s) of the additive search "
            f"(the ILP minimises the additive sum)")
    if rec.get("changed"):
        line += (f": the additive choice would run {human_time(rec['additive_choice_overlapped_s'])} with overlap, "
                 f"this plan {human_time(rec['chosen_overlapped_s'])}")
    return [line]


def plan_summary(plan) -> str:
    """The account of any plan (``passes.pipeline.plan.Plan``): mesh, estimates, memory levers,
    throughput, placements, collectives and gradient syncs, ops without a rule; for a pipeline also its
    schedule, stages and the batch-coupled ops it runs per microbatch, and the stage planner's search."""
    pipelined, mesh = plan.pipelined, plan.mesh
    solutions = [s.solution for s in plan.stages if s.solution is not None]
    out = [f"autoshard {'pipelined ' if pipelined else ''}plan: mesh {mesh.shape} axes {mesh.axis_names}, "
           f"hardware {plan.hardware}"]
    layout = next((sol.solver_stats.get("layout") for sol in solutions if sol.solver_stats.get("layout")), None)
    if layout:
        out.append(f"  layout: {layout} (priced as given: autoshard.layouts"
                   + (", blocks split evenly over the stages)" if pipelined else ", nothing searched)"))
    if pipelined:
        out.append(f"  pipeline: {plan.pp} rank groups x {plan.virtual} stage(s) each along axis "
                   f"{mesh.axis_names[0]!r}, schedule {plan.schedule}, {plan.microbatches} microbatches, "
                   f"bubble {100 * plan.bubble_fraction:.1f}%")
        out.append(f"  estimated step time: {human_time(plan.estimated_step_time)}  (schedule simulator: bubbles, "
                   f"point-to-point transfers and gradient syncs overlapped as they run)")
        out.append(f"  estimated memory, busiest device: {human_bytes(plan.estimated_memory)}")
    else:
        sol = plan.solution
        tb = getattr(sol, "time_breakdown", {}) or {}
        out.append(f"  estimated step time: {human_time(plan.estimated_step_time)}  ("
                   + ", ".join(f"{k} {human_time(v)}" for k, v in tb.items()) + ")")
        out += overlap_lines(sol, plan.hardware)
        mb = getattr(sol, "memory_breakdown", {}) or {}
        phase = getattr(sol, "memory_peak_phase", "")
        out.append(f"  estimated memory, busiest device: {human_bytes(plan.estimated_memory)}"
                   + (f" at the peak, in the {phase}" if phase else "") + "  (by category, not all alive at once: "
                   + ", ".join(f"{k} {human_bytes(v)}" for k, v in mb.items()) + ")")
    out += _lever_lines(plan)
    out.append(throughput_line(plan))
    if pipelined:
        out += _pipeline_lines(plan)
    out.append(f"  parameters (storage placement per {'sub' if pipelined else ''}mesh axis; repeated blocks folded "
               "as #):")
    placement_lines(plan.param_placements, out, forms=_zero_forms(plan))
    out += _collective_lines(plan, solutions)
    out += _replicated_lines(plan)
    if not pipelined:
        captured = getattr(plan, "captured", None)
        factors = {} if captured is None else {n.name: capacity_factor_of(n) for n in moe_nodes(captured.gm)}
        out += moe_lines(plan.solution.strategies, mesh, factors)
    out += _search_lines(plan, solutions)
    report = getattr(plan, "compile_report", None)  # set by CompiledModel under compile=
    if report is not None:
        out += report.lines()
    return "\n".join([plan_verdict(plan)] + out)


def _zero_forms(plan) -> dict:
    """FQN -> ZeRO storage form per axis, over every stage (a stage's first holding wins, as in
    ``Plan.param_placements``)."""
    out: dict = {}
    for stage in plan.stages:
        if stage.solution is not None:
            captured = None if plan.pipelined else getattr(plan, "captured", None)
            params, _ = placeholder_kinds(stage.solution, captured)
            for fqn, forms in zero_forms(stage.solution, params).items():
                out.setdefault(fqn, forms)
    return out


def lever_text(levers) -> str:
    """The memory levers of one solve as the summary says them: accumulation, then each block type's
    policy (every per-block lever of the table, by its label), then mixed precision."""
    blocks = "; ".join(f"{t}: {p.describe()}" for t, p in sorted(levers.blocks.items()))
    mp = levers.mixed_precision
    return (f"accumulation {levers.accumulation}" + (f"; {blocks}" if blocks else "")
            + (f"; compute in {mp.param_dtype_name or 'their own dtype'}, reduce gradients in "
               f"{mp.reduce_dtype_name or mp.param_dtype_name}" if mp is not None else "")
            + (f" (accumulated and held in {mp.reduce_dtype_name})" if mp is not None and mp.accumulate_in_reduce_dtype
               else ""))


def _lever_lines(plan) -> list[str]:
    """The memory levers pulled: the plan's, or each stage's (stages alike in levers share a line)."""
    pulled = [(s.index, s.solution.levers) for s in plan.stages
              if s.solution is not None and getattr(s.solution, "levers", None) is not None
              and s.solution.levers.any_pulled]
    if not pulled:
        return []
    if not plan.pipelined:
        return ["  memory levers: " + lever_text(pulled[0][1])]
    rows: dict[str, list[int]] = {}
    for index, levers in pulled:
        rows.setdefault(lever_text(levers), []).append(index)
    return [f"  memory levers, stage{'s' if len(ix) > 1 else ''} {', '.join(map(str, ix))}: {text}"
            for text, ix in rows.items()]


def _collective_lines(plan, solutions) -> list[str]:
    syncs = Counter(c.kind for sol in solutions for items in sol.param_grad_syncs.values() for c in items)
    if plan.pipelined:
        colls, total = Counter(), 0.0
        for sol in solutions:
            for r in sol.redistributions:
                for c in r.collectives:
                    colls[f"{c.phase} {c.kind}"] += 1
                    total += c.bytes
        head = (f"  inserted collectives (all stages, each stage's plan priced at the global batch in one pass): "
                f"{sum(colls.values())} {dict(colls)}, {human_bytes(total)} in all")
    else:
        kinds = {"fwd": Counter(), "bwd": Counter()}
        total_bytes = 0
        for r in plan.solution.redistributions:
            for c in r.collectives:
                kinds.setdefault(c.phase, Counter())[c.kind] += 1
                total_bytes += c.bytes
        head = (f"  inserted collectives: forward {sum(kinds['fwd'].values())} {dict(kinds['fwd'])}, "
                f"backward {sum(kinds['bwd'].values())} {dict(kinds['bwd'])}, {human_bytes(total_bytes)} in all")
    return [head, f"  gradient syncs: {sum(syncs.values())} {dict(syncs)}"]


def _search_lines(plan, solutions) -> list[str]:
    """The solver's statistics (a plan of one stage), or the stage planner's search (a pipeline)."""
    if plan.pipelined:
        search = next((sol.solver_stats.get("pipeline_search") for sol in solutions
                       if sol.solver_stats.get("pipeline_search")), None)
        if not search:
            return []
        keep = ("configs", "simulated", "ilp", "plan_wall_s", "shallow_copy", "timed_out")
        return ["  planner: " + ", ".join(f"{k} {search[k]}" for k in keep if k in search)]
    stats = getattr(plan.solution, "solver_stats", {}) or {}
    shown = {k: v for k, v in stats.items() if k not in ("layout", "finalists")}  # each has its own line
    return ["  solver: " + ", ".join(f"{k} {v}" for k, v in shown.items())] if shown else []


def moe_lines(strategies: dict, mesh, capacity_factors: Optional[dict] = None) -> list[str]:
    """How the plan runs its mixture-of-experts layers (``autoshard::moe_experts`` nodes), and whether
    tokens can be dropped: never without a capacity factor (every routed pair is computed); with one
    (``capacity_factors``: node -> factor, or a capacity lowering in the plan), beyond capacity."""
    layers = Counter()
    factors = set()
    for name, st in strategies.items():
        if name.startswith("moe_experts"):
            roles = ", ".join(f"{axis}: {moe_role(st, a)}" for a, axis in enumerate(mesh.axis_names)
                              if mesh.shape[a] > 1)
            layers[roles or "one device"] += 1
            factor = (capacity_factors or {}).get(name, 0.0)
            if factor or "expert_dispatch_capacity" in st.lowerings:
                factors.add(factor or "set")
    if not layers:
        return []
    if factors:
        shown = ", ".join(str(f) for f in sorted(factors, key=str))
        drop = (f"tokens dropped: YES when an expert gets more than its capacity (capacity factor {shown}: "
                "ceil(factor x pairs / experts) rows per expert per dispatching group; pairs beyond it, in "
                "token order, are dropped)")
    else:
        drop = ("tokens dropped: never (every routed (token, expert) pair is computed; expert parallel exchanges "
                "exact split sizes, no capacity limit)")
    out = [f"  mixture of experts: {sum(layers.values())} layer(s); {drop}"]
    out += [f"    {roles}  x{n}" for roles, n in layers.items()]
    return out


def stage_contents(*stages) -> str:
    """What stages hold, from their parameters: ``transformer.wte + transformer.h.0-5 (6 blocks)``; for
    several alike stages, ``transformer.h.6-89 (6 blocks each)``."""
    names = [n for st in stages if st.solution is not None for n in st.solution.param_placements]
    parts: list[str] = []
    blocks: dict[str, set] = {}
    for name in names:
        inst = block_instance(name.rsplit(".", 1)[0])
        owner = inst[0] if inst is not None else name.rsplit(".", 1)[0]
        if inst is not None:
            blocks.setdefault(inst[0], set()).add(int(inst[1].rsplit(".", 1)[1]))
        if owner not in parts:
            parts.append(owner)
    text = []
    for p in parts:
        if p in blocks:
            idx = sorted(blocks[p])
            span = f"{idx[0]}-{idx[-1]}" if len(idx) > 1 else f"{idx[0]}"
            each = len(idx) // len(stages)
            plural, each_word = "s" if each > 1 else "", " each" if len(stages) > 1 else ""
            text.append(f"{p.replace('#', span)} ({each} block{plural}{each_word})")
        else:
            text.append(p)
    return " + ".join(text) if text else f"{sum(len(st.nodes) for st in stages)} ops"


def _ranks(ranks) -> str:
    return f"{ranks[0]}..{ranks[-1]}" if len(ranks) > 2 else ", ".join(map(str, ranks))


def _pipeline_lines(plan) -> list[str]:
    """A pipeline's batch-coupled ops and its stages (rank group, ranks, submesh, contents, recompute,
    estimated memory per device; consecutive stages alike but for their block numbers on one row)."""
    out = []
    coupled = getattr(plan, "batch_coupled", None)
    if coupled and plan.microbatches > 1:
        shown = "; ".join(coupled[:3]) + (f"; and {len(coupled) - 3} more" if len(coupled) > 3 else "")
        out.append(f"  batch-coupled ops run per microbatch of 1/{plan.microbatches} of the batch (BatchNorm "
                   f"normalises each microbatch on its own, unlike one device on the whole batch): {shown}")
    out.append("  stages (rank group, ranks, submesh, contents, recompute, estimated memory per device):")
    rows: list[tuple[tuple, list]] = []
    for stage in plan.stages:
        sol = stage.solution
        mem = ""
        if sol is not None:
            mb = ", ".join(f"{k} {human_bytes(v)}" for k, v in (sol.memory_breakdown or {}).items())
            mem = f"{human_bytes(sol.estimated_memory)} ({mb})"
        contents = stage_contents(stage)
        key = (tuple(stage.mesh.shape), tuple(stage.mesh.axis_names), stage.recompute, mem,
               re.sub(r"\.\d+-\d+ \(", ".# (", re.sub(r"\.\d+ \(", ".# (", contents)))
        if rows and rows[-1][0] == key and rows[-1][1][-1].group != stage.group:
            rows[-1][1].append(stage)
        else:
            rows.append((key, [stage]))
    for (shape, names, recompute, mem, _), stages in rows:
        first = stages[0]
        if len(stages) == 1:
            head = f"stage {first.index:<3} group {first.group:<3} ranks {_ranks(first.ranks):<12}"
        else:
            ranks = sorted(r for st in stages for r in st.ranks)
            head = (f"stages {first.index}-{stages[-1].index} (x{len(stages)}) groups {first.group}-{stages[-1].group} "
                    f"ranks {_ranks(ranks)}")
        contents = stage_contents(*stages)
        out.append(f"    {head} submesh {shape} {names}  {contents}{'  recompute' if recompute else ''}  {mem}")
    return out


def _replicated_lines(plan) -> list[str]:
    """The ops without a rule: per op, its outputs on every device and its seconds per step (needs the
    captured graph and a known hardware; a loaded plan lists the names only), and the remedy."""
    names = plan.replicated_ops
    if not names:
        return []
    costs = None
    if plan.captured is not None and not plan.pipelined:
        try:
            hw = known_hardware(plan.hardware)
            costs = replicated_op_costs(plan.captured, plan.mesh, hw) if hw is not None else None
        except (AutoshardError, OSError, ValueError):  # a hardware label naming no preset or profile here
            costs = None
    out = ["  ops run replicated for lack of a sharding rule (whole outputs on every device):"]
    if costs:
        for c in costs:
            out.append(f"    {c.op} x{c.nodes}: outputs {human_bytes(c.output_bytes)} per device "
                       f"({human_bytes(c.split_bytes(plan.mesh))} if split over {plan.mesh.size}), "
                       f"{human_time(c.seconds)} per step")
    else:
        out.append(f"    {', '.join(names)}")
    out.append(f"    to let them shard, {REGISTER_HINT}")
    return out
