"""Regional compilation of one rank's program: each stretch of traceable ops between the parts that
must stay eager becomes one ``torch.compile``'d region (``CompiledRegion``).

``compile_regions(program, compiler)`` takes a lowered program whose redistribution collectives are
already functional (``functional_collectives.functionalize``) and whose checkpointed blocks are
outlined (``regions.outline_regions``). In its top graph and in the body of every ``CheckpointRegion``
it outlines each maximal run of traceable nodes into a ``CompiledRegion``:

- traceable: ATen and prims ops, the functional collectives (compiled into the graph, where
  inductor sees and schedules them), and the lowering helpers written in plain tensor ops
  (``_TRACEABLE_HELPERS``);
- left where they are, outside any region: the chunks of the program's inputs this rank takes (a
  slice, free eagerly; out of the graph, the regions after it do not depend on the rank);
- eager, between regions, each kind with its reason in the report (``CompileReport.lines``): the
  parameter gathers (the ``ParamGatherer``'s fused flat all-gathers, its forward/backward prefetch and
  reshard-after-forward hooks, which keep state across the step), the write-back of in-place updates
  into stored parameter pieces, lowerings with data-dependent or point-to-point communication (MoE
  dispatch, ring attention), custom ops, and the checkpoint wrappers themselves
  (``torch.utils.checkpoint`` runs eagerly around the compiled regions of a checkpointed block, so
  a recompute re-runs them and re-issues their collectives, as the eager program does).

So the memory levers keep their eager meaning: a checkpointed block keeps only its inputs, a
resharding group's copies saved by a compiled region are packed as handles by the gatherer's hooks
(the compiled function saves them through autograd like any op), accumulation calls the same
regions k times, and mixed precision's casts happen in the gathers. One difference: a "selective"
checkpoint keeps matmul outputs only of eager ops (its policy sees the dispatcher's ops, and
inductor's kernels reuse their buffers), so its compiled regions are recomputed in full; the report
says so.

A data-parallel plan has no gathers: its forward is one region (one forward and one backward graph),
cut where the parameters it first uses pass a gradient bucket's bytes (``compile_regions``' ``synced``),
so the all-reduce of each bucket can overlap the backward of the regions before it.
Regions compile at their first call (``compile_backend.RegionCompiler``).
"""
from __future__ import annotations

import operator
from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx
import torch.nn as nn

from . import collectives as C
from . import functional_collectives as FC
from .batch_norm_sync import bn_apply, bn_local_stats
from .compile_backend import CompileStats, RegionCompiler
from .lower import write_back
from .lowerings import loss_weight_total, vocab_embedding
from .param_gather import gather_params
from .recompute import outside_selective_checkpoint
from .regions import CheckpointRegion

__all__ = ["CompiledRegion", "CompileReport", "compile_regions"]

_NAMESPACES = {"aten", "prims", "_c10d_functional"}
_TRACEABLE_HELPERS = {vocab_embedding, loss_weight_total, bn_local_stats, bn_apply,
                      *(fn for fn, _ in FC.FUNCTIONAL.values())}
_FUNCTIONAL = {fn for fn, _ in FC.FUNCTIONAL.values()}
_WHY = {
    gather_params: "parameter gathers (the ParamGatherer's fused all-gathers with prefetch and reshard-after-forward "
                   "hooks, which keep state across the step)",
    write_back: "write_back (an in-place update copied into a stored parameter or buffer piece)",
}
_WHY_MODULE = {
    "ring_attention": "ring attention: point-to-point exchanges of key/value chunks",
    "ring_blocks": "ring attention: point-to-point exchanges of key/value chunks",
    "moe_dispatch": "MoE dispatch: all-to-all with split sizes read from the routing",
}


class CompiledRegion(nn.Module):
    """A run of the program's nodes (``body``, a printable GraphModule) run through ``torch.compile``.
    ``stats``: what compiling it cost and found. It runs unseen by a selective checkpoint's policy
    (see the module docstring), and never recompiles for another shape (shapes are static)."""

    def __init__(self, body: fx.GraphModule, compiler: RegionCompiler, where: Optional[str]):
        super().__init__()
        self.body, self.where = body, where
        self.stats = CompileStats()
        self.compiler = compiler
        object.__setattr__(self, "_compiled", None)  # a torch.compile wrapper, not a child module

    def forward(self, *args):
        if self._compiled is None:
            object.__setattr__(self, "_compiled", self.compiler.compile(self.body))
        # a checkpoint's recompute hands parameters back as plain tensors: pass plain tensors always, so
        # the recompute runs the graph the forward ran (dynamo guards on the type)
        args = tuple(a.view_as(a) if isinstance(a, nn.Parameter) else a for a in args)
        with outside_selective_checkpoint():
            return self.compiler.call(self._compiled, args, self.stats)

    def extra_repr(self) -> str:
        return f"where={self.where!r}, ops={_op_count(self.body.graph.nodes)}"


