"""Rule numerics: check every strategy a sharding rule claims against the unsharded op.

The one harness for every rule family. A check traces a tiny function with ``torch.export`` (so
arguments look exactly as in the captured IR; ``op_calls``), asks the registry for a node's
strategies and simulates ``n`` ranks in one process for each of them (``rank_simulation``)::

    report = check_rule_numerics(F.linear, (x, w, b), n=2)          # the last op of the trace
    assert "(S(0), R, R)->(S(0))" in report.checked_str

    gm, calls = trace_calls(fn, (x, y))                               # every op of the trace
    reports = [check_node(node, args, kwargs, n=4) for node, (args, kwargs) in calls.items()]

Checking a ``Strategy1D`` (placements per operand and output along one mesh axis of size n):

- split each operand by its placement, run the op (or the strategy's lowering) on each rank's
  pieces, reassemble each output by its placement (``rank_simulation`` says how) and compare with
  the unsharded op; operands the op writes in place (batch-norm running stats) are reassembled and
  compared the same way. Random and uninitialised outputs (``rand_like``, ``empty_like``,
  ``new_empty``, ...) are compared by shape only (``SHAPE_ONLY``);
- gradients, by the convention of ``passes/spec.py``: the upstream gradient of an ``S`` output
  is its shard, of a ``P`` output the full gradient on every rank, of an ``R`` output random
  summands; the local gradient of an ``S`` operand must cat to the true gradient, of an ``R``
  operand sum to it, of a ``P`` operand equal it on every rank;
- every lowering a strategy names is registered (``passes/cost/lowerings.py``), and every shard dim
  exists on the tensor it splits.

Strategies with the lowering "batch_norm_sync", "expert_dispatch[_capacity]" or "ring_attention" are
skipped here (their math needs collectives; the runtime tests them on real ranks); so are strategies
whose sharded dims (of an operand or an output) do not divide by ``n``, and those the rule's
``LocalCheck`` refuses for the pieces on ``n`` ranks. All land in ``RuleCheck.skipped`` with the
reason.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

from autoshard.passes.cost.lowerings import LOWERINGS
from autoshard.passes.sharding.rules import local_check, op_call, rule_strategies
from autoshard.passes.spec import Partial, Replicate, Shard, Strategy1D
from autoshard.testing.op_calls import (operand_values, output_tensors, record_calls, substitute_operands, trace_calls,
                                        trace_op)
from autoshard.testing.rank_simulation import (Indivisible, assemble, check_divides, inexact, piece_shape, run_local,
                                               split_by_placement)

__all__ = ["RuleCheck", "check_rule_numerics", "check_node", "trace_op", "trace_calls", "record_calls"]

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
    diff = [grads and inexact(t) and i not in mutated and op not in SHAPE_ONLY
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
        scale = max(1.0, want.abs().max().item()) if inexact(want) and want.numel() else 1.0
        ok = got.shape == want.shape and (
            torch.allclose(got, want, rtol=rtol, atol=atol * scale, equal_nan=True)
            if inexact(got) else torch.equal(got, want))
        if not ok:
            err = (got - want).abs().max().item() if got.shape == want.shape and inexact(got) else ""
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
                check_divides(o, p, n)
            pieces = [split_by_placement(t, p, n, gen) for t, p in zip(full, s.inputs)]
        except Indivisible as e:
            report.skipped.append((s, str(e)))
            continue
        if check is not None and not check(call, [tuple(p[0].shape) for p in pieces],
                                           [piece_shape(o, p, n) for o, p in zip(ref_out, s.outputs)]):
            report.skipped.append((s, f"the rule's local check refuses these pieces on {n} ranks"))
            continue
        tag = f"{node.format_node()} under {s} on {n} ranks"
        local_in = [[pieces[i][r].clone().requires_grad_(diff[i]) for i in range(len(full))] for r in range(n)]
        calls = [substitute_operands(node, args, kwargs, local_in[r]) for r in range(n)]
        try:
            outs = [output_tensors(run_local(node, s, calls, r, full, n)) for r in range(n)]
        except RuntimeError as e:
            raise AssertionError(f"{tag}: the local op fails: {e}") from e
        _check_outputs(op, tag, s, outs, ref_out, close)
        for i in mutated if writes else ():
            got = assemble(f"{tag} operand {i}", [local_in[r][i] for r in range(n)], s.inputs[i], False, close)
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
            got = assemble(f"{tag} output {j}", pieces, Partial() if isinstance(p, Replicate) else p, False, close)
            if got.shape != want.shape:
                raise AssertionError(f"{tag}: output {j} has shape {tuple(got.shape)}, want {tuple(want.shape)}")
        else:
            got = assemble(f"{tag} output {j}", pieces, p, False, close)
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
            split = split_by_placement(g, Partial(), n, gen)
        for r in range(n):
            per_rank_out_grads[r].append(split[r])
    local = [_grads(outs[r], per_rank_out_grads[r], local_in[r], diff) for r in range(n)]
    for i, w in enumerate(want):
        if not diff[i]:
            continue
        pieces = [loc[i] if loc[i] is not None else torch.zeros_like(local_in[r][i])
                  for r, loc in enumerate(local)]
        got = assemble(f"{tag} grad of operand {i}", pieces, s.inputs[i], True, close)
        close(got, w if w is not None else torch.zeros_like(got),
              f"{tag}: gradient of operand {i} ({s.inputs[i]}) differs from the unsharded op")
