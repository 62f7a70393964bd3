"""Cut a captured training program into per-stage sub-programs, and name stage boundaries.

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

The planner solves each stage's sub-program (``passes.pipeline.stages.retrace``) and the runtime runs
it (``runtime.pipeline``): both take it from here. Pure graph surgery on ``passes``' vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch.fx as fx

from autoshard.passes.errors import PlanFormatError
from autoshard.passes.graph import META, MODULE, CapturedGraph, exact_placeholder, is_getitem
from autoshard.passes.spec import TensorMeta

__all__ = ["StageGraph", "split_stages", "whole_program", "stage_nodes_from_prefixes", "stage_nodes_from_starts",
           "call_nodes"]


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


def call_nodes(captured: CapturedGraph) -> list[fx.Node]:
    """The program's call_function nodes, in graph order."""
    return [n for n in captured.gm.graph.nodes if n.op == "call_function"]


def _stage_of(captured: CapturedGraph, stage_nodes: Sequence[Sequence[str]]) -> dict[fx.Node, int]:
    by_name = {n.name: n for n in call_nodes(captured)}
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


def whole_program(captured: CapturedGraph) -> StageGraph:
    """The one stage of a plan without a pipeline: ``captured`` itself (no surgery), reading every user
    input and the target, receiving and sending nothing."""
    return StageGraph(0, captured, user_inputs=list(range(len(captured.inputs))),
                      reads_target=captured.target is not None)


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
                        loss_output=last, method=captured.method,
                        receives_output_grads=not last and captured.training)
    return StageGraph(s, sub, [(a.name, where[a]) for a in received], sends, [user_pos[u] for u in users],
                      reads_target)


def _placeholder(graph: fx.Graph, like: fx.Node) -> fx.Node:
    new = exact_placeholder(graph, like.name)
    new.meta.update({k: v for k, v in like.meta.items() if k in (META, MODULE, "val", "tensor_meta")})
    return new


def stage_nodes_from_starts(captured: CapturedGraph, starts: Sequence[str]) -> list[list[str]]:
    """Stage node lists from the names of the nodes where stages 1, 2, ... start (graph order).
    A first name equal to the graph's first op is allowed and means stage 0."""
    calls = [n.name for n in call_nodes(captured)]
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
        hit = next((n.name for n in call_nodes(captured)
                    if (m := n.meta.get(MODULE, "")) == p or m.startswith(p + ".")), None)
        if hit is None:
            mods = sorted({n.meta.get(MODULE, "") for n in call_nodes(captured)})
            raise PlanFormatError(f"no op of the captured graph comes from module {p!r}; modules are e.g. {mods[:10]}")
        starts.append(hit)
    return stage_nodes_from_starts(captured, starts)
