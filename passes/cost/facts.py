"""Facts about a captured program that pricing needs: node kinds, gradients, and each op's work.

``GraphFacts(captured, hardware)`` classifies every node once ("param", "buffer", "input" or "op"),
finds which values carry a gradient, and prices each op on ONE device holding everything; the
cost model (``passes/cost/model.py``) divides that work by how a strategy shards it.

Work: compute-bound ops, those whose ``OpFacts`` (``passes/op_facts.py``, registered with the op's
sharding rule: mm, addmm, bmm, baddbmm, matmul, linear, einsum, scaled-dot-product attention,
convolution, MoE experts, and any op a user registers so) count FLOPs, cost FLOPs / peak FLOP/s for
their dtype, with backward = forward per differentiable matrix operand (2x when both need a
gradient); a GEMM named by its ``gemm_operands`` is priced at the achieved efficiency of its shape;
no op is recognised by its name. Every other op is memory-bound,
(bytes read + written) / memory bandwidth, with backward = 1x forward; on hardware with the
achievable-throughput model, by the bytes its kernels move and its kernel class's rate
(``passes/cost/kernel_classes.py``); views (and ``to`` casts to the dtype a tensor already has)
cost nothing.

Launch overhead: every op dispatch costs ``hardware.op_overhead_s`` on every rank, NOT divided by
sharding (a launch costs the same for a shard): each op (views included, ``getitem`` excluded) once
forward and once per backward op (a matmul with two operand gradients runs two), and each parameter
once (autograd accumulating its gradient). ``launches(name)`` counts them; the cost model adds the
launches of collectives and gradient buckets.

>>> import operator, torch
>>> op_name(torch.ops.aten.linear.default), op_name(operator.getitem)
('linear', 'getitem')
"""
from __future__ import annotations

import math
from typing import Optional

import torch.fx as fx

from autoshard.passes.capture.saved import SavedInfo, saved_info
from autoshard.passes.cost.hardware import Hardware
from autoshard.passes.cost.kernel_classes import class_seconds, memory_bound_price
from autoshard.passes.cost.kernels import achievable, gemm_efficiency
from autoshard.passes.graph import operand_meta, operands, outputs
from autoshard.passes.op_facts import OpFacts, op_facts
from autoshard.passes.schema import bind_args
from autoshard.passes.sharding.rules import op_call  # importing the rules registers every op's facts
from autoshard.passes.spec import TensorMeta

__all__ = ["GraphFacts", "op_name", "matmul_flops", "gemm_dims", "local_gemm_dims"]

_VIEWS = {"view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "permute", "expand",
          "expand_as", "squeeze", "unsqueeze", "slice", "select", "split", "split_with_sizes", "unbind",
          "chunk", "narrow", "alias", "detach", "as_strided", "view_as", "flatten", "unflatten",
          "diagonal", "movedim", "getitem", "lift_fresh", "view_as_real", "view_as_complex",
          "_assert_tensor_metadata", "sym_size", "sym_numel"}
_NO_GRAD = {"detach", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like", "randn_like",
            "argmax", "argmin", "arange", "zeros", "ones", "empty", "full", "scalar_tensor",
            "_assert_tensor_metadata", "lift_fresh_copy"}
_FREE_CALLS = {"getitem", "sym_size", "sym_numel", "_assert_tensor_metadata"}  # no ATen dispatch


def op_name(target) -> str:
    """``aten.linear.default`` -> ``linear``; ``operator.getitem`` -> ``getitem``."""
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def _floating(meta) -> bool:
    """Whether a value can carry a gradient: floating or complex (a complex RoPE product does)."""
    return isinstance(meta, TensorMeta) and (meta.dtype.is_floating_point or meta.dtype.is_complex)



def _identity_dropout(node: fx.Node, name: str) -> bool:
    """``dropout(x, p=0)`` (or not training) returns ``x`` itself: ATen's ``dropout`` takes the fused
    kernel only for ``0 < p < 1`` and otherwise ``_dropout_impl`` returns its input when ``p == 0 or
    not train`` (aten/src/ATen/native/Dropout.cpp), so it owns no storage and autograd records no node."""
    if name != "dropout" or len(node.args) < 3:
        return False
    p, train = node.args[1], node.args[2]
    return isinstance(p, (int, float)) and isinstance(train, bool) and (p == 0 or not train)


