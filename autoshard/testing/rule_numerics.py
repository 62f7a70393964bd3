"""Rule numerics: check every strategy a sharding rule claims against the unsharded op.

The one harness for every rule family. A check traces a tiny function with ``torch.export`` (so
arguments look exactly as in the captured IR), asks the registry for a node's strategies and
simulates ``n`` ranks in one process for each of them::

    report = check_rule_numerics(F.linear, (x, w, b), n=2)          # the last op of the trace
    assert "(S(0), R, R)->(S(0))" in report.checked_str

    gm, calls = trace_calls(fn, (x, y))                               # every op of the trace
    reports = [check_node(node, args, kwargs, n=4) for node, (args, kwargs) in calls.items()]

Simulation of a ``Strategy1D`` (placements per operand and output along one mesh axis of size n):

- split each operand by its placement: ``S(d)`` -> ``torch.chunk`` along d, ``R`` -> the same
  tensor on every rank, ``P`` -> random summands that add up to the tensor (floating or complex);
- run the ATen op on each rank's pieces, its size argument (view, reshape, expand, new_*, ...)
  rewritten to the local output shape by the runtime's own ``local_size_args``; or run the
  strategy's lowering, written out inline below ("loss_mean_partial", "embedding_vocab",
  "mean_partial");
- reassemble each output by its placement (``S``: cat, ``R``: every rank must agree, ``P``: sum)
  and compare with the unsharded op; operands the op writes in place (batch-norm running stats)
  are reassembled and compared the same way. Random and uninitialised outputs (``rand_like``,
  ``empty_like``, ``new_empty``, ...) are compared by shape only;
- gradients, by the convention of ``passes/spec.py``: the upstream gradient of an ``S`` output
  is its shard, of a ``P`` output the full gradient on every rank, of an ``R`` output random
  summands; the local gradient of an ``S`` operand must cat to the true gradient, of an ``R``
  operand sum to it, of a ``P`` operand equal it on every rank.

Strategies with the lowering "batch_norm_sync", "expert_dispatch[_capacity]" or "ring_attention" are
skipped here (their math needs collectives; the runtime tests them on real ranks); so are strategies
whose sharded dims (of an operand or an output) do not divide by ``n``, and those the rule's
``LocalCheck`` refuses for the pieces on ``n`` ranks. All land in ``RuleCheck.skipped`` with the
reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from autoshard.passes.cost.lowerings import LOWERINGS
from autoshard.passes.graph import META, is_getitem, tensor_meta_of
from autoshard.passes.sharding.rules import local_check, op_call, rule_strategies
from autoshard.passes.schema import bind_args, op_name, rebuild_args
from autoshard.passes.spec import Partial, Placement, Replicate, Shard, Strategy1D, TensorMeta
from autoshard.runtime.localize import local_size_args

__all__ = ["RuleCheck", "check_rule_numerics", "check_node", "trace_op", "trace_calls", "record_calls",
           "clone_values", "operand_values", "substitute_operands", "output_tensors"]

aten = torch.ops.aten
# Ops whose output values are random or uninitialised: only their shapes can be compared.
SHAPE_ONLY = {aten.rand_like.default, aten.randn_like.default, aten.empty_like.default, aten.new_empty.default,
              aten.empty.memory_format}


@dataclass
class RuleCheck:
    """What a check did: the node, every strategy, which were checked or skipped (and why)."""
    node: fx.Node
    strategies: list[Strategy1D]
    checked: list[Strategy1D] = field(default_factory=list)
    skipped: list[tuple[Strategy1D, str]] = field(default_factory=list)

    @property
    def checked_str(self) -> set[str]:
        return {str(s) for s in self.checked}

    @property
    def all_str(self) -> set[str]:
        return {str(s) for s in self.strategies}


# ---------------------------------------------------------------- tracing

def trace_calls(fn: Callable, args: Sequence, kwargs: Optional[dict] = None,
                select: Optional[Callable[[fx.Node], bool]] = None) -> tuple[fx.GraphModule, dict]:
    """Export ``fn(*args, **kwargs)``; return the graph and ``{node: (args, kwargs) it saw}``.

    Every tensor in ``args``/``kwargs`` becomes a graph input; tensors ``fn`` creates are lifted
    constants and fed back. Every node gets ``node.meta["autoshard.meta"]``. Recorded nodes: the
    call_function nodes (getitems excluded) for which ``select`` holds (default: all), in execution
    order, with clones of the values they saw when the program ran on ``args``.
    """
    kwargs = kwargs or {}
    flat, spec = tree_flatten((tuple(args), kwargs))
    tensor_pos = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]

    class Wrapper(torch.nn.Module):
        def forward(self, *tensors):
            vals = list(flat)
            for i, t in zip(tensor_pos, tensors):
                vals[i] = t
            a, k = tree_unflatten(vals, spec)
            return fn(*a, **k)

    inputs = iter(tuple(flat[i].clone() for i in tensor_pos))
    ep = torch.export.export(Wrapper(), tuple(flat[i].clone() for i in tensor_pos), strict=False)
    gm = ep.graph_module
    for n in gm.graph.nodes:
        n.meta[META] = tensor_meta_of(n.meta.get("val"))
    feed = [ep.constants[s.target] if s.kind.name == "CONSTANT_TENSOR" else next(inputs)
            for s in ep.graph_signature.input_specs]
    return gm, record_calls(gm, feed, select)


def record_calls(gm: fx.GraphModule, feed: Sequence, select: Optional[Callable[[fx.Node], bool]] = None) -> dict:
    """Run ``gm`` on ``feed``; ``{node: (args, kwargs)}`` (cloned) for each selected call_function node."""
    seen: dict = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            if n.op == "call_function" and not is_getitem(n) and (select is None or select(n)):
                a, k = self.fetch_args_kwargs_from_env(n)
                seen[n] = (clone_values(a), clone_values(k))
            return super().run_node(n)

    Recorder(gm, garbage_collect_values=False).run(*[t.clone() for t in feed])
    return seen


def trace_op(fn: Callable, args: Sequence, kwargs: Optional[dict] = None, target: Any = None):
    """``(node, real_args, real_kwargs)`` of the last op ``fn`` calls (the last call of ``target``)."""
    _, calls = trace_calls(fn, args, kwargs, None if target is None else (lambda n: n.target == target))
    if not calls:
        raise AssertionError(f"no call to {target or 'any op'} in the traced function")
    node = list(calls)[-1]
    return (node, *calls[node])


def clone_values(v):
    if isinstance(v, torch.Tensor):
        return v.detach().clone()
    if isinstance(v, (list, tuple)):
        return type(v)(clone_values(x) for x in v) if isinstance(v, tuple) else [clone_values(x) for x in v]
    if isinstance(v, dict):
        return {k: clone_values(x) for k, x in v.items()}
    return v


def map_operands(node_arg, real, fn):
    """Replace each tensor operand of ``real`` (walked alongside the node's args) by ``fn(real)``."""
    if isinstance(node_arg, fx.Node):
        return fn(real) if isinstance(node_arg.meta.get(META), TensorMeta) else real
    if isinstance(node_arg, (list, tuple)):
        vals = [map_operands(a, r, fn) for a, r in zip(node_arg, real)]
        return tuple(vals) if isinstance(real, tuple) else vals
    if isinstance(node_arg, dict):
        return {k: map_operands(node_arg[k], real[k], fn) for k in node_arg}
    return real


def substitute_operands(node: fx.Node, args, kwargs, values: Sequence[torch.Tensor]):
    it = iter(values)
    a = map_operands(tuple(node.args), tuple(args), lambda _: next(it))
    k = map_operands(dict(node.kwargs), dict(kwargs), lambda _: next(it))
    return a, k


def operand_values(node: fx.Node, args, kwargs) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []

    def collect(t):
        found.append(t)
        return t

    map_operands(tuple(node.args), tuple(args), collect)
    map_operands(dict(node.kwargs), dict(kwargs), collect)
    return found


def output_tensors(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (list, tuple)):
        return [t for t in result if isinstance(t, torch.Tensor)]
    return []


# ---------------------------------------------------------------- lowerings, simulated inline

def _with_arg(target, args, kwargs, name, value) -> tuple[tuple, dict]:
    return rebuild_args(target, {**bind_args(target, args, kwargs), name: value})


_CLASS_LOSSES = {"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d", "nll_loss_forward",
                 "nll_loss2d_forward"}


def _loss_count(target, args, kwargs) -> torch.Tensor:
    """How many elements (or how much class weight) a mean-reduced loss divides by, locally."""
    b = bind_args(target, args, kwargs)
    inp, tgt = b["self"], b["target"]
    if op_name(target) in _CLASS_LOSSES:
        if tgt.is_floating_point():  # class probabilities: mean over the batch elements
            return torch.tensor(inp.numel() / inp.shape[1 if inp.dim() > 1 else 0])
        mask = tgt != b.get("ignore_index", -100)
        w = b.get("weight")
        return mask.sum() if w is None else w.detach()[tgt[mask]].sum()
    return torch.tensor(math.prod(torch.broadcast_shapes(inp.shape, tgt.shape)))


def _sim_loss_mean_partial(target, calls, rank):
    total = sum(_loss_count(target, a, k) for a, k in calls)
    args, kwargs = _with_arg(target, *calls[rank], "reduction", 2)
    res = target(*args, **kwargs)
    if isinstance(res, tuple):
        return (res[0] / total, *res[1:])
    return res / total


def _sim_embedding_vocab(target, calls, rank):
    args, kwargs = calls[rank]
    b = bind_args(target, args, kwargs)
    weight, idx = b["weight"], b["indices"]
    lo = sum(bind_args(target, *calls[q])["weight"].shape[0] for q in range(rank))
    rows = weight.shape[0]
    mask = (idx >= lo) & (idx < lo + rows)
    pad = b.get("padding_idx", -1)
    local_pad = pad - lo if pad is not None and lo <= pad < lo + rows else -1
    args, kwargs = _with_arg(target, args, kwargs, "indices", torch.where(mask, idx - lo, 0))
    args, kwargs = _with_arg(target, args, kwargs, "padding_idx", local_pad)
    return target(*args, **kwargs) * mask.unsqueeze(-1).to(weight.dtype)


def _reduced_count(shape, dims) -> int:
    if dims is None or len(dims) == 0:
        return math.prod(shape)
    return math.prod(shape[d % len(shape)] for d in dims)


def _sim_mean_partial(target, calls, rank, full_shape):
    args, kwargs = calls[rank]
    b = bind_args(target, args, kwargs)
    dims = b.get("dim")
    local = _reduced_count(b["self"].shape, dims)
    return target(*args, **kwargs) * (local / _reduced_count(full_shape, dims))


def _run_local(node: fx.Node, s: Strategy1D, calls, rank: int, full, n: int):
    op, (args, kwargs) = node.target, calls[rank]
    if s.lowering is None:
        meta = node.meta[META]
        if isinstance(meta, TensorMeta):  # as the runtime does: size arguments become local sizes
            p = s.outputs[0]
            local = [size // n if isinstance(p, Shard) and p.dim == d else size for d, size in enumerate(meta.shape)]
            args, kwargs = local_size_args(op, args, kwargs, local)
        return op(*args, **kwargs)
    if s.lowering == "loss_mean_partial":
        return _sim_loss_mean_partial(op, calls, rank)
    if s.lowering == "embedding_vocab":
        return _sim_embedding_vocab(op, calls, rank)
    if s.lowering == "mean_partial":
        return _sim_mean_partial(op, calls, rank, full[0].shape)
    raise AssertionError(f"{op}: no simulation of lowering {s.lowering!r} in autoshard/testing/rule_numerics.py")


# ---------------------------------------------------------------- simulation

class _Indivisible(Exception):
    pass


def _inexact(t: torch.Tensor) -> bool:
    """Floating or complex: compared with a tolerance, split into random summands, differentiated."""
    return t.is_floating_point() or t.is_complex()


def _check_divides(t: torch.Tensor, p: Placement, n: int) -> None:
    if isinstance(p, Shard) and t.shape[p.dim] % n:
        raise _Indivisible(f"dim {p.dim} of size {t.shape[p.dim]} does not divide by {n}")


def _piece_shape(t: torch.Tensor, p: Placement, n: int) -> tuple[int, ...]:
    return tuple(s // n if isinstance(p, Shard) and p.dim == d else s for d, s in enumerate(t.shape))


def _split(x: torch.Tensor, p: Placement, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    _check_divides(x, p, n)
    if isinstance(p, Shard):
        return [c.contiguous() for c in torch.chunk(x, n, p.dim)]
    if isinstance(p, Partial):
        if not _inexact(x):
            raise AssertionError(f"P placement on a {x.dtype} operand")
        parts = [torch.randn(x.shape, generator=gen, dtype=x.dtype) for _ in range(n - 1)]
        return parts + [x - sum(parts)] if parts else [x.clone()]
    return [x.clone() for _ in range(n)]


def _assemble(what: str, pieces: list[torch.Tensor], p: Placement, grad: bool, close) -> torch.Tensor:
    """Rebuild a full tensor from per-rank pieces. For gradients R and P swap roles (spec.py)."""
    kind = "S" if isinstance(p, Shard) else ("R" if isinstance(p, Replicate) else "P")
    if grad and kind != "S":
        kind = "P" if kind == "R" else "R"
    if kind == "S":
        return torch.cat(pieces, p.dim)
    if kind == "P":
        return sum(pieces[1:], pieces[0].clone())
    for r, t in enumerate(pieces[1:], 1):
        close(t, pieces[0], f"{what}: rank {r} disagrees with rank 0 on a replicated value")
    return pieces[0]


def check_rule_numerics(fn: Callable, args: Sequence, kwargs: Optional[dict] = None, n: int = 2, *,
                        target: Any = None, grads: bool = True, rtol: float = 1e-5,
                        atol: float = 1e-6, seed: int = 0) -> RuleCheck:
    """Check every strategy the registry gives the op that ``fn(*args, **kwargs)`` calls (its last
    op, or its last call of ``target``) on ``n`` simulated ranks; see ``check_node``."""
    node, real_args, real_kwargs = trace_op(fn, args, kwargs or {}, target)
    return check_node(node, real_args, real_kwargs, n, gen=torch.Generator().manual_seed(seed), grads=grads,
                      rtol=rtol, atol=atol)


def check_node(node: fx.Node, args, kwargs, n: int = 2, *, gen: Optional[torch.Generator] = None,
               grads: bool = True, writes: bool = True, rtol: Optional[float] = None,
               atol: Optional[float] = None) -> RuleCheck:
    """Check every strategy of ``node``, called on the real ``args``/``kwargs``, on ``n`` ranks.

    ``writes``: also check that each operand the op writes in place still holds its declared
    placement afterwards (the runtime writes it back under that placement). ``rtol``/``atol`` of
    None: 1e-5 where a float32 tensor is involved, else 1e-8. Raises ``AssertionError`` naming the
    node, the strategy and the value that differs.
    """
    strategies, has_rule = rule_strategies(node)
    if not has_rule:
        raise AssertionError(f"no sharding rule registered for {node.target}")
    check, call = local_check(node.target), op_call(node)
    op = node.target
    gen = gen if gen is not None else torch.Generator().manual_seed(0)
    full = operand_values(node, args, kwargs)

    # Reference run; operands the op writes in place are not differentiable leaves.
    probe = [t.clone() for t in full]
    a, k = substitute_operands(node, args, kwargs, probe)
    op(*a, **k)
    mutated = [i for i, (before, after) in enumerate(zip(full, probe)) if not torch.equal(before, after)]
    diff = [grads and _inexact(t) and i not in mutated and op not in SHAPE_ONLY
            and _accepts_grad(node, args, kwargs, full, i) for i, t in enumerate(full)]
    ref_in = [t.clone().requires_grad_(d) for t, d in zip(full, diff)]
    a, k = substitute_operands(node, args, kwargs, ref_in)
    ref_out = output_tensors(op(*a, **k))
    if len(ref_out) != len(strategies[0].outputs):
        raise AssertionError(f"{op}: ran to {len(ref_out)} tensor outputs, meta says {len(strategies[0].outputs)}")
    if rtol is None or atol is None:
        rtol = atol = 1e-5 if any(t.dtype in (torch.float32, torch.complex64) for t in [*full, *ref_out]) else 1e-8
    _check_well_formed(op, strategies, full, ref_out)

    def close(got, want, msg):
        # ``atol`` is relative to the tensor's largest entry: a sum's rounding scales with its summands,
        # so a small entry of a large gradient carries the large entries' absolute error
        got, want = got.detach(), want.detach()
        scale = max(1.0, want.abs().max().item()) if _inexact(want) and want.numel() else 1.0
        ok = got.shape == want.shape and (
            torch.allclose(got, want, rtol=rtol, atol=atol * scale, equal_nan=True)
            if _inexact(got) else torch.equal(got, want))
        if not ok:
            err = (got - want).abs().max().item() if got.shape == want.shape and _inexact(got) else ""
            raise AssertionError(f"{msg} (got shape {tuple(got.shape)}, want {tuple(want.shape)}) {err}")

    out_grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) if o.requires_grad else None for o in ref_out]
    want_in_grads = _grads(ref_out, out_grads, ref_in, diff)

    report = RuleCheck(node, strategies)
    for s in strategies:
        if s.lowering in ("batch_norm_sync", "expert_dispatch", "expert_dispatch_capacity", "ring_attention"):
            report.skipped.append((s, f"{s.lowering} needs collectives; tested by the runtime on real ranks"))
            continue
        try:
            for o, p in zip(ref_out, s.outputs):
                _check_divides(o, p, n)
            pieces = [_split(t, p, n, gen) for t, p in zip(full, s.inputs)]
        except _Indivisible as e:
            report.skipped.append((s, str(e)))
            continue
        if check is not None and not check(call, [tuple(p[0].shape) for p in pieces],
                                           [_piece_shape(o, p, n) for o, p in zip(ref_out, s.outputs)]):
            report.skipped.append((s, f"the rule's local check refuses these pieces on {n} ranks"))
            continue
        tag = f"{node.format_node()} under {s} on {n} ranks"
        local_in = [[pieces[i][r].clone().requires_grad_(diff[i]) for i in range(len(full))] for r in range(n)]
        calls = [substitute_operands(node, args, kwargs, local_in[r]) for r in range(n)]
        try:
            outs = [output_tensors(_run_local(node, s, calls, r, full, n)) for r in range(n)]
        except RuntimeError as e:
            raise AssertionError(f"{tag}: the local op fails: {e}") from e
        _check_outputs(op, tag, s, outs, ref_out, close)
        for i in mutated if writes else ():
            got = _assemble(f"{tag} operand {i}", [local_in[r][i] for r in range(n)], s.inputs[i], False, close)
            close(got, ref_in[i], f"{tag}: operand {i} written in place differs from the unsharded op")
        if grads:
            _check_grads(tag, s, outs, out_grads, local_in, diff, want_in_grads, n, gen, close)
        report.checked.append(s)
    return report


def _check_well_formed(op, strategies: list[Strategy1D], ins: list[torch.Tensor], outs: list[torch.Tensor]):
    """Lowerings are registered (``passes/cost/lowerings.py``); shard dims exist on the tensor they split."""
    for s in strategies:
        if s.lowering is not None and s.lowering not in LOWERINGS:
            raise AssertionError(f"{op} strategy {s}: lowering {s.lowering!r} is not registered in passes/cost/lowerings.py")
        for what, pls, ts in (("operand", s.inputs, ins), ("output", s.outputs, outs)):
            for i, (p, t) in enumerate(zip(pls, ts)):
                if isinstance(p, Shard) and not 0 <= p.dim < t.dim():
                    raise AssertionError(f"{op} strategy {s}: {what} {i} has {t.dim()} dims, cannot be {p}")


def _accepts_grad(node, args, kwargs, full, i) -> bool:
    """Whether the op is differentiable in operand i (batch norm refuses grad on its running stats)."""
    vals = [t.clone().requires_grad_(j == i) for j, t in enumerate(full)]
    a, k = substitute_operands(node, args, kwargs, vals)
    try:
        node.target(*a, **k)
    except RuntimeError as e:
        if "not differentiable" in str(e):
            return False
        raise
    return True


def _check_outputs(op, tag, s: Strategy1D, outs, ref_out, close) -> None:
    for j, (p, want) in enumerate(zip(s.outputs, ref_out)):
        pieces = [o[j] for o in outs]
        if op in SHAPE_ONLY:  # random or uninitialised values: only the reassembled shape counts
            got = _assemble(f"{tag} output {j}", pieces, Partial() if isinstance(p, Replicate) else p, False, close)
            if got.shape != want.shape:
                raise AssertionError(f"{tag}: output {j} has shape {tuple(got.shape)}, want {tuple(want.shape)}")
        else:
            got = _assemble(f"{tag} output {j}", pieces, p, False, close)
            close(got, want, f"{tag}: output {j} ({p}) differs from the unsharded op")


def _grads(outs, out_grads, ins, diff) -> list[Optional[torch.Tensor]]:
    pairs = [(o, g) for o, g in zip(outs, out_grads) if g is not None and o.requires_grad]
    want = [t for t, d in zip(ins, diff) if d]
    if not pairs or not want:
        return [None] * len(ins)
    got = iter(torch.autograd.grad([o for o, _ in pairs], want, [g for _, g in pairs], allow_unused=True,
                                   retain_graph=True))
    return [(next(got) if d else None) for d in diff]


def _check_grads(tag, s, outs, out_grads, local_in, diff, want, n, gen, close):
    per_rank_out_grads: list[list] = [[] for _ in range(n)]
    for j, (p, g) in enumerate(zip(s.outputs, out_grads)):
        if g is None:
            split = [None] * n
        elif isinstance(p, Shard):
            split = [c.contiguous() for c in torch.chunk(g, n, p.dim)]
        elif isinstance(p, Partial):  # gradient of a P value is R
            split = [g.clone() for _ in range(n)]
        else:  # gradient of an R value is P
            split = _split(g, Partial(), n, gen)
        for r in range(n):
            per_rank_out_grads[r].append(split[r])
    local = [_grads(outs[r], per_rank_out_grads[r], local_in[r], diff) for r in range(n)]
    for i, w in enumerate(want):
        if not diff[i]:
            continue
        pieces = [loc[i] if loc[i] is not None else torch.zeros_like(local_in[r][i])
                  for r, loc in enumerate(local)]
        got = _assemble(f"{tag} grad of operand {i}", pieces, s.inputs[i], True, close)
        close(got, w if w is not None else torch.zeros_like(got),
              f"{tag}: gradient of operand {i} ({s.inputs[i]}) differs from the unsharded op")
