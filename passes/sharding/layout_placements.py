"""A hand-written layout (Megatron-LM's or torchtitan's) as pins over a captured program.

``layout_pins(captured, mesh, axes, sequence_parallel=...)`` returns the ``params`` / ``inputs`` /
``ops`` pins (``passes.sharding.pins.Pins`` keywords) that fix every parameter's placement, every
batch input's, and, with sequence parallelism, the normalisation outputs', so the solver has nothing
left to choose but how activations flow between those fixed points.

Tensor parallelism is found from the graph, not from module names. Every matmul with a parameter
operand (``aten.linear``, ``mm``/``matmul``/``addmm`` against a parameter or its transpose, as in
``x @ w.t()``) is a *weight matmul*;
walking the program in order, each weight matmul looks at the weight matmuls its data input derives
from (through any ops that are not weight matmuls: norms, residual adds, attention, activations):

- none, or only row-parallel ones -> **column-parallel** (output features split over tp: Megatron's
  q/k/v, fc/gate/up, and the LM head, whose output features are the vocabulary);
- only column-parallel ones -> **row-parallel** (input features split; its output is a partial sum:
  Megatron's attention output and MLP down projections);
- both -> left replicated over tp (a layer Megatron's pairing does not describe).

A 1-D parameter applied to a column-parallel
matmul's output features by a separate op (a bias added by its own kernel, or a fused bias-activation)
is split with them. An ``aten.embedding`` whose indices come from a user input (or the target) is vocab-parallel (weight rows split over
tp); one indexed by computed positions (``arange``) stays replicated, as Megatron keeps its learned
position embedding. Every other parameter (norm weights, biases of row-parallel layers) is
replicated over tp. Over the data-parallel axes a parameter is replicated (``axes.replicate``: DDP,
HSDP replicas) or sharded on its first dim that divides, other than tp's (``axes.shard``: FSDP /
ZeRO; ``_shard_dim`` says why); over the
context-parallel axis it is replicated.

``LayoutError`` names what makes a layout impossible for this model: tp not dividing the attention
heads (query or key/value), a tensor-parallel weight's features, or (with sequence parallelism) the
sequence. A weight dim smaller than tp (a one-output gate) is left replicated (``tensor_parallel_dim``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from autoshard.passes.capture.moe_experts import is_moe_node
from autoshard.passes.errors import AutoshardError, LayoutError  # LayoutError re-exported: the layouts' error type
from autoshard.passes.graph import META, MODULE, CapturedGraph
from autoshard.passes.mesh import Mesh
from autoshard.passes.sharding.storage_forms import zero_dim
from autoshard.passes.spec import parse_placement
from autoshard.passes.sharding.expert_layout import ExpertAxes, expert_axes_like_attention, expert_layout_pins, router_matmuls

__all__ = ["LayoutError", "LayoutAxes", "TensorParallelRoles", "tensor_parallel_roles", "layout_pins",
           "check_tensor_parallel", "tensor_parallel_dim"]

aten = torch.ops.aten



@dataclass(frozen=True)
class LayoutAxes:
    """What each axis of the planning mesh carries. ``replicate``: data-parallel axes over which
    parameters are replicated; ``shard``: data-parallel axes over which parameters, gradients and
    optimizer state are sharded; ``cp``: the context-parallel axis (sequence split, ring attention);
    ``tp``: the tensor-parallel axis. Every mesh axis is in exactly one of them. ``experts``: what each
    axis carries for the experts of MoE layers (``passes.sharding.expert_layout``: Megatron-Core's
    parallel folding), None for a layout without expert roles (experts then follow tp and dp as
    ``ExpertAxes(etp=tp, ...)`` would say). ``zero1``: over the ``replicate`` axes the optimizer state
    is sharded (Megatron's distributed optimizer: parameters ``R/zero1``, ``passes.sharding.storage_forms``;
    a parameter with no dim those axes divide stays plain ``R``)."""
    replicate: tuple[int, ...] = ()
    shard: tuple[int, ...] = ()
    cp: Optional[int] = None
    tp: Optional[int] = None
    experts: Optional["ExpertAxes"] = None  # the MoE layers' axes (``expert_layout``); None: as the attention's
    zero1: bool = False

    @property
    def data(self) -> tuple[int, ...]:
        """The axes that split the batch."""
        return tuple(sorted(self.replicate + self.shard))


@dataclass(frozen=True)
class TensorParallelRoles:
    """Per parameter placeholder, the dim Megatron splits over tp (absent: replicated over tp), and
    which weight matmuls were found column- and row-parallel (node names, for tests and messages)."""
    split_dim: dict[str, int]
    column: tuple[str, ...]
    row: tuple[str, ...]
    vocab: tuple[str, ...]


def _weight_matmul(node: fx.Node, params: dict[str, str]) -> Optional[tuple[fx.Node, int, Optional[fx.Node]]]:
    """(weight placeholder, its output-feature dim, bias placeholder or None) of a matmul against a
    parameter, else None."""
    def param(a):
        return a if isinstance(a, fx.Node) and a.op == "placeholder" and a.name in params else None

    if node.op != "call_function":
        return None
    if node.target is aten.linear.default and len(node.args) >= 2 and param(node.args[1]) is not None:
        bias = param(node.args[2]) if len(node.args) > 2 else None
        return node.args[1], 0, bias
    if node.target in (aten.mm.default, aten.matmul.default) and param(node.args[1]) is not None:
        return node.args[1], 1, None
    if node.target in (aten.mm.default, aten.matmul.default) and _transposed_param(node.args[1], param) is not None:
        return _transposed_param(node.args[1], param), 0, None  # x @ w.t(): F.linear written out
    if node.target is aten.addmm.default and param(node.args[2]) is not None:
        return node.args[2], 1, param(node.args[0])
    return None


def _transposed_param(arg, param) -> Optional[fx.Node]:
    """The 2-D parameter ``w`` when ``arg`` is ``w.t()`` (or ``w.transpose(0, 1)``), else None."""
    if not isinstance(arg, fx.Node) or arg.op != "call_function" or not arg.args:
        return None
    w = param(arg.args[0])
    if w is None or len(getattr(w.meta.get(META), "shape", ())) != 2:
        return None
    if arg.target is aten.t.default or (arg.target is aten.transpose.int and sorted(
            d % 2 for d in arg.args[1:3]) == [0, 1]):
        return w
    return None


def _column_bias(node: fx.Node, params: dict[str, str], column: set) -> Optional[fx.Node]:
    """A 1-D parameter that ``node`` combines with the output of a column-parallel matmul along its
    features (a bias added by its own kernel: PyTorch 1.8's ``F.linear`` on a 3-D input, or a fused
    bias-activation), else None: split like those features."""
    ins = [a for a in node.args if isinstance(a, fx.Node)]
    if not any(a.name in column for a in ins):
        return None
    out = next(a for a in ins if a.name in column).meta.get(META)
    for a in ins:
        meta = a.meta.get(META)
        if a.op == "placeholder" and a.name in params and getattr(meta, "shape", None) is not None \
                and len(meta.shape) == 1 and out is not None and out.shape and meta.shape[0] == out.shape[-1]:
            return a
    return None


def _from_user_input(node: fx.Node, inputs: set[str], memo: dict) -> bool:
    """Whether ``node``'s value derives from a user input placeholder."""
    if node.name in memo:
        return memo[node.name]
    memo[node.name] = False  # cycles cannot happen in fx; guards re-entry on deep chains
    if node.op == "placeholder":
        memo[node.name] = node.name in inputs
    else:
        memo[node.name] = any(_from_user_input(a, inputs, memo) for a in node.all_input_nodes)
    return memo[node.name]


