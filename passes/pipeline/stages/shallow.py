"""A deep model's identical blocks planned through a shallow copy of its program.

A 96-block model traces in seconds, but pricing 96 copies of the same block for every candidate
submesh is most of the stage planner's time. Identical blocks cost the same, so the planner prices a
SHALLOW program, the deep one with all but its first ``keep`` blocks cut out, and counts each kept
block ``blocks / keep`` times (``candidate_plan.plan_submesh(repeat=...)``, ``SubmeshProfile.repeat_blocks``).
Its answer is then written back onto the deep program: every node of a cut block takes the decision
of its counterpart in the last kept block (``ShallowProgram.deep_solution``).

    shallow = shallow_program(captured)          # None unless the program qualifies (below)
    shallow.captured                             # embedding, blocks 0..keep-1, head
    shallow.deep_solution(solution_on_shallow)   # the same decisions on every deep node

A program qualifies when its numbered blocks form one contiguous run of one block type
(``layer_costs.layer_units``), at least ``min_blocks`` long, its copy holds at least a gradient
bucket of parameters (``MIN_PARAM_BYTES``: the cost model prices a gradient's share of a bucket's
latency by the program's parameter bytes), and in which every block from ``keep - 1``
on is the same program: the same ops in the same order with the same shapes, arguments and module
paths, reading only its own parameters, the block just before it, and values from outside the run
(the inputs, the embedding's outputs, parameters outside blocks); and nothing after the run reads a
block other than the last. The head then reads block ``keep - 1`` of the shallow copy where it read
the last block of the deep one.

Nothing is lost when the blocks are identical: the profile keeps block 0's own costs (it alone
reads the embedding) and stands the kept block that reads a block for the other ``blocks - 1``
(``SubmeshProfile.repeat_blocks``); the intra-op ILP counts each kept block's nodes and inner edges
``blocks / keep`` times and the block-to-block edge ``blocks - 1`` times (``candidate_plan.plan_submesh``),
as the deep program has them. ``tests/passes/pipeline/test_shallow_copy.py`` checks that the folded
and the full-depth planner give the same plan and estimate.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch.fx as fx
from torch.fx.node import map_arg

from autoshard.passes.graph import META, MODULE, CapturedGraph, outputs
from autoshard.passes.pipeline.stages.layer_costs import LayerUnit, layer_units
from autoshard.passes.solve.clustering import OUTPUT, graph_edges
from autoshard.passes.solve.solution import Redistribution, Solution

__all__ = ["ShallowProgram", "shallow_program", "MIN_BLOCKS", "KEEP", "MIN_PARAM_BYTES"]

#: fewer identical blocks than this are planned as they are (the copy would save little)
MIN_BLOCKS = 16
#: blocks the shallow copy keeps: block 0 (which reads the embedding) and one that reads a block
KEEP = 2
#: the copy's parameters must fill a gradient bucket (the cost model spreads a bucket's latency over
#: the model's parameter bytes, up to 25 MiB): a smaller model plans quickly at full depth anyway
MIN_PARAM_BYTES = 32 * 2 ** 20


@dataclass
class ShallowProgram:
    """The shallow copy of ``deep`` (see the module docstring).

    ``units``: the shallow program's layer units (embedding, ``keep`` blocks, head); ``deep_units``:
    the deep program's, the same with ``blocks`` blocks. ``counterpart``: deep node name -> the
    shallow node that stands for it (itself where it was kept), every placeholder and op;
    ``fqn_counterpart``: the same for parameter and buffer names (aliases included)."""
    captured: CapturedGraph
    deep: CapturedGraph
    units: list[LayerUnit]
    deep_units: list[LayerUnit]
    blocks: int
    counterpart: dict[str, str] = field(repr=False)
    fqn_counterpart: dict[str, str] = field(repr=False)

    def deep_solution(self, solution: Solution) -> Solution:
        """``solution`` (made for the shallow program) on the deep program: every deep node takes its
        counterpart's strategy, every parameter its counterpart's placement and gradient syncs, every
        edge whose placements differ its counterpart edge's redistribution. Estimates and solver
        statistics stay the shallow program's (the stage planner prices stages itself)."""
        strategies = {name: solution.strategies[c] for name, c in self.counterpart.items()}
        placements = {fqn: solution.param_placements[c] for fqn, c in self.fqn_counterpart.items()
                      if c in solution.param_placements}
        syncs = {fqn: list(solution.param_grad_syncs[self.fqn_counterpart[fqn]]) for fqn in self.deep.params.values()
                 if self.fqn_counterpart[fqn] in solution.param_grad_syncs}  # canonical names only, as ``evaluate``
        moved = {(r.consumer, r.operand_index): r for r in solution.redistributions}
        moves = []
        for u, slot, v, k in graph_edges(self.deep):
            r = moved.get((OUTPUT if v == OUTPUT else self.counterpart[v], k))
            if r is None:
                continue
            src = tuple(strategies[u].outputs[slot])
            if src != tuple(r.src) or (v != OUTPUT and tuple(strategies[v].inputs[k]) != tuple(r.dst)):
                raise AssertionError(f"edge {u} -> {v}: the shallow copy moves {r.src} -> {r.dst} where the deep "
                                     f"program's strategies give {src}: its blocks were not planned alike")
            moves.append(Redistribution(u, v, k, r.src, r.dst, r.collectives))
        return replace(solution, strategies=strategies, param_placements=placements, redistributions=moves,
                       param_grad_syncs=syncs, solver_stats=dict(solution.solver_stats, shallow_copy_of=self.blocks))


