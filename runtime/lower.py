"""Lower a planned graph into one rank's own fx program.

``lower(captured, strategies, env)`` walks the captured graph once and emits, for this rank:

- the same placeholders (params and buffers receive the LOCAL shards in their storage placement;
  user inputs and the target receive the full global batch and are chunked to their entry
  placement, which costs nothing);
- before each op, for each operand whose producer's placement differs from what the op's strategy
  needs, the redistribution steps (``redistribute.plan_redistribute``) as explicit calls such as
  ``all_gather(linear, 0, comm_tp)``; steps that are all-gathers of one dim over several axes
  (``passes.layout.gathers.fused_gather``) run as ONE all-gather over those axes flattened, as the
  cost model prices them; a redistributed value is reused by every consumer needing it;
- for parameters, instead: one ``param_gather.gather_params`` call per group of parameter copies
  (every parameter whose redistribution from its storage communicates, or that mixed precision
  casts, grouped by the block segment of its first use), run by the program's ``param_gatherer`` (fused flat collectives,
  prefetch, reshard after forward per the levers' block policies);
- the op itself on local pieces, size arguments made local and devices made the rank's
  (``localize``), or its named lowering (``lowerings``);
- for ops writing an operand in place: the op writes a private copy when the operand was
  redistributed or is a collective's result (autograd forbids writing into those); afterwards a
  parameter or buffer gets the update written back into its stored piece (batch-norm running
  stats), and any other value is simply read from the updated copy by every later op (so the
  update keeps its gradient: Mixtral's ``weights /= weights.sum()``);
- the output: a scalar loss turned ``P`` on every axis (its local values sum to the loss, so
  backward from it with seed 1 follows the gradient convention), anything else gathered to ``R``
  unless ``departures`` places it otherwise.

Collective calls carry ``node.meta["autoshard.collective"]`` (their kind), parameter gathers
``node.meta["autoshard.param_steps"]`` (the kinds of their members' steps; a fused member counts as
one all-gather), so they can be counted.
Every emitted node carries ``node.meta[regions.BLOCK]``: the block instance of the captured op it
was emitted for (None outside numbered blocks), which ``regions`` cuts checkpoint regions by.
"""
from __future__ import annotations

import operator
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx
import torch.nn as nn

from autoshard.passes.errors import BatchError, PlanFormatError
from autoshard.passes.graph import META, MODULE, CapturedGraph, exact_placeholder, is_getitem, operands
from autoshard.passes.layout.gathers import SegmentKeys, fused_gather, segment_op
from autoshard.passes.layout.redistribution import COMMUNICATING, plan_redistribute
from autoshard.passes.layout.shapes import local_shape, normalize
from autoshard.passes.levers import Levers
from autoshard.passes.sharding.storage_forms import holds_copies
from autoshard.passes.solve.clustering import block_instance, module_path
from autoshard.passes.spec import Partial, Replicate, Strategy, TensorMeta

from . import collectives as C
from .groups import MeshEnv
from .localize import local_size_args, rewrite_devices, written_operands
from .lowerings import emit_lowering
from .param_gather import CopyRecipe, GatherGroup, ParamGatherer, gather_params
from .redistribute import step_call
from .regions import BLOCK

__all__ = ["lower", "write_back", "COLLECTIVE_META", "PARAM_STEPS_META", "MOVE_META", "block_of"]

COLLECTIVE_META = "autoshard.collective"
PARAM_STEPS_META = "autoshard.param_steps"
MOVE_META = "autoshard.redistribution"  # a step of a redistribution (not an op lowering's own collective)
# Checks export inserts (capture drops them too): shapes are global there, local here.
_SKIP = {torch.ops.aten._assert_tensor_metadata.default}