def tensor_parallel_roles(captured: CapturedGraph) -> TensorParallelRoles:
    """Column/row-parallel weight matmuls and vocab-parallel embeddings of ``captured`` (see the module
    docstring), in one pass over the program in order."""
    params = captured.params
    kinds: dict[str, frozenset] = {}  # node -> the roles of the weight matmuls its value derives from
    split: dict[str, int] = {}
    conflicted: set[str] = set()
    column, row, vocab = [], [], []

    def want(placeholder: str, dim: Optional[int]) -> None:
        if placeholder in conflicted:
            return
        if placeholder in split and split[placeholder] != dim:
            conflicted.add(placeholder)  # used two ways (a tied weight paired differently): replicate
            split.pop(placeholder)
        elif dim is not None:
            split[placeholder] = dim

    inputs = set(captured.inputs) | ({captured.target} if captured.target else set())  # the batch
    memo: dict = {}
    routers = router_matmuls(captured, lambda n: _weight_matmul(n, params) is not None)
    for node in captured.gm.graph.nodes:
        if node.op != "call_function":
            kinds[node.name] = frozenset()
            continue
        if node.name in routers:  # a MoE router: replicated over tp, as Megatron keeps it (its topk needs
            kinds[node.name] = frozenset()  # every expert's logit)
            continue
        if is_moe_node(node):  # the experts' output is whole (after the combine or etp's reduction), as a
            kinds[node.name] = frozenset({"row"})  # row-parallel layer's: the next block's matmuls are columns
            continue
        found = _weight_matmul(node, params)
        if found is None:
            kinds[node.name] = frozenset().union(*(kinds.get(a.name, frozenset()) for a in node.all_input_nodes))
            bias = _column_bias(node, params, set(column))
            if bias is not None:
                want(bias.name, 0)
            if node.target is aten.embedding.default and isinstance(node.args[0], fx.Node) \
                    and node.args[0].name in params and _from_user_input(node.args[1], inputs, memo):
                vocab.append(node.name)
                want(node.args[0].name, 0)
            continue
        weight, out_dim, bias = found
        if weight.meta[META].shape[out_dim] == 1:  # one output per token (Qwen2-MoE's shared_expert_gate): no
            kinds[node.name] = frozenset()  # tp splits it, so its value is whole, as a router's
            continue
        upstream = kinds.get(node.args[0].name, frozenset()) if isinstance(node.args[0], fx.Node) else frozenset()
        if node.target is aten.addmm.default:
            upstream = kinds.get(node.args[1].name, frozenset())
        if upstream <= {"row"}:
            role = "column"
            column.append(node.name)
            want(weight.name, out_dim)
            if bias is not None:
                want(bias.name, 0)
        elif upstream == {"column"}:
            role = "row"
            row.append(node.name)
            want(weight.name, 1 - out_dim)
        else:
            role = "mixed"
            conflicted.add(weight.name)
            split.pop(weight.name, None)
        kinds[node.name] = frozenset({role})
    return TensorParallelRoles(split, tuple(column), tuple(row), tuple(vocab))


