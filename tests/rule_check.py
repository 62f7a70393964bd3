"""Rule numerics: check every strategy a sharding rule claims against the unsharded op.

One call traces a tiny function around the op, asks the registry for the node's strategies and
simulates ``n`` ranks in one process for each of them::

    report = check_rule_numerics(F.linear, (x, w, b), n=2)
    assert "(S(0), R, R)->(S(0))" in report.checked_str

Simulation of a ``Strategy1D`` (placements per operand and output along one mesh axis of size n):

- split each operand by its placement: ``S(d)`` -> ``torch.chunk`` along d, ``R`` -> the same
  tensor on every rank, ``P`` -> random summands that add up to the tensor;
- run the ATen op on each rank's pieces (other arguments unchanged), or the strategy's lowering
  written out inline below ("loss_mean_partial", "embedding_vocab", "mean_partial");
- reassemble each output by its placement (``S``: cat, ``R``: every rank must agree, ``P``: sum)
  and compare with the unsharded op; operands the op writes in place (batch-norm running stats)
  are reassembled and compared the same way;
- gradients, by the convention of ``passes/spec.py``: the upstream gradient of an ``S`` output
  is its shard, of a ``P`` output the full gradient on every rank, of an ``R`` output random
  summands; the local gradient of an ``S`` operand must cat to the true gradient, of an ``R``
  operand sum to it, of a ``P`` operand equal it on every rank.

Strategies with the lowering "batch_norm_sync" are skipped here (its math needs collectives; the
runtime tests it on real ranks); so are strategies whose sharded dims do not divide by ``n``.
Both land in ``RuleCheck.skipped`` with the reason.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from autoshard.passes.graph import META, is_getitem, tensor_meta_of
from autoshard.passes.sharding.rules import rule_strategies
from autoshard.passes.spec import LOWERINGS, Partial, Placement, Replicate, Shard, Strategy1D, TensorMeta

__all__ = ["RuleCheck", "check_rule_numerics", "trace_op"]


@dataclass
class RuleCheck:
    """What ``check_rule_numerics`` did: the node, every strategy, which were checked or skipped."""
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

def trace_op(fn: Callable, args: Sequence, kwargs: Optional[dict] = None, target: Any = None):
    """Export ``fn(*args, **kwargs)`` and return ``(node, real_args, real_kwargs)`` for its op.

    The op node is the last call_function that is not a getitem, or the last one whose target is
    ``target``. Every node gets ``node.meta["autoshard.meta"]`` from its traced value; the real
    arguments are the values the node saw when the program ran on ``args`` (cloned).
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

    inputs = tuple(flat[i].clone() for i in tensor_pos)
    ep = torch.export.export(Wrapper(), inputs, strict=False)
    gm = ep.graph_module
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and not is_getitem(n)
             and (target is None or n.target == target)]
    if not calls:
        raise AssertionError(f"no call to {target or 'any op'} in the traced graph:\n{gm.graph}")
    node = calls[-1]
    for n in gm.graph.nodes:
        n.meta[META] = tensor_meta_of(n.meta.get("val"))

    captured: dict = {}

    class Recorder(fx.Interpreter):
        def run_node(self, n):
            if n is node:
                a, k = self.fetch_args_kwargs_from_env(n)
                captured["args"], captured["kwargs"] = clone_values(a), clone_values(k)
            return super().run_node(n)

    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(inputs):
        raise AssertionError("trace_op: pass every tensor as an argument (the op must not create constants)")
    Recorder(gm, garbage_collect_values=False).run(*[t.clone() for t in inputs])
    return node, captured["args"], captured["kwargs"]


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

def _bind(target, args, kwargs) -> dict:
    out = {}
    for i, a in enumerate(target._schema.arguments):
        if i < len(args) and not a.kwarg_only:
            out[a.name] = args[i]
        elif a.name in kwargs:
            out[a.name] = kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _set_arg(target, args, kwargs, name, value):
    args, kwargs = list(args), dict(kwargs)
    for i, a in enumerate(target._schema.arguments):
        if a.name == name:
            if i < len(args) and not a.kwarg_only:
                args[i] = value
            else:
                kwargs[name] = value
            return tuple(args), kwargs
    raise KeyError(name)


