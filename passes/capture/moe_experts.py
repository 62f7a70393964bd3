"""Mixture-of-experts layers as one op: ``autoshard::moe_experts``, and the capture step that emits it.

Token-choice top-k MoE layers (Mixtral, Qwen2-MoE, DeepSeek-V3 as ``transformers`` 5.x writes them)
route each token to ``k`` of ``E`` experts in a router of ordinary ops (softmax / sigmoid, ``topk``,
renormalisation: the router stays in the graph, sharded by the ordinary rules), then call an
*experts* module ``experts(hidden (T, H), top_k_index (T, k), top_k_weights (T, k)) -> (T, H)`` whose
stacked weights are ``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H, I)``. Its implementations
either loop over the hit experts with data-dependent control flow ("eager", which ``torch.export``
cannot trace) or sort the (token, expert) pairs and run grouped GEMMs over data-dependent offsets
("grouped_mm"). Neither exposes what expert parallelism needs: which tokens go to which expert.

While capturing, ``fused_experts(model)`` swaps the forward of every experts module it recognises
for one call of the custom op

    moe_experts(hidden, top_k_index, top_k_weights, gate, up, down, activation, capacity_factor) -> (T, H)
    out[t] = sum_j w[t, j] * down[e] @ (act(gate[e] @ hidden[t]) * (up[e] @ hidden[t])),  e = index[t, j]

with ``gate``/``up`` the two halves of ``gate_up_proj`` (``aten.slice`` nodes in the graph, so the
stored parameter keeps its layout) and ``down`` as stored; all three in ``nn.Linear`` layout
``(E, out, in)``. The sharding rule (``passes/sharding/rules/moe.py``) then offers data parallel,
tensor parallel inside the experts (the ``I`` dim), and expert parallel (the ``E`` dim, tokens moved
by all-to-all: the ``expert_dispatch`` lowering, ``runtime/moe_dispatch.py``).

Recognised: ``transformers``' ``use_experts_implementation`` classes with concatenated gate/up, no
bias, no post-expert norm, the default gate (``act(gate) * up``) with SiLU or GELU, under the
"eager" or "grouped_mm" implementation. Anything else (``batched_mm``, biases, transposed weights),
and a module with ``autoshard_fuse = False``, is traced as written. By default the op computes every
routed pair exactly: no capacity, no dropped token.

Capacity factor (static shapes, for compilers and CUDA graphs): ``set_moe_capacity_factor(model, 1.25)``
before capturing gives each MoE layer ``capacity_factor`` = 1.25; then every expert computes exactly
``C = ceil(factor * pairs / E)`` rows per dispatching group (zero-padded; pairs beyond ``C`` for one
expert, in token order, are dropped, as GShard and Switch do), where a group is what one op call
sees: the whole batch on one device, a rank's tokens under data or expert parallel. With ``C`` at
least every expert's load, nothing drops and the result equals the exact one.

``experts_forward`` is the reference computation, used by the op's eager kernel and by the runtime
on each rank's local experts. The op's backward recomputes it under autograd (correct, one more
forward of the experts per step; the planner's cost prices the usual 2x-forward backward).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.fx as fx
import torch.nn.functional as F

__all__ = ["is_moe_node", "moe_nodes", "capacity_factor_of", "moe_experts", "experts_forward", "experts_forward_capacity", "capacity_rows", "pair_slots",
           "expert_gemms", "scatter_rows", "gather_rows", "ACTIVATIONS", "CAPACITY_ATTR", "fused_experts",
           "set_moe_capacity_factor", "recognised_activation", "is_fusable_experts"]

#: module attribute ``set_moe_capacity_factor`` writes and ``fused_experts`` reads
CAPACITY_ATTR = "autoshard_capacity_factor"

#: activation name (the op's ``activation`` argument) -> function
ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def experts_forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: Optional[torch.Tensor],
                    gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, activation: str,
                    first_expert: int = 0) -> torch.Tensor:
    """Sum over each token's routed experts held here (experts ``first_expert .. first_expert + E_local``).

    ``top_k_index`` (T, k) global expert ids (ids outside the local range contribute nothing);
    ``top_k_weights`` (T, k) routing weights, or None for the unweighted expert output (then k must
    be 1: the runtime's dispatched rows). Differentiable in ``hidden``, ``top_k_weights`` and the
    weights; the result has ``hidden``'s dtype.
    """
    act = ACTIVATIONS[activation]
    tokens, k = top_k_index.shape
    out = hidden.new_zeros(hidden.shape[0], down.shape[1], dtype=torch.promote_types(hidden.dtype, down.dtype))
    flat = top_k_index.reshape(-1)
    for local in range(gate.shape[0]):
        pairs = (flat == first_expert + local).nonzero().squeeze(1)
        if pairs.numel() == 0:
            continue
        rows = pairs // k
        x = hidden[rows].to(gate.dtype)
        y = F.linear(act(F.linear(x, gate[local])) * F.linear(x, up[local]), down[local])
        if top_k_weights is not None:
            y = y * top_k_weights.reshape(-1)[pairs].unsqueeze(-1).to(y.dtype)
        out = out.index_add(0, rows, y.to(out.dtype))
    return out.to(hidden.dtype)


def capacity_rows(pairs: int, experts: int, capacity_factor: float) -> int:
    """Rows each expert gets from one dispatching group of ``pairs`` routed pairs:
    ``ceil(capacity_factor * pairs / experts)``."""
    return max(1, math.ceil(capacity_factor * pairs / experts))


def pair_slots(bucket: torch.Tensor, buckets: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot, kept) of each pair: pair ``p`` is the ``i``-th of its bucket in pair order; it keeps slot
    ``bucket * capacity + i`` when ``i < capacity``, else it is dropped (slot ``buckets * capacity``,
    a spare row). ``bucket == buckets`` marks pairs that belong to no bucket here (never kept)."""
    with torch.no_grad():
        order = torch.sort(bucket, stable=True).indices
        counts = torch.bincount(bucket, minlength=buckets + 1)
        starts = counts.cumsum(0) - counts
        sorted_pos = torch.arange(bucket.numel(), device=bucket.device) - starts[bucket[order]]
        pos = torch.empty_like(sorted_pos).scatter_(0, order, sorted_pos)
        kept = (pos < capacity) & (bucket < buckets)
        slot = torch.where(kept, bucket * capacity + pos, torch.full_like(pos, buckets * capacity))
    return slot, kept


def expert_gemms(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                 activation: str) -> torch.Tensor:
    """``(E, C, H)`` rows through their experts: ``down @ (act(gate @ x) * (up @ x))``, batched over E."""
    act = ACTIVATIONS[activation]
    x = x.to(gate.dtype)
    return torch.bmm(act(torch.bmm(x, gate.transpose(1, 2))) * torch.bmm(x, up.transpose(1, 2)),
                     down.transpose(1, 2))


def scatter_rows(rows: torch.Tensor, slot: torch.Tensor, kept: torch.Tensor, slots: int) -> torch.Tensor:
    """A ``(slots, H)`` buffer holding each kept pair's row at its slot (zeros elsewhere)."""
    buf = rows.new_zeros((slots + 1,) + tuple(rows.shape[1:]))
    return buf.index_put((slot,), rows * kept.unsqueeze(-1).to(rows.dtype), accumulate=True)[:slots]


def gather_rows(buf: torch.Tensor, slot: torch.Tensor, kept: torch.Tensor, weights: torch.Tensor,
                tokens: int, k: int) -> torch.Tensor:
    """``(T, H)``: each token's kept pairs' rows from ``buf`` (by slot) times their weights, summed."""
    spare = torch.cat([buf, buf.new_zeros((1,) + tuple(buf.shape[1:]))])
    scale = (weights.reshape(-1).to(buf.dtype) * kept.to(buf.dtype)).unsqueeze(-1)
    return (spare[slot] * scale).view(tokens, k, -1).sum(1)


def experts_forward_capacity(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                             gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, activation: str,
                             first_expert: int, capacity: int) -> torch.Tensor:
    """``experts_forward`` with static shapes: each local expert computes exactly ``capacity`` rows
    (padded with zeros); a pair beyond its expert's capacity (in token order) is dropped."""
    tokens, k = top_k_index.shape
    local_experts = gate.shape[0]
    local = top_k_index.reshape(-1) - first_expert
    here = (local >= 0) & (local < local_experts)
    slot, kept = pair_slots(torch.where(here, local, torch.full_like(local, local_experts)), local_experts, capacity)
    rows = scatter_rows(hidden.repeat_interleave(k, 0), slot, kept, local_experts * capacity)
    out = expert_gemms(rows.view(local_experts, capacity, -1), gate, up, down, activation)
    return gather_rows(out.reshape(local_experts * capacity, -1), slot, kept, top_k_weights, tokens, k).to(hidden.dtype)


def _forward(hidden, index, weights, gate, up, down, activation, capacity_factor):
    if capacity_factor > 0:
        capacity = capacity_rows(index.numel(), gate.shape[0], capacity_factor)
        return experts_forward_capacity(hidden, index, weights, gate, up, down, activation, 0, capacity)
    return experts_forward(hidden, index, weights, gate, up, down, activation)


@torch.library.custom_op("autoshard::moe_experts", mutates_args=())
def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, activation: str,
                capacity_factor: float = 0.0) -> torch.Tensor:
    """Token-choice top-k experts (see the module docstring): ``(T, H)`` from ``hidden (T, H)``.
    ``capacity_factor`` > 0: the static-shape formulation (``experts_forward_capacity``) with
    ``capacity_rows(T * k, E, capacity_factor)`` rows per expert; 0: every pair computed."""
    return _forward(hidden, top_k_index, top_k_weights, gate, up, down, activation, capacity_factor)


