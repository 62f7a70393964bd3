"""Batch-coupled ops: where a step's result depends on which rows share a (micro)batch.

>>> model, inputs, target, loss_fn = cnn()                                       # doctest: +SKIP
>>> [c.describe() for c in batch_coupled_ops(capture(model, inputs, loss_fn=loss_fn, target=target))]  # doctest: +SKIP
["batch_norm in module 'bn': BatchNorm in training mode (batch statistics)"]

Gradient accumulation and pipeline microbatches run a step as several smaller batches and average
the losses. That is exact only when each row's contribution to the loss does not depend on the other
rows: per-row work, then a mean over the batch at the loss. An op that mixes rows non-linearly
(BatchNorm's batch statistics, a softmax over the batch dimension, a ``sum`` loss, which averages to
``1/k`` of itself) computes something else on a microbatch. ``batch_coupled_ops`` finds them, so the
planner can leave accumulation off and the front door can warn when a user asks for it.

What is detected (conservative: when in doubt an op is reported):

- BatchNorm in training mode: ``aten.batch_norm`` / ``native_batch_norm`` / ``_native_batch_norm_legit``
  (``_functional`` and ``_no_training`` variants) / ``cudnn_batch_norm`` / ``miopen_batch_norm`` whose
  ``training`` argument is True (``_native_batch_norm_legit`` without running stats always is);
- a reduction, normalisation or scan whose dimensions include the batch dimension of a value
  computed from the inputs (``sum``, ``mean``, ``var``, ``std``, ``amax``, ``softmax``, ``cumsum``,
  ``sort``, ``topk``, norms, ... and their all-dims forms; ``layer_norm`` / ``group_norm`` whose
  normalised dims reach the batch dimension), unless it is a MEAN over the batch on the way to the
  scalar loss through linear ops only (``mean``, the loss functions' default mean reduction,
  ``add``/``sub``/``neg``, multiplying or dividing by a value not computed from the batch, views):
  that is the usual loss and averages exactly over equal microbatches (a class loss's mean over its
  non-ignored targets included: the runtime weighs each microbatch by its count, ``runtime.step_weights``;
  a class-weighted one is reported);
- an opaque call (``passes.capture.opaque``: a custom ``autograd.Function``, a loss run as written)
  that reads a value carrying the batch: autoshard cannot see inside it;
- a matrix product pairing the batch's rows with each other (``a @ b.T``, a contrastive similarity
  matrix), a class loss whose class dimension is the batch's, an ``embedding_bag`` whose offsets come
  from the inputs (they index the whole batch's flat ids);
- a write into a buffer in forward (spectral norm's power iteration, a step counter, a moving
  average): one device writes it once a step, a step of k microbatches k times.

The batch dimension of a value follows ``microbatch.py``'s convention (dim 0, when it is a multiple
of the global batch) and is carried through ``transpose`` / ``permute`` / ``movedim``; a value whose
batch dimension cannot be placed is taken not to carry it. Not detected: ops with data-dependent row
mixing inside custom ops (no rule can see into them), and masks or indices that pick other rows.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from autoshard.passes.errors import BatchCouplingWarning
from autoshard.passes.graph import META, MODULE, CapturedGraph
from autoshard.passes.writes import state_writes

__all__ = ["BatchCouplingWarning", "CoupledOp", "batch_coupled_ops", "describe_coupled"]


@dataclass(frozen=True)
class CoupledOp:
    """One batch-coupled op: its node name, ATen op, module path and why it couples rows."""
    node: str
    op: str
    module: str
    why: str

    def describe(self) -> str:
        return f"{self.node} in module {self.module or '<top>'!r}: {self.why}"


def describe_coupled(ops: list[CoupledOp], limit: int = 4) -> str:
    """The first ``limit`` ops as one readable phrase (for warnings and errors)."""
    shown = "; ".join(c.describe() for c in ops[:limit])
    return shown + (f"; and {len(ops) - limit} more" if len(ops) > limit else "")


# op packet name -> index of its ``training`` argument (None: always training)
_BATCH_NORMS = {"batch_norm": 5, "native_batch_norm": 5, "_native_batch_norm_legit": 5,
                "_native_batch_norm_legit_functional": 5, "cudnn_batch_norm": 5, "miopen_batch_norm": 5,
                "_batch_norm_impl_index": 5, "_batch_norm_with_update": None,
                "_batch_norm_with_update_functional": None}

# op packet name -> (index of the dim argument, whether a missing/None dim means every dim)
_REDUCTIONS = {"sum": (1, True), "mean": (1, True), "var": (1, True), "std": (1, True), "var_mean": (1, True),
               "std_mean": (1, True), "amax": (1, True), "amin": (1, True), "max": (1, True), "min": (1, True),
               "argmax": (1, True), "argmin": (1, True), "logsumexp": (1, False), "prod": (1, True),
               "norm": (2, True), "linalg_vector_norm": (2, True), "nansum": (1, True), "nanmean": (1, True),
               "softmax": (1, False), "_softmax": (1, False), "log_softmax": (1, False), "_log_softmax": (1, False),
               "cumsum": (1, False), "cumprod": (1, False), "cummax": (1, False), "cummin": (1, False),
               "logcumsumexp": (1, False), "sort": (1, False), "argsort": (1, False), "topk": (2, False),
               "kthvalue": (2, False), "median": (1, True), "nanmedian": (1, True), "mode": (1, False),
               "all": (1, True), "any": (1, True), "count_nonzero": (1, True)}
_DIM_DEFAULTS = {"softmax": -1, "log_softmax": -1, "sort": -1, "argsort": -1, "topk": -1, "kthvalue": -1,
                 "mode": -1, "logsumexp": None}

# loss functions: their reduction argument's index; reduction 1 (mean, the default) is linear
_LOSSES = {"cross_entropy_loss": 3, "nll_loss": 3, "nll_loss_forward": 3, "nll_loss2d": 3,
           "nll_loss2d_forward": 3, "mse_loss": 2, "l1_loss": 2, "smooth_l1_loss": 2, "huber_loss": 2,
           "binary_cross_entropy": 3, "binary_cross_entropy_with_logits": 4, "kl_div": 2,
           "soft_margin_loss": 2, "multilabel_margin_loss": 2, "hinge_embedding_loss": 3,
           "poisson_nll_loss": 5, "margin_ranking_loss": 4, "cosine_embedding_loss": 4}
_MEAN = 1
_CLASS_LOSSES = {"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d", "nll_loss_forward", "nll_loss2d_forward"}
_PRODUCTS = {"mm", "bmm", "matmul"}
_BAGS = {"_embedding_bag", "embedding_bag", "_embedding_bag_forward_only"}

# ops through which a mean over the batch stays a linear function of the rows' contributions
_LINEAR = {"add", "sub", "neg", "mul", "div", "view", "reshape", "_unsafe_view", "squeeze", "unsqueeze",
           "clone", "alias", "detach", "to", "_to_copy", "contiguous", "expand", "flatten", "mean", "sum",
           "lift_fresh_copy"}
_PERMUTES = {"transpose", "t", "permute", "movedim", "swapaxes", "swapdims", "numpy_T"}


def batch_coupled_ops(captured: CapturedGraph) -> list[CoupledOp]:
    """Every batch-coupled op of ``captured`` in graph order (see the module docstring)."""
    batch = _global_batch(captured)
    if batch is None:
        return []
    axis = _batch_axes(captured, batch)
    found = []
    for node in captured.gm.graph.nodes:
        if node.op != "call_function":
            continue
        packet = _packet(node)
        why = _coupling(node, packet, axis)
        if why is None:
            continue
        if why == _LINEAR_MEAN and _reaches_loss_linearly(node, axis, captured):
            continue
        if why == _LINEAR_MEAN:
            why = "reduces over the batch dimension before the loss (a microbatch computes it on its own rows)"
        found.append(CoupledOp(node.name, f"aten.{packet}" if packet else str(node.target),
                               str(node.meta.get(MODULE, "")), why))
    reported = {c.node for c in found}
    normed = {c.module for c in found if c.why.startswith("BatchNorm")}  # its counter: the BatchNorm says it
    for node, name in state_writes(captured):
        if (name in captured.buffers and node.name not in reported and _packet(node) not in _BATCH_NORMS
                and str(node.meta.get(MODULE, "")) not in normed):
            reported.add(node.name)
            found.append(CoupledOp(node.name, f"aten.{_packet(node)}", str(node.meta.get(MODULE, "")),
                                   f"writes buffer {captured.buffers[name]!r} in forward: one device writes it once "
                                   "a step, a step of k microbatches k times"))
    return found


_LINEAR_MEAN = "linear-mean"


def _coupling(node: fx.Node, packet: Optional[str], axis: dict) -> Optional[str]:
    """Why ``node`` couples the rows of a batch (``_LINEAR_MEAN``: a mean over them, fine at the loss), or None."""
    if packet in _BATCH_NORMS:
        index = _BATCH_NORMS[packet]
        training = True if index is None else _arg(node, index, "training", True)
        if packet == "_native_batch_norm_legit" and len(node.args) == 5:  # the no-running-stats overload
            training = _arg(node, 3, "training", True)
        if training is False:
            return None
        return "BatchNorm in training mode (batch statistics)"
    if _opaque_call(node) is not None:
        if any(axis.get(a.name) is not None for a in node.all_input_nodes):
            return (f"an opaque call ({_opaque_call(node)}) on the batch: autoshard cannot see whether it mixes "
                    "the rows")
        return None
    paired = _pairs_rows(node, packet, axis)
    if paired is not None:
        return paired
    if packet in _BAGS and _from_inputs(_arg(node, 2, "offsets", None), axis):
        return "offsets index into the whole batch's flat ids: a microbatch's slice of them points at other rows"
    src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if src is None or axis.get(src.name) is None:
        return None
    b = axis[src.name]
    rank = _rank(src)
    if packet in _CLASS_LOSSES and b == 1 and rank >= 2:
        return "a class loss whose classes are the batch's rows (a contrastive loss): a microbatch scores its own rows only"
    if packet in _LOSSES:
        reduction = _arg(node, _LOSSES[packet], "reduction", _MEAN)
        if reduction == 0:
            return None  # per-row losses: whatever follows decides
        if (reduction == _MEAN and packet in ("cross_entropy_loss", "nll_loss", "nll_loss2d", "nll_loss_forward",
                                               "nll_loss2d_forward") and _arg(node, 2, "weight", None) is not None):
            return "a class-weighted mean loss divides by its microbatch's total class weight"
        return _LINEAR_MEAN if reduction == _MEAN else "a sum loss: averaged over microsteps it becomes 1/k of itself"
    if packet in ("layer_norm", "native_layer_norm"):
        shape = _arg(node, 1, "normalized_shape", ())
        return "normalises over the batch dimension" if rank - len(shape) <= b else None
    if packet in ("group_norm", "native_group_norm"):
        return None  # per sample (dim 0 is N); a batch axis elsewhere is not a group_norm input
    if packet not in _REDUCTIONS:
        return None
    index, all_when_none = _REDUCTIONS[packet]
    dims = _arg(node, index, "dim", _DIM_DEFAULTS.get(packet, None))
    if packet in ("max", "min", "median", "nanmedian", "all", "any") and len(node.args) <= index:
        dims = None  # the all-dims overloads
    if dims is None:
        if not all_when_none and packet not in ("logsumexp",):
            return None
        covered = True
    else:
        dims = [dims] if isinstance(dims, int) else list(dims)
        covered = not dims or any(d % max(rank, 1) == b for d in dims if isinstance(d, int))
    if not covered:
        return None
    if packet in ("mean", "nanmean"):
        return _LINEAR_MEAN
    return f"{packet} over the batch dimension mixes the rows of the batch"


def _from_inputs(value, axis: dict) -> bool:
    """Whether ``value`` is computed from the inputs or the target (``axis`` holds every such node)."""
    return isinstance(value, fx.Node) and value.name in axis


def _pairs_rows(node: fx.Node, packet: Optional[str], axis: dict) -> Optional[str]:
    """Why a matrix product couples rows: its second operand carries the batch on a dimension that is
    contracted or becomes a column (``a @ b.t()``: each row scored against every row of the batch), or
    its first operand's batch is contracted (``a.t() @ b``: a sum over the rows). A batched product whose
    operands both carry the batch on dim 0 keeps rows apart."""
    if packet not in _PRODUCTS or len(node.args) < 2:
        return None
    a, b = node.args[0], node.args[1]
    if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
        return None
    ba, bb = axis.get(a.name), axis.get(b.name)
    ra, rb = _rank(a), _rank(b)
    if bb is None and (ba is None or ba != ra - 1 or ra < 2):
        return None  # rows of the first operand stay rows of the output
    if ba == 0 and bb == 0 and ra >= 3 and rb >= 3:
        return None  # a batched product over the batch dimension
    return f"{packet} pairs the rows of the batch with each other (e.g. a similarity matrix a @ b.T)"


def _opaque_call(node: fx.Node) -> Optional[str]:
    """What an ``autoshard::opaque`` node calls (its key without the digest), else None. By name: the op
    is defined in ``passes.capture.opaque``, a later stage than this module."""
    name = getattr(node.target, "name", None)
    if not callable(name) or name() != "autoshard::opaque" or not node.args:
        return None
    return str(node.args[0]).split(":")[0]


def _reaches_loss_linearly(node: fx.Node, axis: dict, captured: CapturedGraph) -> bool:
    """Whether every path from ``node`` ends at the scalar loss output through linear ops whose other
    operands are not computed from the batch."""
    if not captured.loss_output:
        return False
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        for user in n.users:
            if user.op == "output":
                continue
            if user.name in seen:
                continue
            seen.add(user.name)
            packet = _packet(user)
            if user.op != "call_function" or (packet not in _LINEAR and user.target is not operator.getitem):
                return False
            others = [a for a in user.all_input_nodes if a is not n]
            if packet in ("mul", "div") and any(a.name in axis for a in others):
                return False  # a product of two values computed from the batch is not linear in it
            if packet in ("add", "sub") and any(axis.get(a.name) is not None for a in others):
                return False  # the reduced value meets the rows again
            todo.append(user)
    return True


def _batch_axes(captured: CapturedGraph, batch: int) -> dict[str, Optional[int]]:
    """Node name -> the dimension of its (first) output that carries the batch, for every node computed
    from the inputs or the target; absent for the others."""
    axis: dict[str, Optional[int]] = {}
    starts = set(captured.inputs) | ({captured.target} if captured.target else set())
    for node in captured.gm.graph.nodes:
        if node.op == "placeholder":
            if node.name in starts:
                axis[node.name] = 0 if _dim0_carries(node, batch) else None
            continue
        if node.op != "call_function":
            continue
        sources = [a for a in node.all_input_nodes if a.name in axis]
        if not sources:
            continue
        packet = _packet(node)
        src = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if packet in _PERMUTES and src is not None and axis.get(src.name) is not None:
            axis[node.name] = _permuted(node, packet, axis[src.name], _rank(src))
        elif node.target is operator.getitem and src is not None:
            axis[node.name] = axis.get(src.name) if _rank(node) else None
        else:
            axis[node.name] = 0 if _dim0_carries(node, batch) else None
    return axis


def _permuted(node: fx.Node, packet: str, b: int, rank: int) -> Optional[int]:
    if packet in ("t", "numpy_T"):
        return rank - 1 - b if rank >= 2 else b
    if packet == "permute":
        order = [d % rank for d in _arg(node, 1, "dims", list(range(rank)))]
        return order.index(b) if b in order else None
    if packet in ("transpose", "swapaxes", "swapdims"):
        d0, d1 = (int(_arg(node, i, n, 0)) % max(rank, 1) for i, n in ((1, "dim0"), (2, "dim1")))
        return d1 if b == d0 else d0 if b == d1 else b
    if packet == "movedim":
        src, dst = _arg(node, 1, "source", 0), _arg(node, 2, "destination", 0)
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        order = [None] * rank
        for s, d in zip(src, dst):
            order[d % rank] = s % rank
        rest = iter(d for d in range(rank) if d not in [s % rank for s in src])
        order = [o if o is not None else next(rest) for o in order]
        return order.index(b) if b in order else None
    return None


def _global_batch(captured: CapturedGraph) -> Optional[int]:
    for name in captured.inputs:
        shape = getattr(captured.node(name).meta.get(META), "shape", None)
        if shape:
            return int(shape[0])
    return None


def _dim0_carries(node: fx.Node, batch: int) -> bool:
    meta = node.meta.get(META)
    if isinstance(meta, tuple):
        meta = next((m for m in meta if m is not None), None)
    shape = getattr(meta, "shape", None)
    return bool(shape) and batch > 0 and shape[0] % batch == 0


def _rank(node: fx.Node) -> int:
    meta = node.meta.get(META)
    if isinstance(meta, tuple):
        meta = next((m for m in meta if m is not None), None)
    return len(getattr(meta, "shape", ()) or ())


def _packet(node: fx.Node) -> Optional[str]:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.__name__
    return None


def _arg(node: fx.Node, index: int, name: str, default):
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)