_VIEW_TARGETS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
                 aten.unflatten.int}


def _first_computing_user(node: fx.Node) -> Optional[fx.Node]:
    """The first op reading ``node``'s value that is not a view of it (through views), or None."""
    todo = list(node.users)
    while todo:
        user = todo.pop(0)
        if user.op != "call_function":
            continue
        if user.target in _VIEW_TARGETS:
            todo.extend(user.users)
            continue
        return user
    return None


def _module(node: fx.Node) -> str:
    return node.meta.get(MODULE) or "(top level)"


def check_tensor_parallel(captured: CapturedGraph, roles: TensorParallelRoles, tp: int) -> None:
    """``LayoutError`` when ``tp`` does not divide an attention's query or key/value heads or a
    tensor-parallel weight's split dim."""
    if tp <= 1:
        return
    for node in captured.gm.graph.nodes:
        if node.op == "call_function" and node.target is aten.scaled_dot_product_attention.default:
            for which, arg in (("query", node.args[0]), ("key/value", node.args[1])):
                shape = arg.meta.get(META).shape if isinstance(arg, fx.Node) and arg.meta.get(META) else None
                if shape is not None and len(shape) == 4 and shape[1] % tp:
                    heads = shape[1]
                    ok = [d for d in range(1, heads + 1) if heads % d == 0]
                    raise LayoutError(f"tp={tp} does not divide the {heads} {which} heads of the attention "
                                      f"{node.name} (module {_module(node)}): Megatron splits heads over tp; "
                                      f"choose tp among {ok}")
    for placeholder, dim in roles.split_dim.items():
        shape = captured.node(placeholder).meta[META].shape
        if tensor_parallel_dim(roles, placeholder, shape, tp) is not None and shape[dim] % tp:
            raise LayoutError(f"tp={tp} does not divide dim {dim} (size {shape[dim]}) of parameter "
                              f"{captured.params[placeholder]!r}, which tensor parallelism splits; choose a tp that "
                              f"divides {shape[dim]}")