def write_back(stored: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Copy an in-place update made on a redistributed copy back into the stored piece."""
    if value is not stored:
        with torch.no_grad():
            if value.untyped_storage().data_ptr() == stored.untyped_storage().data_ptr():
                value = value.clone()
            stored.copy_(value)
    return stored


def block_of(node: fx.Node, captured: CapturedGraph) -> Optional[str]:
    """The block instance ("blocks.3") a captured node belongs to, or None outside numbered blocks."""
    found = block_instance(module_path(node, captured)) if node.op == "call_function" else None
    return found[1] if found else None


class _Lowering:
    """State of one lowering pass (also the ``ctx`` the lowering emitters receive)."""

    def __init__(self, captured: CapturedGraph, strategies: dict[str, Strategy], env: MeshEnv,
                 levers: Optional[Levers], arrivals: Optional[dict] = None,
                 departures: Optional[dict] = None):
        self.captured, self.strategies, self.env = captured, strategies, env
        self.levers = levers if levers is not None else Levers()
        self.arrivals = arrivals or {}
        self.departures = departures or {}
        self.mesh = env.mesh
        self.graph = fx.Graph()
        self.root = nn.Module()
        self.value: dict[fx.Node, Any] = {}
        self.placement: dict[tuple, tuple] = {}
        self.cache: dict[tuple, fx.Node] = {}
        self.comm_nodes: dict[tuple, fx.Node] = {}
        self.groups: list[GatherGroup] = []
        self.group_keys: list[list[tuple]] = []
        self.group_of: dict[tuple, int] = {}
        self.gatherer_node: Optional[fx.Node] = None
        self.collective_results: set[fx.Node] = set()

    # ---- helpers the emitters use ----------------------------------------------------------
    def comm(self, axes) -> fx.Node:
        key = tuple(sorted(axes))
        if key not in self.comm_nodes:
            comm = self.env.comm_for(key)
            attr = f"comm_{comm.name}"
            setattr(self.root, attr, comm)
            self.comm_nodes[key] = self.graph.get_attr(attr)
        return self.comm_nodes[key]

    def collective(self, fn, args: tuple, axes) -> fx.Node:
        node = self.graph.call_function(fn, tuple(args) + (self.comm(axes),))
        node.meta[COLLECTIVE_META] = fn.__name__
        self.collective_results.add(node)
        return node

    def move(self, value: fx.Node, src, dst, ndim: int) -> fx.Node:
        steps = plan_redistribute(src, dst, self.mesh.shape, ndim)
        flat = fused_gather(steps)
        if flat is not None and len(flat[0]) > 1:  # all-gathers of one dim: ONE over the axes flattened
            value = self.collective(C.all_gather, (value, flat[1]), flat[0])
            value.meta[MOVE_META] = True
            return value
        for step in steps:
            fn, static = step_call(step)
            value = self.collective(fn, (value,) + static, (step.axis,))
            value.meta[MOVE_META] = True
        return value

    def fetch(self, producer: fx.Node, dst, ndim: int) -> fx.Node:
        dst = normalize(dst, self.mesh.shape)
        key = (producer, dst)
        if key not in self.cache:
            if key in self.group_of:
                self.emit_group(self.group_of[key])
            else:
                self.cache[key] = self.move(self.value[producer], self.placement[(producer, None)], dst, ndim)
        return self.cache[key]

    # ---- parameter copies ------------------------------------------------------------------
    def plan_copies(self) -> None:
        """Group every (parameter, placement an op needs) that needs a copy by the block segment of
        its first use: a block instance, or the ops after the n-th distinct block instance."""
        mp = self.levers.mixed_precision
        cast = mp is not None and mp.param_dtype is not None
        keys = SegmentKeys()
        segments: dict[object, int] = {}
        for node in self.captured.gm.graph.nodes:
            if not segment_op(node) or node.name not in self.strategies:
                continue
            block = block_of(node, self.captured)
            segment = keys.key(block)
            st = self.strategies[node.name]
            for i, op in enumerate(operands(node)):
                ph = op.node
                if ph.name not in self.captured.params or i >= len(st.inputs):
                    continue
                meta = ph.meta[META]
                dst = normalize(st.inputs[i], self.mesh.shape)
                key = (ph, dst)
                if key in self.group_of:
                    continue
                storage = normalize(self.strategies[ph.name].outputs[0], self.mesh.shape)
                steps = tuple(plan_redistribute(storage, dst, self.mesh.shape, len(meta.shape)))
                if not any(s.kind in COMMUNICATING for s in steps) and not (cast and meta.dtype.is_floating_point):
                    continue  # local steps only (a chunk, R -> P): plain calls, as for activations
                if segment not in segments:
                    segments[segment] = len(self.groups)
                    policy = self.levers.policy(block)
                    self.groups.append(GatherGroup(len(self.groups), block, [], policy.reshard_after_forward,
                                                   policy.reshard_after_forward or policy.checkpoint != "none"))
                    self.group_keys.append([])
                g = segments[segment]
                self.groups[g].members.append(CopyRecipe(ph.name, steps, meta.dtype,
                                                         holds_copies(self.strategies[ph.name])))
                self.group_keys[g].append(key)
                self.group_of[key] = g
        if self.groups:
            mp_reduce = None if mp is None else (mp.reduce_dtype or mp.param_dtype)
            self.root.param_gatherer = ParamGatherer(self.groups, self.env.comm_for, mp_reduce)
            self.gatherer_node = self.graph.get_attr("param_gatherer")

    def emit_group(self, index: int) -> None:
        group = self.groups[index]
        own = [self.value[self.captured.node(r.placeholder)] for r in group.members]
        following = []
        if index + 1 < len(self.groups):
            following = [self.value[self.captured.node(r.placeholder)] for r in self.groups[index + 1].members]
        call = self.graph.call_function(gather_params, (self.gatherer_node, index, tuple(following), *own))
        # a fused member is one all-gather over its axes flattened (what the plan prices per member)
        call.meta[PARAM_STEPS_META] = [k for r in group.members
                                       for k in (["all_gather"] if r.fused_gather() else [s.kind for s in r.steps])]
        for k, key in enumerate(self.group_keys[index]):
            self.cache[key] = self.graph.call_function(operator.getitem, (call, k))

    # ---- the pass --------------------------------------------------------------------------
    def strategy(self, node: fx.Node) -> Strategy:
        st = self.strategies.get(node.name)
        if st is None:
            raise PlanFormatError(f"the plan has no strategy for node {node.name!r} ({node.op} {node.target}); "
                                  "plan this graph again (the plan must cover every placeholder and op)")
        for pls in tuple(st.inputs) + tuple(st.outputs):
            if len(pls) != self.mesh.ndim:
                raise PlanFormatError(f"strategy {st} of node {node.name!r} has placements for {len(pls)} axes; "
                                      f"the mesh {self.mesh.shape} has {self.mesh.ndim}")
        return st

    def run(self) -> fx.GraphModule:
        for node in self.captured.gm.graph.nodes:
            if node.op == "placeholder":
                self.placeholder(node)
                if node.next.op != "placeholder":
                    self.plan_copies()
            elif node.op == "call_function":
                self.call(node)
            elif node.op == "get_attr":
                self.constant(node)
            elif node.op == "output":
                self.output(node)
            else:
                raise PlanFormatError(f"cannot lower node {node.name!r} of kind {node.op}: capture emits only "
                                      "placeholders, call_function nodes and the output")
            self.tag(block_of(node, self.captured))
        self.graph.lint()
        return fx.GraphModule(self.root, self.graph, class_name=f"Rank{self.env.rank}Program")

    def tag(self, block: Optional[str]) -> None:
        """Mark the nodes emitted since the last call as belonging to ``block``."""
        for new in reversed(self.graph.nodes):
            if BLOCK in new.meta:
                break
            new.meta[BLOCK] = block

    def placeholder(self, node: fx.Node) -> None:
        new = exact_placeholder(self.graph, node.name)
        self.value[node] = new
        meta = node.meta.get(META)
        if not isinstance(meta, TensorMeta):
            return
        st = self.strategy(node)
        if len(st.outputs) != 1:
            raise PlanFormatError(f"placeholder {node.name!r} needs one output placement, got {st}")
        dst = normalize(st.outputs[0], self.mesh.shape)
        if node.name in self.captured.params or node.name in self.captured.buffers:
            self.placement[(node, None)] = dst
            return
        local_shape(meta.shape, dst, self.mesh.shape, error=BatchError, what=f"input {node.name!r}")
        if node.name in self.arrivals:  # a slice: every reader takes it from how it arrives
            self.placement[(node, None)] = normalize(self.arrivals[node.name], self.mesh.shape)
            return
        full = normalize((Replicate(),) * self.mesh.ndim, self.mesh.shape)
        self.value[node] = self.move(new, full, dst, len(meta.shape))
        self.placement[(node, None)] = dst

    def constant(self, node: fx.Node) -> None:
        """A tensor constant of the captured program: every rank holds all of it (R)."""
        owner, _, leaf = node.target.rpartition(".")
        value = getattr(self.captured.gm.get_submodule(owner), leaf)
        if isinstance(value, torch.Tensor):
            if value.is_meta:
                raise PlanFormatError(f"graph constant {node.target!r} was traced on the meta device and has no "
                                      "values; create it from a parameter or buffer, or capture a model on a real "
                                      "device")
            value = value.to(self.env.device)
        attr = "const_" + node.target.replace(".", "_")
        setattr(self.root, attr, value)
        self.value[node] = self.graph.get_attr(attr)
        if isinstance(node.meta.get(META), TensorMeta):
            self.placement[(node, None)] = normalize((Replicate(),) * self.mesh.ndim, self.mesh.shape)

    def substitute(self, node: fx.Node, local: Iterator[fx.Node]) -> tuple[tuple, dict]:
        """The node's args with each tensor operand replaced by its local value."""
        def sub(a):
            if isinstance(a, fx.Node):
                return next(local) if isinstance(a.meta.get(META), TensorMeta) else self.value[a]
            if isinstance(a, (list, tuple)):
                return type(a)(sub(x) for x in a)
            if isinstance(a, dict):
                return {k: sub(v) for k, v in a.items()}
            return a

        return tuple(sub(a) for a in node.args), {k: sub(v) for k, v in node.kwargs.items()}

    def call(self, node: fx.Node) -> None:
        if node.target in _SKIP:
            self.value[node] = None
            return
        metas = node.meta.get(META)
        ops = operands(node)
        if not ops and not isinstance(metas, (TensorMeta, tuple)) and node.name not in self.strategies:
            args, kwargs = self.substitute(node, iter(()))
            self.value[node] = self.graph.call_function(node.target, args, kwargs)
            return
        st = self.strategy(node)
        if len(st.inputs) != len(ops):
            raise PlanFormatError(f"strategy {st} of node {node.name!r} has {len(st.inputs)} operand placements; "
                                  f"the op reads {len(ops)} tensors")
        if is_getitem(node):
            return self.getitem(node, st)
        local = [self.fetch(op.node, st.inputs[i], len(op.node.meta[META].shape)) for i, op in enumerate(ops)]
        written = written_operands(node)
        for i in written:  # the op writes a private copy; write_backs publishes it after the op
            if local[i] is not self.value[ops[i].node] or local[i] in self.collective_results:
                local[i] = self.graph.call_function(torch.ops.aten.clone.default, (local[i],))
        args, kwargs = self.substitute(node, iter(local))
        args, kwargs = rewrite_devices(args, kwargs, self.env.device)
        outs = [normalize(p, self.mesh.shape) for p in st.outputs]
        if any(st.lowerings):
            new = emit_lowering(self, node, args, kwargs, st)
        elif not ops:
            new = self.graph.create_node("call_function", node.target, args, kwargs, name=node.name)
            if isinstance(metas, TensorMeta):  # a factory makes the global tensor; keep this rank's piece
                full = normalize((Replicate(),) * self.mesh.ndim, self.mesh.shape)
                new = self.move(new, full, outs[0], len(metas.shape))
        else:
            if isinstance(metas, TensorMeta) and outs:
                shape = local_shape(metas.shape, outs[0], self.mesh.shape, what=f"output of {node.name!r}")
                args, kwargs = local_size_args(node.target, args, kwargs, shape)
            new = self.graph.create_node("call_function", node.target, args, kwargs, name=node.name)
        if MODULE in node.meta:
            new.meta[MODULE] = node.meta[MODULE]
        self.value[node] = new
        self.write_backs(written, ops, local, st)
        self.record_outputs(node, metas, outs)

    def getitem(self, node: fx.Node, st: Strategy) -> None:
        src, idx = node.args
        raw = self.graph.call_function(operator.getitem, (self.value[src], idx))
        meta = node.meta.get(META)
        if isinstance(meta, TensorMeta):
            need = normalize(st.inputs[0], self.mesh.shape)
            raw = self.move(raw, self.placement[(src, idx)], need, len(meta.shape))
            raw = self.move(raw, need, normalize(st.outputs[0], self.mesh.shape), len(meta.shape))
            self.placement[(node, None)] = normalize(st.outputs[0], self.mesh.shape)
        self.value[node] = raw

    def record_outputs(self, node: fx.Node, metas, outs: list) -> None:
        if isinstance(metas, TensorMeta):
            if len(outs) != 1:
                raise PlanFormatError(f"strategy of node {node.name!r} has {len(outs)} outputs; the op makes 1 tensor")
            self.placement[(node, None)] = outs[0]
        elif isinstance(metas, tuple):
            positions = [i for i, m in enumerate(metas) if m is not None]
            if len(outs) != len(positions):
                raise PlanFormatError(f"strategy of node {node.name!r} has {len(outs)} outputs; the op makes "
                                      f"{len(positions)} tensors")
            for pos, raw in enumerate(positions):
                self.placement[(node, raw)] = outs[pos]

    def write_backs(self, written: list[int], ops, local: list, st: Strategy) -> None:
        state = set(self.captured.params) | set(self.captured.buffers)
        for i in written:
            producer = ops[i].node
            if local[i] is not self.value[producer]:
                stored = self.placement[(producer, None)]
                back = self.move(local[i], normalize(st.inputs[i], self.mesh.shape), stored,
                                 len(producer.meta[META].shape))
                if producer.name in state:  # the module's own storage must hold the update
                    self.graph.call_function(write_back, (self.value[producer], back))
                else:
                    self.value[producer] = back
            for key in [k for k in self.cache if k[0] is producer]:
                del self.cache[key]

    def output(self, node: fx.Node) -> None:
        n = self.mesh.ndim
        if self.captured.loss_output:
            dst = (Partial(),) * n
        else:
            dst = (Replicate(),) * n

        def out(a):
            if isinstance(a.meta.get(META), TensorMeta):
                return self.fetch(a, self.departures.get(a.name, dst), len(a.meta[META].shape))
            return self.value[a]

        self.graph.output(fx.node.map_arg(node.args[0], out))


def lower(captured: CapturedGraph, strategies: dict[str, Strategy], env: MeshEnv,
          levers: Optional[Levers] = None, arrivals: Optional[dict] = None,
          departures: Optional[dict] = None) -> fx.GraphModule:
    """This rank's program: ``program(*local_params, *local_buffers, *full_inputs[, full_target])``.

    ``arrivals`` (input name -> placements) says how an input arrives when it is not full: a rank
    passing only its slice of the batch (``local_batch``) hands in ``S(0)`` on the data-parallel axes,
    and each reader of the input redistributes from there (a free chunk where it reads a finer slice).
    ``departures`` (output node name -> placements) says how an output leaves when it is not full: a
    pipeline stage sends each value at its planned placement (``pipeline.boundaries``).

    Returns the loss as ``P`` on every mesh axis when ``captured.loss_output`` (sum the local values
    over all ranks for the loss), else the full outputs. ``levers`` (default: none pulled) decide
    which parameter groups reshard after forward and the compute dtype of parameter copies (mixed
    precision: the captured parameters' dtype; the program then receives the master weights).
    Raises ``PlanFormatError`` when the plan does not cover the graph and ``BatchError`` when an
    input does not divide over the axes sharding it.
    """
    return _Lowering(captured, strategies, env, levers, arrivals, departures).run()

