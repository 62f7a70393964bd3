"""Cut a captured training program into per-stage sub-programs, and build ``PipelinePlan``s by hand.

``split_stages(captured, stage_nodes)`` takes, per stage, the names of its call_function nodes (a
partition of the graph's call_function nodes, in graph order) and returns one ``StageGraph`` per
stage: a self-contained ``CapturedGraph`` whose placeholders are, in order, the parameters and
buffers the stage reads, the user inputs it reads, the values it *receives* from earlier stages
(placeholders named after their producer nodes, so a Solution planned on the sub-graph names them
the same way), and the target if the stage reads it. A non-final stage returns a tuple of the values
later stages read; the final stage returns the loss. A long skip connection (a value made in stage
0 and read in stage 3) is received straight from its producer's stage.

A ``getitem`` always travels with the multi-output op it reads, so only tensors cross stages.

Stage boundaries can be named two ways:

>>> stage_nodes_from_prefixes(captured, ["blocks.1"])          # doctest: +SKIP
[[...nodes before blocks.1...], [...blocks.1 and after...]]
>>> stage_nodes_from_starts(captured, ["linear_2"])              # doctest: +SKIP

and ``make_pipeline_plan`` turns stage node lists into a ``PipelinePlan`` whose stages sit on
the rank groups of the physical mesh's first axis. ``replan_at_microbatch`` turns the stage
planner's plan (``passes.pipeline.stages.planner.plan_pipeline``, made at global-batch shapes) into one the
runtime can run: the same cut, groups, submeshes, schedule and microbatches on the program traced at
microbatch shapes, every stage's Solution re-solved there. The two traces need not match op for op
(HF models build masks and position ids from the batch size: at one sequence an ``expand`` goes
away): ``retrace_stage_nodes`` aligns them (longest matching runs of (op, module path)) and moves
each stage boundary onto its counterpart. This module imports only
``autoshard.passes`` (it is pure graph surgery), so the stage planner can reuse it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Callable, Optional, Sequence

import torch.fx as fx

from autoshard.passes.errors import PlanFormatError
from autoshard.passes.graph import META, MODULE, CapturedGraph, exact_placeholder, is_getitem
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.stages.stage_plan import PipelinePlan, StagePlan
from autoshard.passes.solve.solution import Solution
from autoshard.passes.spec import TensorMeta

__all__ = ["StageGraph", "split_stages", "stage_nodes_from_prefixes", "stage_nodes_from_starts",
           "stage_group", "make_pipeline_plan", "stage_solution", "match_nodes", "align_nodes", "retrace_stage_nodes", "replan_at_microbatch"]


@dataclass
class StageGraph:
    """One stage's sub-program and its wiring.

    ``captured``: the stage's CapturedGraph (``loss_output`` on the final stage). ``receives``:
    (producer node name, producer stage) per received input, in placeholder order. ``sends``: the
    stage's outputs in return order, each (node name, consumer stages). ``user_inputs``: positions
    (in the full program's user inputs) of the user inputs the stage reads, in placeholder order.
    """
    index: int
    captured: CapturedGraph
    receives: list[tuple[str, int]] = field(default_factory=list)
    sends: list[tuple[str, list[int]]] = field(default_factory=list)
    user_inputs: list[int] = field(default_factory=list)
    reads_target: bool = False

    @property
    def is_last(self) -> bool:
        return self.captured.loss_output


def _calls(captured: CapturedGraph) -> list[fx.Node]:
    return [n for n in captured.gm.graph.nodes if n.op == "call_function"]


def _stage_of(captured: CapturedGraph, stage_nodes: Sequence[Sequence[str]]) -> dict[fx.Node, int]:
    by_name = {n.name: n for n in _calls(captured)}
    where: dict[fx.Node, int] = {}
    for s, names in enumerate(stage_nodes):
        for name in names:
            if name not in by_name:
                raise PlanFormatError(f"stage {s} names node {name!r}, which is no call_function node of the "
                                      "captured graph; take names from captured.gm.graph")
            if by_name[name] in where:
                raise PlanFormatError(f"node {name!r} is in stages {where[by_name[name]]} and {s}; each node "
                                      "belongs to exactly one stage")
            where[by_name[name]] = s
    missing = [n.name for n in by_name.values() if n not in where]
    if missing:
        raise PlanFormatError(f"{len(missing)} call_function node(s) belong to no stage (e.g. {missing[:5]}); "
                              "the stages must partition the graph's ops")
    for n in by_name.values():  # a getitem travels with its multi-output producer
        if is_getitem(n) and n.args[0] in where:
            where[n] = where[n.args[0]]
    for n in by_name.values():
        for a in n.all_input_nodes:
            if a in where and where[a] > where[n]:
                raise PlanFormatError(f"node {n.name!r} (stage {where[n]}) reads {a.name!r} from the later stage "
                                      f"{where[a]}; values must flow forward: cut the graph in graph order")
    return where


def split_stages(captured: CapturedGraph, stage_nodes: Sequence[Sequence[str]]) -> list[StageGraph]:
    """One ``StageGraph`` per stage. Raises ``PlanFormatError`` when the node lists do not partition
    the graph's ops in forward order, when a non-tensor value would cross stages, or when the loss
    is not computed on the last stage."""
    if not captured.loss_output:
        raise PlanFormatError("pipeline stages need a program traced with a loss function (loss_fn=...)")
    where = _stage_of(captured, stage_nodes)
    n_stages = len(stage_nodes)
    out_node = captured.output_node
    loss_nodes = [a for a in out_node.all_input_nodes]
    if any(where.get(a, n_stages - 1) != n_stages - 1 for a in loss_nodes):
        raise PlanFormatError("the loss must be computed on the last stage; move its ops there")
    consumers: dict[fx.Node, set[int]] = {}
    for n, s in where.items():
        for a in n.all_input_nodes:
            if a in where and where[a] != s:
                consumers.setdefault(a, set()).add(s)
    placeholders = {n.name: n for n in captured.gm.graph.nodes if n.op == "placeholder"}
    user_pos = {name: i for i, name in enumerate(captured.inputs)}
    stages = []
    for s in range(n_stages):
        mine = [n for n in captured.gm.graph.nodes if where.get(n) == s]
        stages.append(_build_stage(captured, s, mine, where, consumers, placeholders, user_pos,
                                   last=(s == n_stages - 1)))
    return stages


def _build_stage(captured, s, mine, where, consumers, placeholders, user_pos, last) -> StageGraph:
    reads: set[fx.Node] = set()
    for n in mine:
        reads.update(a for a in n.all_input_nodes if where.get(a) != s)
    order = {n: i for i, n in enumerate(captured.gm.graph.nodes)}
    received = sorted((a for a in reads if a in where), key=order.__getitem__)
    for a in received:
        if not isinstance(a.meta.get(META), TensorMeta):
            raise PlanFormatError(f"stage {s} reads {a.name!r} from stage {where[a]}, which is not a single tensor; "
                                  "move the boundary so only tensors cross stages")
    params = [p for p in captured.params if placeholders[p] in reads]
    buffers = [b for b in captured.buffers if placeholders[b] in reads]
    users = [u for u in captured.inputs if placeholders[u] in reads]
    reads_target = captured.target is not None and placeholders[captured.target] in reads
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for name in params + buffers + users:
        env[placeholders[name]] = _placeholder(graph, placeholders[name])
    for a in received:
        env[a] = _placeholder(graph, a)
    if reads_target:
        env[placeholders[captured.target]] = _placeholder(graph, placeholders[captured.target])
    for n in [g for g in captured.gm.graph.nodes if g.op == "get_attr" and any(u in mine for u in g.users)]:
        env[n] = graph.node_copy(n, env.__getitem__)
    for n in mine:
        env[n] = graph.node_copy(n, env.__getitem__)
    sends: list[tuple[str, list[int]]] = []
    if last:
        graph.output(fx.node.map_arg(captured.output_node.args[0], env.__getitem__))
    else:
        outs = [n for n in mine if n in consumers]
        if not outs:
            raise PlanFormatError(f"stage {s} sends nothing to later stages; every stage must feed the next")
        for n in outs:
            if not isinstance(n.meta.get(META), TensorMeta):
                raise PlanFormatError(f"stage {s} sends {n.name!r}, which is not a single tensor; move the boundary")
        graph.output(tuple(env[n] for n in outs))
        sends = [(n.name, sorted(consumers[n])) for n in outs]
    gm = fx.GraphModule(captured.gm, graph, class_name=f"Stage{s}")
    sub = CapturedGraph(gm, {p: captured.params[p] for p in params}, {b: captured.buffers[b] for b in buffers},
                        users + [a.name for a in received], captured.target if reads_target else None,
                        {k: v for k, v in captured.aliases.items() if v in {captured.params[p] for p in params}},
                        loss_output=last, method=captured.method)
    return StageGraph(s, sub, [(a.name, where[a]) for a in received], sends, [user_pos[u] for u in users],
                      reads_target)


def _placeholder(graph: fx.Graph, like: fx.Node) -> fx.Node:
    new = exact_placeholder(graph, like.name)
    new.meta.update({k: v for k, v in like.meta.items() if k in (META, MODULE, "val", "tensor_meta")})
    return new


def stage_nodes_from_starts(captured: CapturedGraph, starts: Sequence[str]) -> list[list[str]]:
    """Stage node lists from the names of the nodes where stages 1, 2, ... start (graph order).
    A first name equal to the graph's first op is allowed and means stage 0."""
    calls = [n.name for n in _calls(captured)]
    index = {n: i for i, n in enumerate(calls)}
    starts = list(starts)
    if starts and starts[0] == calls[0]:
        starts = starts[1:]
    for name in starts:
        if name not in index:
            raise PlanFormatError(f"stage start {name!r} is no call_function node of the captured graph")
    cuts = [0] + [index[n] for n in starts] + [len(calls)]
    if any(b <= a for a, b in zip(cuts, cuts[1:])):
        raise PlanFormatError(f"stage starts {list(starts)} are not in increasing graph order (or a stage is empty)")
    return [calls[a:b] for a, b in zip(cuts, cuts[1:])]


def stage_nodes_from_prefixes(captured: CapturedGraph, prefixes: Sequence[str]) -> list[list[str]]:
    """Stage node lists from module-name prefixes: stage k+1 starts at the first op (graph order) made
    by module ``prefixes[k]`` or one of its submodules (``node.meta["autoshard.module"]``)."""
    starts = []
    for p in prefixes:
        hit = next((n.name for n in _calls(captured)
                    if (m := n.meta.get(MODULE, "")) == p or m.startswith(p + ".")), None)
        if hit is None:
            mods = sorted({n.meta.get(MODULE, "") for n in _calls(captured)})
            raise PlanFormatError(f"no op of the captured graph comes from module {p!r}; modules are e.g. {mods[:10]}")
        starts.append(hit)
    return stage_nodes_from_starts(captured, starts)


def stage_group(schedule: str, pp: int, virtual: int, stage: int) -> int:
    """The rank group running ``stage`` (``generators.stage_rank``: round robin for loop schedules, a V
    (0..p-1, then p-1..0) for zbv/dualpipev)."""
    from autoshard.passes.pipeline.schedule.generators import stage_rank
    return stage_rank(schedule, pp, virtual)[stage]


def make_pipeline_plan(captured: CapturedGraph, stage_nodes: Sequence[Sequence[str]], mesh, *, schedule: str,
                       microbatches: int, virtual: int = 1,
                       solve: Optional[Callable[[StageGraph, Mesh], Solution]] = None) -> PipelinePlan:
    """A ``PipelinePlan`` from stage node lists on the physical ``mesh`` (its first axis = pp groups;
    the rest is each group's submesh, ``(1,)`` for a 1-D mesh). ``solve(stage_graph, submesh)``
    returns the stage's intra-op Solution (None leaves it unplanned)."""
    mesh = Mesh.of(mesh)
    pp = mesh.shape[0]
    n = len(stage_nodes)
    if n != pp * virtual:
        raise PlanFormatError(f"{n} stages but pp * virtual = {pp} * {virtual} = {pp * virtual}; give one node "
                              "list per stage")
    sub = Mesh(mesh.shape[1:], mesh.axis_names[1:]) if mesh.ndim > 1 else Mesh((1,))
    graphs = split_stages(captured, stage_nodes)
    stages = []
    for s, g in enumerate(graphs):
        grp = stage_group(schedule, pp, virtual, s)
        ranks = list(range(grp * sub.size, (grp + 1) * sub.size))
        sol = solve(g, sub) if solve is not None else None
        stages.append(StagePlan(s, list(stage_nodes[s]), grp, ranks, sub,
                                stage_solution(sol, g, schedule, pp, int(microbatches))))
    return PipelinePlan(pp, virtual, stages, schedule, int(microbatches))


def stage_solution(solution: Optional[Solution], graph: StageGraph, schedule: str, pp: int,
                   microbatches: int) -> Optional[Solution]:
    """A stage's intra-op ``solution`` (one microbatch's walk) with ``estimated_memory`` the stage's
    whole-step peak under ``schedule`` (``passes.pipeline.stages.stage_peak``): its in-flight
    microbatches (the schedule's closed form), accumulated gradients, and p2p buffers (the received
    values and the gradients of the sent ones, at full size: exact on a (1,) submesh, an over-estimate
    where the stage shards them)."""
    if solution is None:
        return solution
    from autoshard.passes.pipeline.schedule.registry import get_schedule
    from autoshard.passes.pipeline.stages.stage_peak import with_stage_peak
    held = get_schedule(schedule).approx_held(pp, microbatches)
    received = graph.captured.inputs[len(graph.captured.inputs) - len(graph.receives):] if graph.receives else []
    p2p = 0.0
    for name in list(received) + [n for n, _ in graph.sends]:
        meta = graph.captured.node(name).meta.get(META)
        p2p += meta.nbytes if isinstance(meta, TensorMeta) else 0.0
    return with_stage_peak(solution, held[min(graph.index, len(held) - 1)], p2p)


def match_nodes(full: CapturedGraph, small: CapturedGraph) -> dict[str, str]:
    """call_function node name in ``full`` -> the same op's name in ``small``: the same program traced
    at another batch size. Ops pair up in graph order and must call the same targets; raises
    ``PlanFormatError`` when the two traces differ (a batch-size-dependent program)."""
    a, b = _calls(full), _calls(small)
    diff = next((i for i, (x, y) in enumerate(zip(a, b)) if x.target != y.target), None)
    if len(a) != len(b) or diff is not None:
        where = (f"op {diff}: {a[diff].name} ({a[diff].target}) vs {b[diff].name} ({b[diff].target})"
                 if diff is not None else f"{len(a)} ops vs {len(b)}")
        raise PlanFormatError(f"the program traced at the global batch and at the microbatch size differ ({where}); "
                              "the model's ops depend on its batch size, so a pipeline plan made at one cannot run at "
                              "the other: pin stages= by hand, or make the forward independent of the batch size")
    return {x.name: y.name for x, y in zip(a, b)}


#: how many ops may differ between two traces of one program at two batch sizes (on either side)
_RETRACE_SLACK = 0.1


def _aligned(full: CapturedGraph, small: CapturedGraph) -> dict[int, int]:
    """Op position in ``full`` -> its counterpart's in ``small`` (see ``align_nodes``)."""
    a, b = _calls(full), _calls(small)

    def key(n: fx.Node):
        return str(n.target), n.meta.get(MODULE, "")

    ka, kb = [key(n) for n in a], [key(n) for n in b]
    if ka == kb:
        return {i: i for i in range(len(a))}
    matched: dict[int, int] = {}
    for blk in SequenceMatcher(None, ka, kb, autojunk=False).get_matching_blocks():
        matched.update((blk.a + k, blk.b + k) for k in range(blk.size))
    slack = max(2, int(_RETRACE_SLACK * len(a)))
    if len(a) - len(matched) > slack or len(b) - len(matched) > slack:
        first = next((i for i in range(min(len(a), len(b))) if ka[i] != kb[i]), min(len(a), len(b)))
        where = f"op {first}: {a[first].name} ({a[first].target})" if first < len(a) else f"{len(a)} ops vs {len(b)}"
        raise PlanFormatError(f"the program traced at the global batch and at the microbatch size differ in "
                              f"{len(a) - len(matched)} of {len(a)} ops (first at {where}); the model's structure "
                              "depends on its batch size, so a pipeline plan made at one cannot run at the other: pin "
                              "stages= by hand, or make the forward independent of the batch size")
    return matched


def align_nodes(full: CapturedGraph, small: CapturedGraph) -> dict[str, str]:
    """call_function node name in ``full`` -> its counterpart's in ``small``, the same program traced at
    another batch size: every op, position for position, when the traces match; otherwise the ops an
    alignment of the two op sequences by (target, module path) pairs up (longest matching runs), ops
    only one trace has left out. Raises ``PlanFormatError`` when the traces differ in more than a few
    ops (another program, or one whose structure depends on the batch size)."""
    a, b = _calls(full), _calls(small)
    return {a[i].name: b[j].name for i, j in _aligned(full, small).items()}


def retrace_stage_nodes(full: CapturedGraph, small: CapturedGraph,
                        stage_nodes: Sequence[Sequence[str]]) -> list[list[str]]:
    """``stage_nodes`` (a partition of ``full``'s ops, in graph order) moved onto ``small``, the same
    program traced at another batch size (``align_nodes``): each boundary at its op's counterpart, or
    right after the counterpart of the last op before it that has one; ops only ``small`` has stay
    inside the stage around them."""
    a, b = _calls(full), _calls(small)
    matched = _aligned(full, small)
    pos = {n.name: i for i, n in enumerate(a)}
    starts = [0]
    for nodes in stage_nodes[1:]:
        i = min(pos[n] for n in nodes)
        if i in matched:
            starts.append(matched[i])
        else:
            before = [matched[k] for k in range(i) if k in matched]
            starts.append(before[-1] + 1 if before else 0)
    starts.append(len(b))
    if any(y <= x for x, y in zip(starts, starts[1:])):
        raise PlanFormatError(f"the stage boundaries land on ops {starts[1:-1]} of the program traced at the "
                              "microbatch size, leaving a stage empty; pin stages= by hand")
    return [[n.name for n in b[x:y]] for x, y in zip(starts, starts[1:])]


def replan_at_microbatch(plan: PipelinePlan, full: CapturedGraph, small: CapturedGraph, *,
                         solve: Callable[[StageGraph, Mesh], Solution]) -> PipelinePlan:
    """The runtime's plan for ``plan``, a pipeline plan made on ``full`` (the program at global-batch
    shapes): the same stage cut (``retrace_stage_nodes``), rank groups, stage submeshes, schedule,
    microbatches and estimates, on ``small`` (the program traced at microbatch shapes, which stage
    programs bake in), with every stage's intra-op Solution from ``solve(stage_graph, stage_submesh)``.
    A Solution made at global shapes cannot be reused: its sizes differ, and it has no strategies for
    the values a stage receives."""
    stage_nodes = retrace_stage_nodes(full, small, [s.nodes for s in plan.stages])
    graphs = split_stages(small, stage_nodes)
    stages = [StagePlan(s.index, stage_nodes[i], s.group, list(s.ranks), s.mesh,
                        stage_solution(solve(graphs[i], s.mesh), graphs[i], plan.schedule, plan.pp, plan.microbatches),
                        s.recompute)
              for i, s in enumerate(plan.stages)]
    return PipelinePlan(plan.pp, plan.virtual, stages, plan.schedule, plan.microbatches, plan.estimated_step_time,
                        plan.bubble_fraction, list(plan.peak_activation_memory))