class GraphFacts:
    """Per-node facts the cost model needs: kinds, which values need a gradient, global op cost.

    ``kind[name]``: "param", "buffer", "input" (user inputs, the target, other placeholders) or "op".
    ``training``: the program returns a loss (a training step), or is a pipeline stage before the one
    that does (``CapturedGraph.training``); otherwise it is forward-only and
    nothing carries a gradient. ``requires_grad``: when training, parameters and every floating output
    computed from one (except ops that cut the graph: detach, *_like constructors, ...). ``compute(name)``: (forward seconds, backward
    seconds) of the op on one device holding everything.
    ``saved``: what autograd keeps per node (``passes.capture.saved``), None when the program could
    not run on the meta device.
    """

    def __init__(self, captured, hardware: Hardware):
        gm = captured.gm
        self.hardware = hardware
        self.nodes: dict[str, fx.Node] = {n.name: n for n in gm.graph.nodes}
        self.kind: dict[str, str] = {}
        #: a training step (the program returns a loss) or forward-only inference (no gradients at all)
        self.training = captured.training
        self.requires_grad: set[str] = set(captured.params) if self.training else set()
        self.views: set[str] = set()
        self._compute: dict[str, tuple[float, float]] = {}
        self._launches: dict[str, int] = {}
        self._param_bytes: Optional[float] = None
        #: (batch, M, N, K, itemsize, output rank, efficiency priced at) of each GEMM priced at its
        #: achieved efficiency (``compute`` holds the whole op at that efficiency)
        self.gemm_dims: dict[str, tuple] = {}
        #: memory-bound op -> its kernel class (``kernel_classes.py``), on hardware with the achievable model
        self.kernel_classes: dict[str, str] = {}
        self.saved: Optional[dict[str, SavedInfo]] = saved_info(captured)
        self.master_dtypes = dict(getattr(captured, "master_dtypes", {}) or {})
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                self.kind[node.name] = ("param" if node.name in captured.params else
                                        "buffer" if node.name in captured.buffers else "input")
                if self.kind[node.name] == "param" and self.training:
                    self._launches[node.name] = 1  # autograd's AccumulateGrad into .grad
                continue
            if node.op != "call_function":
                continue
            self.kind[node.name] = "op"
            name = op_name(node.target)
            if name in _VIEWS or (name == "to" and self._same_as_operand(node)) or _identity_dropout(node, name):
                self.views.add(node.name)  # ``x.to(x.dtype)`` returns x itself
            ins = [a for a in node.all_input_nodes if a.name in self.requires_grad]
            metas = outputs(node)
            if ins and name not in _NO_GRAD and any(_floating(m) for m in metas):
                self.requires_grad.add(node.name)
            self._compute[node.name] = self._op_seconds(node, name)

    @staticmethod
    def _same_as_operand(node: fx.Node) -> bool:
        ops = operands(node)
        return len(ops) == 1 and outputs(node) == [operand_meta(ops[0])]

    def _op_seconds(self, node: fx.Node, name: str) -> tuple[float, float]:
        if node.name in self.views:
            if name not in _FREE_CALLS:  # a view is free on the device but still one dispatch
                self._launches[node.name] = 1 + (1 if node.name in self.requires_grad else 0)
            return 0.0, 0.0
        ops = operands(node)
        in_metas = [operand_meta(o) for o in ops]
        out_metas = [m for m in outputs(node) if m is not None]
        grad_out = node.name in self.requires_grad
        facts = op_facts(node.target)
        flops = _flops(node, facts, out_metas)
        if flops is not None:
            fwd = flops / self.hardware.peak_flops(out_metas[0].dtype)
            if facts.backward_gemms is not None:  # a fixed backward (MoE: input and weight gradients)
                self._launches[node.name] = 1 + (facts.backward_gemms if grad_out else 0)
                return fwd, (facts.backward_gemms * fwd if grad_out else 0.0)
            calibrated = achievable(self.hardware)
            if facts.attention:
                factor = 2.0 if grad_out else 0.0
                self._launches[node.name] = 1 + (1 if grad_out else 0)
                if calibrated:  # fused attention: causal work halved, backward recomputes the scores
                    b = bind_args(node.target, node.args, node.kwargs)
                    causal = bool(b.get("is_causal")) and b.get("attn_mask") is None
                    fwd = fwd * (0.5 if causal else 1.0) / self.hardware.attention_efficiency
                    factor = self.hardware.attention_backward_factor if grad_out else 0.0
            else:
                main = [ops[i] for i in facts.grad_operands if i < len(ops)]
                factor = float(sum(1 for o in main if o.node.name in self.requires_grad))
                bias = ops[facts.bias_operand] if facts.bias_operand is not None and facts.bias_operand < len(ops) \
                    else None
                bias_grad = bias is not None and bias.node.name in self.requires_grad  # a sum reduces its gradient
                self._launches[node.name] = 1 + int(factor) + int(bias_grad)
                dims = gemm_dims(facts, in_metas, out_metas[0])
                if calibrated and dims is not None:  # achieved, not peak: tiles, waves, roofline
                    eff = gemm_efficiency(self.hardware, *dims[:5])
                    self.gemm_dims[node.name] = (*dims, eff)
                    fwd = fwd / eff
            return fwd, fwd * factor
        self._launches[node.name] = 1 + (1 if grad_out else 0)
        if achievable(self.hardware):  # per kernel class, the bytes its kernels move (kernel_classes.py)
            cls, fwd_bytes, bwd_bytes = memory_bound_price(node, name, in_metas, out_metas)
            self.kernel_classes[node.name] = cls
            return (class_seconds(self.hardware, cls, fwd_bytes),
                    class_seconds(self.hardware, cls, bwd_bytes) if grad_out else 0.0)
        moved = sum(m.nbytes for m in in_metas) + sum(m.nbytes for m in out_metas)
        fwd = moved / self.hardware.memory_bandwidth
        return fwd, (fwd if grad_out else 0.0)

    def compute(self, name: str) -> tuple[float, float]:
        """(forward, backward) seconds of the op's work on one device, launch overhead excluded."""
        return self._compute.get(name, (0.0, 0.0))

    def launches(self, name: str) -> int:
        """Op dispatches the node costs per step: 1 forward + 1 per backward op (0 for getitem)."""
        return self._launches.get(name, 0)

    def overhead(self, name: str) -> float:
        """Launch overhead of the op on every rank: ``launches(name) * op_overhead_s``."""
        return self._launches.get(name, 0) * self.hardware.op_overhead_s

    @property
    def param_bytes(self) -> float:
        """Bytes of all parameters (each tied tensor once)."""
        if self._param_bytes is None:
            self._param_bytes = float(sum(m.nbytes for n, k in self.kind.items() if k == "param"
                                          for m in self.tensor_outputs(n)))
        return self._param_bytes

    def master_dtype(self, name: str):
        """The dtype parameter ``name`` is kept in when the graph computes with a cast copy, else None."""
        return self.master_dtypes.get(name)

    def saved_of(self, name: str) -> Optional[SavedInfo]:
        """What autograd keeps of node ``name`` (None without the saved-tensor analysis)."""
        return None if self.saved is None else self.saved.get(name)

    def operand_saved(self, consumer: str, index: int) -> bool:
        """Does ``consumer`` keep its operand ``index`` for backward? (True without the analysis,
        and for the program's outputs: every redistributed copy counts, as before it existed.)"""
        info = self.saved_of(consumer)
        return info is None or index in info.saved_operands

    def internal_bytes(self, name: str) -> float:
        """Bytes of the tensors node ``name`` creates inside itself and keeps for backward."""
        info = self.saved_of(name)
        return float(info.internal_bytes) if info is not None else 0.0

    def selective_bytes(self, name: str) -> float:
        """Bytes of the matmul / attention kernel outputs of node ``name`` (kept under selective
        checkpointing)."""
        info = self.saved_of(name)
        return float(info.selective_bytes) if info is not None else 0.0

    def tensor_outputs(self, name: str) -> list[TensorMeta]:
        return [m for m in outputs(self.nodes[name]) if m is not None]

    def value_needs_grad(self, producer: str, slot: int) -> bool:
        """Does output ``slot`` (among tensor outputs) of ``producer`` carry a gradient?"""
        if producer not in self.requires_grad:
            return False
        metas = self.tensor_outputs(producer)
        return slot < len(metas) and _floating(metas[slot])