@moe_experts.register_fake
def _moe_experts_fake(hidden, top_k_index, top_k_weights, gate, up, down, activation, capacity_factor=0.0):
    return hidden.new_empty(hidden.shape[0], down.shape[1])


def _setup(ctx, inputs, output):
    hidden, index, weights, gate, up, down, activation, capacity_factor = inputs
    ctx.options = (activation, capacity_factor)
    ctx.save_for_backward(hidden, index, weights, gate, up, down)


def _backward(ctx, grad):
    hidden, index, weights, gate, up, down = ctx.saved_tensors
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in (hidden, weights, gate, up, down)]
    wanted = [t for t in leaves if t.requires_grad]
    grads = iter(())
    if wanted:
        with torch.enable_grad():
            out = _forward(leaves[0], index, leaves[1], *leaves[2:], *ctx.options)
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
    g = [next(grads) if t.requires_grad else None for t in leaves]
    return g[0], None, g[1], g[2], g[3], g[4], None, None


moe_experts.register_autograd(_backward, setup_context=_setup)


# ---- recognising transformers' experts modules ---------------------------------------------------

def recognised_activation(act: nn.Module) -> Optional[str]:
    """The ``ACTIVATIONS`` name ``act`` computes (checked numerically on a probe), else None."""
    probe = torch.linspace(-4, 4, 33)
    try:
        with torch.no_grad():
            got = act(probe)
    except Exception:  # noqa: BLE001 - an activation we cannot probe is simply not recognised
        return None
    for name, fn in ACTIVATIONS.items():
        if torch.allclose(got, fn(probe), atol=1e-6):
            return name
    return None