_CLASS_LOSSES = {"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d", "nll_loss_forward",
                 "nll_loss2d_forward"}


def _loss_count(target, args, kwargs) -> torch.Tensor:
    """How many elements (or how much class weight) a mean-reduced loss divides by, locally."""
    b = _bind(target, args, kwargs)
    inp, tgt = b["self"], b["target"]
    if target._schema.name.split("::")[-1] in _CLASS_LOSSES:
        if tgt.is_floating_point():  # class probabilities: mean over the batch elements
            return torch.tensor(inp.numel() / inp.shape[1 if inp.dim() > 1 else 0])
        mask = tgt != b.get("ignore_index", -100)
        w = b.get("weight")
        return mask.sum() if w is None else w.detach()[tgt[mask]].sum()
    return torch.tensor(math.prod(torch.broadcast_shapes(inp.shape, tgt.shape)))


def _sim_loss_mean_partial(target, calls, rank):
    total = sum(_loss_count(target, a, k) for a, k in calls)
    args, kwargs = _set_arg(target, *calls[rank], "reduction", 2)
    res = target(*args, **kwargs)
    if isinstance(res, tuple):
        return (res[0] / total, *res[1:])
    return res / total


def _sim_embedding_vocab(target, calls, rank):
    args, kwargs = calls[rank]
    b = _bind(target, args, kwargs)
    weight, idx = b["weight"], b["indices"]
    lo = sum(_bind(target, *calls[q])["weight"].shape[0] for q in range(rank))
    rows = weight.shape[0]
    mask = (idx >= lo) & (idx < lo + rows)
    pad = b.get("padding_idx", -1)
    local_pad = pad - lo if pad is not None and lo <= pad < lo + rows else -1
    args, kwargs = _set_arg(target, args, kwargs, "indices", torch.where(mask, idx - lo, 0))
    args, kwargs = _set_arg(target, args, kwargs, "padding_idx", local_pad)
    return target(*args, **kwargs) * mask.unsqueeze(-1).to(weight.dtype)


def _reduced_count(shape, dims) -> int:
    if dims is None or len(dims) == 0:
        return math.prod(shape)
    return math.prod(shape[d % len(shape)] for d in dims)


def _sim_mean_partial(target, calls, rank, full_shape):
    args, kwargs = calls[rank]
    b = _bind(target, args, kwargs)
    dims = b.get("dim")
    local = _reduced_count(b["self"].shape, dims)
    return target(*args, **kwargs) * (local / _reduced_count(full_shape, dims))


# ---------------------------------------------------------------- simulation

def _split(x: torch.Tensor, p: Placement, n: int, gen: torch.Generator) -> list[torch.Tensor]:
    if isinstance(p, Shard):
        if x.shape[p.dim] % n:
            raise _Indivisible(f"dim {p.dim} of size {x.shape[p.dim]} does not divide by {n}")
        return [c.contiguous() for c in torch.chunk(x, n, p.dim)]
    if isinstance(p, Partial):
        if not x.is_floating_point():
            raise AssertionError(f"P placement on a {x.dtype} operand")
        parts = [torch.randn(x.shape, generator=gen, dtype=x.dtype) for _ in range(n - 1)]
        return parts + [x - sum(parts)] if parts else [x.clone()]
    return [x.clone() for _ in range(n)]