def tensor_parallel_dim(roles: TensorParallelRoles, placeholder: str, shape, tp: int) -> Optional[int]:
    """The dim of parameter ``placeholder`` that tensor parallelism splits over ``tp`` ranks, or None.
    A dim smaller than ``tp`` (a gate or router with one output per token, such as Qwen2-MoE's
    ``shared_expert_gate``) is not split: frameworks keep such layers replicated, as no tp > 1 could split
    them. Any other size that ``tp`` does not divide is ``check_tensor_parallel``'s error."""
    dim = roles.split_dim.get(placeholder) if tp > 1 else None
    if dim is None or shape[dim] < tp:
        return None
    return dim


def _shard_dim(shape, mesh: Mesh, axes: LayoutAxes, tp_dim: Optional[int]) -> Optional[int]:
    """The dim of a parameter the shard axes split: the first that divides, other than the one tp splits.
    Sharding tp's dim again over dp (``(S(0), S(0))``) would nest dp outside tp, and gathering it back
    to tp's shard is a full reshuffle, not the all-gather FSDP does (torchtitan keeps tp outside with
    ``_StridedShard``); only when no other dim divides is tp's own dim used."""
    n = math.prod(mesh.shape[a] for a in axes.shard)
    tp = mesh.shape[axes.tp] if axes.tp is not None else 1
    for d, size in enumerate(shape):
        if d != tp_dim and size % n == 0:
            return d
    if tp_dim is not None and shape[tp_dim] % (n * tp) == 0:
        return tp_dim
    return None


def _distributed_optimizer(pls: tuple, shape, mesh: Mesh, axes: LayoutAxes) -> tuple:
    """A parameter pin ``pls`` with ``/zero1`` on the replicated data axes when ``axes.zero1`` (and a dim
    of the parameter's local piece those axes divide, ``storage_forms.zero_dim``; else unchanged)."""
    over = tuple(a for a in axes.replicate if mesh.shape[a] > 1 and pls[a] == "R")
    if not axes.zero1 or not over:
        return pls
    storage = tuple(parse_placement(p) for p in pls)
    if zero_dim(shape, storage, over, mesh.shape) is None:
        return pls
    return tuple(f"{p}/zero1" if a in over else p for a, p in enumerate(pls))