def _op_count(nodes) -> int:
    return sum(1 for n in nodes if n.op == "call_function" and n.target is not operator.getitem)


def _is_traceable(node: fx.Node) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace in _NAMESPACES
    return target in _TRACEABLE_HELPERS or target is operator.getitem


def _why_eager(node: fx.Node) -> str:
    target = node.target
    if target in _WHY:
        return _WHY[target]
    module = getattr(target, "__module__", "") or ""
    for part, why in _WHY_MODULE.items():
        if module.endswith(part):
            return f"{target.__name__} ({why})"
    if target in FC.FUNCTIONAL:
        return f"{target.__name__} (its mesh axis has no process group: the program was built offline)"
    if isinstance(target, torch._ops.OpOverload):
        return f"{target} (a custom op: torch.compile would call it as an opaque kernel; kept eager)"
    name = getattr(target, "__name__", str(target))
    return f"{name} (a lowering helper with Python state or data-dependent communication)"


def _slices_an_input(node: fx.Node) -> bool:
    """This rank's chunk of a program input: kept eager, where it is free, so the regions after it are the
    same graph on every rank of the axis (one compile serves them all through the cache)."""
    return (node.op == "call_function" and node.target in (FC.chunk, FC.to_partial)
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder")


def _is_view_only(run: list) -> bool:
    return all(n.target is operator.getitem or (isinstance(n.target, torch._ops.OpOverload) and n.target.is_view)
               for n in run)


def _runs(graph: fx.Graph, eager: Counter, synced: dict, cap: int) -> list:
    """Maximal runs of traceable call_function nodes, in graph order; what stops them is counted in
    ``eager`` by reason (a getitem of an eager node's result, a get_attr and the placeholders and output
    stop nothing). A run also ends before a node whose first use of gradient-synchronized parameters
    (``synced``: placeholder name -> bytes) would take the run's share past ``cap`` bytes."""
    runs, current, traceable = [], [], set()
    seen, size = set(), 0
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr", "output") or _slices_an_input(node):
            continue
        if node.op == "call_function" and _is_traceable(node) and not (
                node.target is operator.getitem and node.args[0] not in traceable):
            new = {a.name for a in node.all_input_nodes if a.op == "placeholder" and a.name in synced} - seen
            grow = sum(synced[name] for name in new)
            if current and size and size + grow > cap:
                runs.append(current)
                current, size = [], 0
            seen |= new
            size += grow
            current.append(node)
            traceable.add(node)
            continue
        if node.op == "call_function" and node.target is operator.getitem:
            continue  # an eager node's tuple, unpacked where it is
        if node.op == "call_module":
            if not isinstance(getattr(graph.owning_module, node.target, None), (CheckpointRegion, fx.GraphModule)):
                eager[f"{node.target} (a submodule)"] += 1
        else:
            eager[_why_eager(node)] += 1
        if current:
            runs.append(current)
            current, size = [], 0
    if current:
        runs.append(current)
    return runs


def _outline(gm: fx.GraphModule, run: list, name: str, compiler: RegionCompiler, where: Optional[str]) -> None:
    """Replace ``run`` in ``gm`` by one call of a ``CompiledRegion`` named ``name``."""
    inside = set(run)
    sub = fx.Graph()
    env: dict = {}
    inputs: list = []

    def arg(n: fx.Node) -> fx.Node:
        if n in inside:
            return env[n]
        if n not in env:
            env[n] = sub.placeholder(n.name)
            env[n].meta = dict(n.meta)
            inputs.append(n)
        return env[n]

    for n in run:
        env[n] = sub.node_copy(n, arg)
    outputs = [n for n in run if any(u not in inside for u in n.users)]
    sub.output(tuple(env[n] for n in outputs))
    body = fx.GraphModule(nn.Module(), sub, class_name="CompiledBody")
    gm.add_submodule(name, CompiledRegion(body, compiler, where))
    with gm.graph.inserting_after(run[-1]):
        call = gm.graph.call_module(name, tuple(inputs))
    last = call
    for i, out in enumerate(outputs):
        with gm.graph.inserting_after(last):
            last = gm.graph.call_function(operator.getitem, (call, i))
        out.replace_all_uses_with(last, delete_user_cb=lambda user: user not in inside)
    for n in reversed(run):
        gm.graph.erase_node(n)


@dataclass
class CompileReport:
    """What ``compile_regions`` made of a program: its ``CompiledRegion``s, the nodes left eager by
    reason, notes on levers, and (through ``compiler``) what compiling cost. ``lines()`` is the part of
    ``plan.summary()`` about it."""
    compiler: RegionCompiler
    regions: list = field(default_factory=list)
    eager: Counter = field(default_factory=Counter)
    notes: list = field(default_factory=list)
    ops_total: int = 0

    @classmethod
    def combined(cls, reports: list) -> "CompileReport":
        """One report over several programs compiled by the same compiler (a rank's pipeline stages)."""
        out = cls(reports[0].compiler)
        for r in reports:
            out.regions += r.regions
            out.eager.update(r.eager)
            out.notes += [n for n in r.notes if n not in out.notes]
            out.ops_total += r.ops_total
        return out

    @property
    def stats(self) -> CompileStats:
        """Every compile so far on this rank, backward graphs included."""
        return self.compiler.totals

    @property
    def graph_breaks(self) -> Counter:
        out = Counter()
        for r in self.regions:
            out.update(r.stats.breaks)
        return out

    def lines(self) -> list[str]:
        opts = self.compiler.options
        ops = sum(_op_count(r.body.graph.nodes) for r in self.regions)
        inside = sum(1 for r in self.regions for n in r.body.graph.nodes if n.target in _FUNCTIONAL)
        head = (f"  compiled (torch.compile, {opts.backend}{', mode ' + opts.mode if opts.mode else ''}): "
                f"{len(self.regions)} region(s), {ops} of {self.ops_total} ops, {inside} collective(s) inside")
        compiled = [r for r in self.regions if r.stats.compiles]
        if not compiled:
            out = [head + "; they compile at the first step"]
        else:
            stats, breaks = self.stats, self.graph_breaks
            out = [head + f"; {len(compiled)} compiled so far, graph breaks {sum(breaks.values())}, "
                          f"{stats.graphs} graph(s); compile {stats.seconds:.1f} s on this rank (FX graph cache "
                          f"{stats.cache_hits} hit / {stats.cache_misses} miss)"
                          + (f", {self.compiler.waited:.1f} s waiting for this host's other ranks to compile"
                             if self.compiler.waited >= 0.05 else "")]
            out += [f"    graph break x{n}: {' '.join(str(reason).split())[:200]}" for reason, n in breaks.most_common(5)]
        out += [f"    eager between regions: {n} x {reason}" for reason, n in sorted(self.eager.items())]
        out += [f"    note: {note}" for note in self.notes]
        return out


def compile_regions(program: fx.GraphModule, compiler: RegionCompiler, synced: Optional[dict] = None,
                    bucket_bytes: int = 25 * 2**20) -> CompileReport:
    """Outline ``program``'s traceable runs into ``CompiledRegion``s (in place, in its top graph and in
    every ``CheckpointRegion``'s body; see the module docstring) and return the report, which is also
    kept as ``program.compile_report``. ``synced``: the parameters whose gradients are all-reduced after
    backward (placeholder name -> bytes): regions are cut so each first uses at most ``bucket_bytes`` of
    them, as torch's DDP cuts compiled graphs at its buckets, so a region's gradients reach their bucket
    while the earlier regions' backward still runs (one region's backward returns all its gradients
    at its end)."""
    report = CompileReport(compiler)
    # the top graph, the partitions outline_regions made of it, and the checkpointed blocks' bodies
    graphs = [(program, None)] + [(m, None) for m in program.children() if isinstance(m, fx.GraphModule)]
    graphs += [(m.body, m.block) for m in program.modules() if isinstance(m, CheckpointRegion)]
    selective = sorted({m.block for m in program.modules() if isinstance(m, CheckpointRegion)
                        and m.policy in ("selective", "selective_op")})
    for gm, where in graphs:
        report.ops_total += sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem)
        for k, run in enumerate(_runs(gm.graph, report.eager, synced or {}, bucket_bytes)):
            if _is_view_only(run):
                continue
            name = f"compiled_region_{k}"
            _outline(gm, run, name, compiler, where)
            report.regions.append(getattr(gm, name))
        gm.graph.lint()
        gm.recompile()
    if selective:
        report.notes.append(f"checkpoint 'selective' ({', '.join(selective)}) recomputes its compiled regions in full: "
                            "the policy that keeps matmul outputs sees eager ops only")
    program.compile_report = report
    return report