def shallow_program(captured: CapturedGraph, units: Optional[list[LayerUnit]] = None, *, keep: int = KEEP,
                    min_blocks: int = MIN_BLOCKS, min_param_bytes: float = MIN_PARAM_BYTES
                    ) -> Optional[ShallowProgram]:
    """The shallow copy of ``captured`` keeping its first ``keep`` blocks, or None when the program does
    not qualify (module docstring), has fewer than ``min_blocks`` blocks, or the copy would hold fewer
    than ``min_param_bytes`` of parameters (``MIN_PARAM_BYTES``)."""
    if keep < 2:
        raise ValueError("keep must be >= 2: the kept block that stands for the cut ones reads a block")
    units = units if units is not None else layer_units(captured)
    run = [i for i, u in enumerate(units) if u.block is not None]
    if (len(run) < max(min_blocks, keep + 1) or run != list(range(run[0], run[-1] + 1))
            or len({units[i].block for i in run}) != 1):
        return None
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    unit_of = {name: i for i, u in enumerate(units) for name in u.nodes}
    fqn_of = {**captured.params, **captured.buffers}
    owner = {}  # placeholder name -> the block unit whose parameter it is
    for ph, fqn in fqn_of.items():
        for i in run:
            if fqn.startswith(units[i].name + "."):
                owner[ph] = i
    signatures = {i: _block_signature(units, i, nodes, unit_of, owner, fqn_of) for i in run[keep - 1:]}
    model = signatures[run[keep - 1]]
    if any(signatures[i] != model for i in run[keep:]):
        return None
    cut = set(run[keep:])
    last, stand_in = run[-1], run[keep - 1]
    counterpart: dict[str, str] = {}
    for i in cut:
        for mine, theirs in zip(units[i].nodes, units[stand_in].nodes):
            counterpart[mine] = theirs
    ph_by_fqn = {fqn: ph for ph, fqn in fqn_of.items()}
    for ph, i in owner.items():
        if i in cut:
            twin = units[stand_in].name + fqn_of[ph][len(units[i].name):]
            if twin not in ph_by_fqn:
                return None
            counterpart[ph] = ph_by_fqn[twin]
    # after the run, only the last block may be read: the shallow copy's last kept block stands for it
    redirect: dict[str, str] = {}
    for node in captured.gm.graph.nodes:
        if node.name in counterpart:
            continue
        for a in node.all_input_nodes:
            if a.name in counterpart:
                if unit_of.get(a.name) != last:
                    return None
                redirect[a.name] = counterpart[a.name]
    shallow = _cut(captured, set(counterpart), redirect)
    if sum(m.nbytes for ph in shallow.params for m in outputs(shallow.node(ph)) if m is not None) < min_param_bytes:
        return None
    shallow_units = layer_units(shallow)
    expect = [u.name for i, u in enumerate(units) if i not in cut]
    if [u.name for u in shallow_units] != expect:
        return None
    for name in nodes:
        if nodes[name].op in ("placeholder", "call_function"):
            counterpart.setdefault(name, name)
    fqn_counterpart = {}
    for ph, fqn in fqn_of.items():
        fqn_counterpart[fqn] = fqn_of[counterpart[ph]]
    for alias, canonical in captured.aliases.items():
        if canonical in fqn_counterpart:
            fqn_counterpart[alias] = fqn_counterpart[canonical]
    return ShallowProgram(shallow, captured, shallow_units, list(units), len(run), counterpart, fqn_counterpart)


def _block_signature(units, i, nodes, unit_of, owner, fqn_of) -> tuple:
    """Block ``i``'s program with every reference made relative (see the module docstring)."""
    position = {name: k for k, name in enumerate(units[i].nodes)}
    before = set(units[i - 1].nodes) if units[i - 1].block is not None else set()
    prefix = units[i].name + "."

    def ref(a: fx.Node):
        if a.name in position:
            return ("own", position[a.name])
        if a.name in before:
            return ("previous", units[i - 1].nodes.index(a.name))
        if a.op == "placeholder" and owner.get(a.name) == i:
            return ("param", fqn_of[a.name][len(prefix):])
        if a.name in owner or (a.name in unit_of and units[unit_of[a.name]].block is not None):
            return ("other block", a.name, i)  # never equal across blocks: disqualifies the run
        return ("outside", a.name)

    out = []
    for name in units[i].nodes:
        n = nodes[name]
        path = str(n.meta.get(MODULE, ""))
        inner = "" if path == units[i].name else path[len(prefix):] if path.startswith(prefix) else path
        out.append((str(n.target), repr(map_arg(n.args, ref)), repr(map_arg(n.kwargs, ref)),
                    repr(n.meta.get(META)), inner))
    return tuple(out)


def _cut(captured: CapturedGraph, dropped: set[str], redirect: dict[str, str]) -> CapturedGraph:
    """``captured`` without the ``dropped`` nodes; reads of a dropped node go to ``redirect[name]``."""
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for node in captured.gm.graph.nodes:
        if node.name in dropped:
            continue
        env[node.name] = graph.node_copy(node, lambda a: env[redirect.get(a.name, a.name)])
        if env[node.name].name != node.name:
            raise AssertionError(f"copying node {node.name!r} renamed it {env[node.name].name!r}")
    gm = fx.GraphModule(captured.gm, graph)
    kept = set(env)
    params = {k: v for k, v in captured.params.items() if k in kept}
    buffers = {k: v for k, v in captured.buffers.items() if k in kept}
    aliases = {a: c for a, c in captured.aliases.items() if c in set(params.values()) | set(buffers.values())}
    return CapturedGraph(gm, params, buffers, list(captured.inputs), captured.target, aliases,
                         captured.loss_output, captured.method)