def layout_pins(captured: CapturedGraph, mesh: Mesh, axes: LayoutAxes, *, sequence_parallel: bool = False,
                roles: Optional[TensorParallelRoles] = None) -> dict:
    """``{"params": ..., "inputs": ..., "ops": ...}`` pinning the layout's placements (module docstring).
    Every parameter is pinned by its exact name; every user input splits its dim 0 over the data axes
    (and dim 1, the sequence, over cp); with ``sequence_parallel`` (and tp > 1) the op feeding each
    column-parallel matmul (the normalisation) outputs its sequence dim split over tp; with cp > 1 each
    attention runs on sequence-split queries (ring attention); each row-parallel matmul (and vocab-parallel
    embedding) outputs its partial sum over tp; without sequence parallelism (tp > 1)
    the op reading each row-parallel matmul's (and vocab-parallel embedding's) output outputs it
    whole on tp, as Megatron's all-reduce leaves it."""
    tp = mesh.shape[axes.tp] if axes.tp is not None else 1
    roles = roles if roles is not None else tensor_parallel_roles(captured)
    check_tensor_parallel(captured, roles, tp)
    params: dict[str, tuple] = {}
    for placeholder, fqn in captured.params.items():
        shape = captured.node(placeholder).meta[META].shape
        tp_dim = tensor_parallel_dim(roles, placeholder, shape, tp)
        sdim = _shard_dim(shape, mesh, axes, tp_dim) if axes.shard else None
        pls = []
        for a in range(mesh.ndim):
            if a == axes.tp and tp_dim is not None:
                pls.append(f"S({tp_dim})")
            elif a in axes.shard and sdim is not None:
                pls.append(f"S({sdim})")
            else:
                pls.append("R")
        params[fqn] = _distributed_optimizer(tuple(pls), shape, mesh, axes)

    def activation(ndim: int, seq_on_tp: Optional[int] = None, seq: int = 1) -> tuple:
        pls = []
        for a in range(mesh.ndim):
            if a in axes.data and mesh.shape[a] > 1:
                pls.append("S(0)")
            elif a == axes.cp and ndim > seq:
                pls.append(f"S({seq})")
            elif a == axes.tp and seq_on_tp is not None:
                pls.append(f"S({seq_on_tp})")
            else:
                pls.append("R")
        return tuple(pls)

    inputs = {}
    for i, name in enumerate(captured.inputs):
        meta = captured.node(name).meta.get(META)
        if meta is not None and hasattr(meta, "shape") and len(meta.shape) >= 1:
            inputs[i] = activation(len(meta.shape))
    ops: dict[str, tuple] = {}
    if sequence_parallel and tp > 1:
        for name in roles.column:
            node = captured.node(name)
            src = node.args[1] if node.target is aten.addmm.default else node.args[0]
            meta = src.meta.get(META) if isinstance(src, fx.Node) else None
            if src.op == "call_function" and meta is not None and hasattr(meta, "shape") and len(meta.shape) >= 3:
                seq_dim = len(meta.shape) - 2
                if meta.shape[seq_dim] % tp:
                    raise LayoutError(
                        f"sequence parallelism splits the sequence (dim {seq_dim}, length {meta.shape[seq_dim]}) "
                        f"of {src.name} (module {_module(src)}), the input of the column-parallel {name}, over "
                        f"tp={tp}: choose a tp that divides {meta.shape[seq_dim]}, or a sequence length that tp "
                        f"divides (a megatron layout can also pass sequence_parallel=False)")
                ops[src.name] = activation(len(meta.shape), seq_on_tp=seq_dim)
    experts = axes.experts if axes.experts is not None else expert_axes_like_attention(axes, mesh)
    moe = expert_layout_pins(captured, mesh, ex=experts, data=axes.data, cp=axes.cp, tp=axes.tp,
                             sequence_parallel=sequence_parallel)
    params.update(moe["params"])
    if tp > 1:
        # a row-parallel matmul computes its partial sum on its input features' split (Megatron's
        # RowParallelLinear), a vocab-parallel embedding its rows' lookups, whatever else would be
        # cheaper for the solver
        for name in (*roles.row, *roles.vocab):
            meta = captured.node(name).meta.get(META)
            if meta is not None and hasattr(meta, "shape") and len(meta.shape) >= 1:
                pls = list(activation(len(meta.shape)))
                pls[axes.tp] = "P"
                ops[name] = tuple(pls)
    if not sequence_parallel and tp > 1:
        # Megatron without sequence parallelism all-reduces a row-parallel output (and a vocab-parallel
        # embedding's) and runs what follows (bias, dropout, residual add, the next norm) on the whole
        # tensor on every tp rank
        for name in (*roles.row, *roles.vocab):
            consumer = _first_computing_user(captured.node(name))
            meta = consumer.meta.get(META) if consumer is not None else None
            if meta is not None and hasattr(meta, "shape") and len(meta.shape) >= 1 and consumer.name not in ops:
                ops[consumer.name] = activation(len(meta.shape))
    if axes.cp is not None and mesh.shape[axes.cp] > 1:
        for node in captured.gm.graph.nodes:
            if node.op == "call_function" and node.target is aten.scaled_dot_product_attention.default:
                pls = list(activation(4, seq=2))
                if axes.tp is not None and tp > 1:
                    pls[axes.tp] = "S(1)"  # heads over tp
                ops[node.name] = tuple(pls)
    return {"params": params, "inputs": inputs, "ops": ops, "strategies": moe["strategies"]}