class _Indivisible(Exception):
    pass


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
    """Check every strategy the registry gives the op that ``fn(*args, **kwargs)`` calls.

    Raises ``AssertionError`` naming the op, the strategy and the value that differs.
    """
    node, real_args, real_kwargs = trace_op(fn, args, kwargs or {}, target)
    strategies, has_rule = rule_strategies(node)
    if not has_rule:
        raise AssertionError(f"no sharding rule registered for {node.target}")
    op = node.target
    full = operand_values(node, real_args, real_kwargs)
    gen = torch.Generator().manual_seed(seed)

    def close(got, want, msg):
        got, want = got.detach(), want.detach()
        ok = got.shape == want.shape and (
            torch.allclose(got, want, rtol=rtol, atol=atol, equal_nan=True)
            if got.is_floating_point() else torch.equal(got, want))
        if not ok:
            err = (got - want).abs().max().item() if got.shape == want.shape and got.is_floating_point() else ""
            raise AssertionError(f"{op} {msg} (got shape {tuple(got.shape)}, want {tuple(want.shape)}) {err}")

    # Reference run; operands the op writes in place are not differentiable leaves.
    probe = [t.clone() for t in full]
    a, k = substitute_operands(node, real_args, real_kwargs, probe)
    op(*a, **k)
    mutated = [i for i, (before, after) in enumerate(zip(full, probe)) if not torch.equal(before, after)]
    diff = [grads and t.is_floating_point() and i not in mutated
            and _accepts_grad(node, real_args, real_kwargs, full, i) for i, t in enumerate(full)]
    ref_in = [t.clone().requires_grad_(d) for t, d in zip(full, diff)]
    a, k = substitute_operands(node, real_args, real_kwargs, ref_in)
    ref_out = output_tensors(op(*a, **k))
    if len(ref_out) != len(strategies[0].outputs):
        raise AssertionError(f"{op}: ran to {len(ref_out)} tensor outputs, meta says {len(strategies[0].outputs)}")
    _check_well_formed(op, strategies, full, ref_out)
    out_grads = [torch.randn(o.shape, generator=gen, dtype=o.dtype) if o.requires_grad else None for o in ref_out]
    want_in_grads = _grads(ref_out, out_grads, ref_in, diff)

    report = RuleCheck(node, strategies)
    for s in strategies:
        if s.lowering == "batch_norm_sync":
            report.skipped.append((s, "batch_norm_sync needs collectives; tested by the runtime on real ranks"))
            continue
        try:
            pieces = [_split(t, p, n, gen) for t, p in zip(full, s.inputs)]
        except _Indivisible as e:
            report.skipped.append((s, str(e)))
            continue
        local_in = [[pieces[i][r].clone().requires_grad_(diff[i]) for i in range(len(full))] for r in range(n)]
        calls = [substitute_operands(node, real_args, real_kwargs, local_in[r]) for r in range(n)]
        outs = [output_tensors(_run_local(op, s.lowering, calls, r, full)) for r in range(n)]
        tag = f"strategy {s}"
        for j, (p, want) in enumerate(zip(s.outputs, ref_out)):
            got = _assemble(f"{tag} output {j}", [o[j] for o in outs], p, False, close)
            close(got, want, f"{tag}: output {j} ({p}) differs from the unsharded op")
        for i in mutated:
            got = _assemble(f"{tag} operand {i}", [local_in[r][i] for r in range(n)], s.inputs[i], False, close)
            close(got, ref_in[i], f"{tag}: operand {i} written in place differs from the unsharded op")
        if grads:
            _check_grads(tag, s, outs, out_grads, local_in, diff, want_in_grads, n, gen, close)
        report.checked.append(s)
    return report


def _check_well_formed(op, strategies: list[Strategy1D], ins: list[torch.Tensor], outs: list[torch.Tensor]):
    """Lowerings come from spec.LOWERINGS; shard dims exist on the tensor they split."""
    for s in strategies:
        if s.lowering is not None and s.lowering not in LOWERINGS:
            raise AssertionError(f"{op} strategy {s}: lowering {s.lowering!r} is not in spec.LOWERINGS")
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


def _run_local(op, lowering, calls, rank, full):
    args, kwargs = calls[rank]
    if lowering is None:
        return op(*args, **kwargs)
    if lowering == "loss_mean_partial":
        return _sim_loss_mean_partial(op, calls, rank)
    if lowering == "embedding_vocab":
        return _sim_embedding_vocab(op, calls, rank)
    if lowering == "mean_partial":
        return _sim_mean_partial(op, calls, rank, full[0].shape)
    raise AssertionError(f"{op}: no simulation of lowering {lowering!r} in tests/rule_check.py")


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