def is_fusable_experts(module: nn.Module) -> Optional[str]:
    """The activation name if ``module`` is an experts module ``fused_experts`` rewrites, else None."""
    if getattr(module, "autoshard_fuse", True) is False:
        return None
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if not (isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)):
        return None
    if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[1] != 2 * down.shape[2]:
        return None
    flags = (getattr(module, "has_gate", None), getattr(module, "has_bias", True),
             getattr(module, "has_post_expert_norm", True), getattr(module, "is_transposed", True),
             getattr(module, "is_concatenated", False))
    if flags != (True, False, False, False, True):
        return None
    apply_gate = getattr(type(module), "_apply_gate", None)
    if getattr(apply_gate, "__name__", None) != "_default_apply_gate":
        return None
    impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
    if impl not in (None, "eager", "grouped_mm"):
        return None
    act = getattr(module, "act_fn", None)
    return recognised_activation(act) if isinstance(act, nn.Module) else None


def _fused_forward(module: nn.Module, activation: str):
    factor = float(getattr(module, CAPACITY_ATTR, 0.0) or 0.0)

    def forward(hidden_states, top_k_index, top_k_weights):
        inter = module.down_proj.shape[2]
        gate, up = module.gate_up_proj[:, :inter], module.gate_up_proj[:, inter:]
        return moe_experts(hidden_states, top_k_index, top_k_weights, gate, up, module.down_proj, activation, factor)
    return forward


def set_moe_capacity_factor(model: nn.Module, factor: Optional[float]) -> list[str]:
    """Give every recognised experts module of ``model`` a capacity factor (None or 0: none, every
    pair computed); returns their paths. Captures made afterwards carry it in their ``moe_experts``."""
    if factor is not None and not (isinstance(factor, (int, float)) and math.isfinite(factor) and factor >= 0):
        raise ValueError(f"capacity factor must be a finite number >= 0 (or None), got {factor!r}")
    found = []
    for path, module in model.named_modules():
        if is_fusable_experts(module) is not None:
            setattr(module, CAPACITY_ATTR, float(factor or 0.0))
            found.append(path)
    return found


@contextlib.contextmanager
def fused_experts(model: nn.Module) -> Iterator[list[str]]:
    """While open, every recognised experts module of ``model`` runs as one ``moe_experts`` call;
    yields their module paths. The modules' own ``forward`` is restored on exit."""
    patched = []
    try:
        for path, module in model.named_modules():
            activation = is_fusable_experts(module)
            if activation is None:
                continue
            had = "forward" in module.__dict__
            patched.append((path, module, module.__dict__.get("forward"), had))
            module.forward = _fused_forward(module, activation)
        yield [p for p, *_ in patched]
    finally:
        for _, module, old, had in patched:
            if had:
                module.forward = old
            else:
                del module.forward


def is_moe_node(node: fx.Node) -> bool:
    return node.op == "call_function" and str(node.target).startswith("autoshard.moe_experts")


def moe_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The ``moe_experts`` nodes of a program, in order (MoE layer ``i`` is the ``i``-th)."""
    return [n for n in gm.graph.nodes if is_moe_node(n)]


def capacity_factor_of(node: fx.Node) -> float:
    """The ``capacity_factor`` argument of a ``moe_experts`` node (0: none, every pair computed)."""
    value = node.args[7] if len(node.args) > 7 else node.kwargs.get("capacity_factor", 0.0)
    return float(value or 0.0)