def gemm_dims(facts: OpFacts, ins: list, out) -> Optional[tuple]:
    """(batch, M, N, K, itemsize, output rank) of a GEMM op (one whose ``facts.gemm_operands`` name its
    A and B), leading dims folded into M, or into batch for a batched B; None otherwise."""
    if facts.gemm_operands is None or not out.shape:
        return None
    a, b = (ins[i] for i in facts.gemm_operands)
    if not a.shape or not b.shape:
        return None
    r = len(out.shape)
    n, k = out.shape[-1], a.shape[-1]
    if len(b.shape) > 2 and r >= 3:
        batch, m = math.prod(out.shape[:-2]), out.shape[-2]
    else:
        batch, m = 1, math.prod(out.shape[:-1])
    return int(batch), int(m), int(n), int(k), out.dtype.itemsize, r


def local_gemm_dims(dims: tuple, out_codes, shape) -> tuple:
    """``dims`` (``gemm_dims``) as one rank computes them under a strategy whose output has placement
    codes ``out_codes`` (``encode``: S(d) is d, R -1, P -2) on a mesh of ``shape``: an output
    split on its last dim splits N, on the row dim M (or batch), a partial output splits K."""
    batch, m, n, k, itemsize, r = dims[:6]
    for a, c in enumerate(out_codes):
        size = shape[a]
        if size == 1:
            continue
        if c == r - 1:
            n = -(-n // size)
        elif c == -2:
            k = -(-k // size)
        elif c >= 0 and batch > 1 and c < r - 2:
            batch = -(-batch // size)
        elif c >= 0:
            m = -(-m // size)
    return batch, m, n, k, itemsize


def matmul_flops(node: fx.Node) -> Optional[float]:
    """Forward FLOPs (2 per multiply-add) of a compute-bound call_function node, as the cost model counts
    them (``GraphFacts``); None for every other op."""
    if node.op != "call_function":
        return None
    return _flops(node, op_facts(node.target), [m for m in outputs(node) if m is not None])


def _flops(node: fx.Node, facts: OpFacts, outs: list) -> Optional[float]:
    """The op's registered FLOP count (``OpFacts.flops``), None for a memory-bound op or an output-less call."""
    if facts.flops is None or not outs:
        return None
    return facts.flops(op_call(node))
