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

    moe_experts(hidden, top_k_index, top_k_weights, gate, up, down, activation) -> (T, H)
    out[t] = sum_j w[t, j] * down[e] @ (act(gate[e] @ hidden[t]) * (up[e] @ hidden[t])),  e = index[t, j]

with ``gate``/``up`` the two halves of ``gate_up_proj`` (``aten.slice`` nodes in the graph, so the
stored parameter keeps its layout) and ``down`` as stored; all three in ``nn.Linear`` layout
``(E, out, in)``. The sharding rule (``passes/sharding/rules/moe.py``) then offers data parallel,
tensor parallel inside the experts (the ``I`` dim), and expert parallel (the ``E`` dim, tokens moved
by all-to-all: the ``expert_dispatch`` lowering, ``runtime/moe_dispatch.py``).

Recognised: ``transformers``' ``use_experts_implementation`` classes with concatenated gate/up, no
bias, no post-expert norm, the default gate (``act(gate) * up``) with SiLU or GELU, under the
"eager" or "grouped_mm" implementation. Anything else (``batched_mm``, biases, transposed weights)
is traced as written. The op computes every routed pair exactly: no capacity, no dropped token.

``experts_forward`` is the reference computation, used by the op's eager kernel and by the runtime
on each rank's local experts. The op's backward recomputes it under autograd (correct, one more
forward of the experts per step; the planner's cost prices the usual 2x-forward backward).
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["moe_experts", "experts_forward", "ACTIVATIONS", "fused_experts", "recognised_activation",
           "is_fusable_experts"]

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


@torch.library.custom_op("autoshard::moe_experts", mutates_args=())
def moe_experts(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, activation: str) -> torch.Tensor:
    """Token-choice top-k experts (see the module docstring): ``(T, H)`` from ``hidden (T, H)``."""
    return experts_forward(hidden, top_k_index, top_k_weights, gate, up, down, activation)


@moe_experts.register_fake
def _moe_experts_fake(hidden, top_k_index, top_k_weights, gate, up, down, activation):
    return hidden.new_empty(hidden.shape[0], down.shape[1])


def _setup(ctx, inputs, output):
    hidden, index, weights, gate, up, down, activation = inputs
    ctx.activation = activation
    ctx.save_for_backward(hidden, index, weights, gate, up, down)


def _backward(ctx, grad):
    hidden, index, weights, gate, up, down = ctx.saved_tensors
    leaves = [t.detach().requires_grad_(t.requires_grad) for t in (hidden, weights, gate, up, down)]
    wanted = [t for t in leaves if t.requires_grad]
    grads = iter(())
    if wanted:
        with torch.enable_grad():
            out = experts_forward(leaves[0], index, leaves[1], *leaves[2:], ctx.activation)
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
    g = [next(grads) if t.requires_grad else None for t in leaves]
    return g[0], None, g[1], g[2], g[3], g[4], None


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
    def forward(hidden_states, top_k_index, top_k_weights):
        inter = module.down_proj.shape[2]
        gate, up = module.gate_up_proj[:, :inter], module.gate_up_proj[:, inter:]
        return moe_experts(hidden_states, top_k_index, top_k_weights, gate, up, module.down_proj, activation)
    return forward


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
