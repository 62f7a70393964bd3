"""Shared by the memory-lever tests (tests/runtime/test_memory_levers.py and its neighbours): the
models (GPT, HF Llama, a CNN whose numbered blocks hold BatchNorm and dropout) with a batch maker,
the layouts (ZeRO-3 storage of data parallel or DP x Megatron TP) and the one-device comparison."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

STEPS = 3
RTOL, ATOL = 1e-4, 2e-5
ADAM_EPS = 1e-6
MICRO = 8  # every program is traced at this (micro)batch; the global batch is MICRO * accumulation


class ConvBlock(nn.Module):
    def __init__(self, channels: int, p: float):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        return x + self.drop(F.relu(self.bn(self.conv(x))))


class BlockCNN(nn.Module):
    """stem conv -> 2 residual blocks (conv, BatchNorm, ReLU, dropout) -> pool -> linear."""

    def __init__(self, p: float = 0.0, channels: int = 8):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(channels, p) for _ in range(2))
        self.fc = nn.Linear(channels * 4 * 4, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.fc(torch.flatten(F.max_pool2d(x, 2), 1))


def build(name: str, dropout: float = 0.0):
    """(model, batch(n, seed) -> (inputs, target), loss_fn, Megatron layers (column, row))."""
    from models import _cross_entropy, gpt, hf_llama
    if name == "gpt":
        model = gpt()[0]
        layers = ([f"blocks.{i}.{n}" for i in range(2) for n in ("q", "k", "v", "fc")],
                  [f"blocks.{i}.{n}" for i in range(2) for n in ("o", "out")])
    elif name == "hf_llama":
        model = hf_llama()[0]
        layers = ([f"model.layers.{i}.{n}" for i in range(2) for n in
                   ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")],
                  [f"model.layers.{i}.{n}" for i in range(2) for n in ("self_attn.o_proj", "mlp.down_proj")])
    else:
        model, layers = BlockCNN(dropout), None

    def batch(n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        if name == "cnn":
            return (torch.randn(n, 3, 8, 8, generator=g),), torch.randint(0, 10, (n,), generator=g)
        ids, target = torch.randint(0, 64, (n, 16), generator=g), torch.randint(0, 64, (n, 16), generator=g)
        return ({"input_ids": ids} if name == "hf_llama" else (ids,)), target

    return model, batch, _cross_entropy, layers


def _call(model, inputs):
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    return out.logits if hasattr(out, "logits") else out


def _cut(inputs, k: int, j: int):
    if isinstance(inputs, dict):
        return {n: x.chunk(k)[j] for n, x in inputs.items()}
    return tuple(x.chunk(k)[j] for x in inputs)


def _ref_step(ref, inputs, target, loss_fn, k: int) -> float:
    """One device, the same accumulation: k microbatches, each loss / k."""
    total = 0.0
    for j in range(k):
        loss = loss_fn(_call(ref, _cut(inputs, k, j)), target.chunk(k)[j]) / k
        loss.backward()
        total += loss.item()
    return total


# ---- layouts ------------------------------------------------------------------------------------

def zero3(captured, strategies: dict, mesh_shape) -> dict:
    """``strategies`` with every parameter's storage sharded on each axis where it was replicated
    (a dim not sharded by another axis when one divides), so its ops gather it: ZeRO-3."""
    from autoshard.passes.graph import META
    from autoshard.passes.spec import Replicate, Shard, Strategy
    out = dict(strategies)
    for ph in captured.params:
        st = strategies[ph]
        storage = list(st.outputs[0])
        local = list(captured.node(ph).meta[META].shape)
        for a, p in enumerate(storage):
            if isinstance(p, Shard):
                local[p.dim] //= mesh_shape[a]
        for a, p in enumerate(storage):
            if not isinstance(p, Replicate) or mesh_shape[a] == 1:
                continue
            used = {q.dim for q in storage if isinstance(q, Shard)}
            dims = [d for d in range(len(local)) if local[d] % mesh_shape[a] == 0]
            dims = [d for d in dims if d not in used] or dims
            if dims:
                storage[a] = Shard(dims[0])
                local[dims[0]] //= mesh_shape[a]
        out[ph] = Strategy(st.inputs, (tuple(storage),), st.lowerings)
    return out


def layout_pins(model, mesh_shape, layers) -> dict:
    from autoshard import presets
    if len(mesh_shape) == 2 and layers is not None:
        return presets.megatron_mlp(model, layers[0], layers[1], mesh_shape)
    return presets.data_parallel(mesh_shape)


# ---- the one-device comparison -------------------------------------------------------------------

def _close(a, b) -> bool:
    return a.shape == b.shape and torch.allclose(a.float(), b.float(), rtol=RTOL, atol=ATOL)


def train_and_compare(case: str, step, params, state_fn, ref, batch, loss_fn, k: int, failures: list, *,
                      twice: bool = False) -> list:
    """3 steps of ``step(inputs, target) -> loss`` then AdamW on ``params``, against ``ref`` on one device
    doing the same accumulation (``k`` microbatches); ``twice``: each step runs twice on its batch before
    the optimizer (the second adds to the gradients the first left). Appends what differs to
    ``failures`` (the loss at every step, every parameter and buffer at the end); returns the losses."""
    opt = torch.optim.AdamW(params, lr=1e-3, eps=ADAM_EPS)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=ADAM_EPS)
    losses = []
    for n in range(STEPS):
        inputs, target = batch(MICRO * k, 100 + n)
        got = step(inputs, target)
        want = _ref_step(ref, inputs, target, loss_fn, k)
        if twice:
            step(inputs, target)
            _ref_step(ref, inputs, target, loss_fn, k)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        losses.append(got)
        if not abs(got - want) <= ATOL + RTOL * abs(want):
            failures.append(f"{case}: loss at step {n} is {got:.7f}, one device gives {want:.7f}")
            return losses
    full = state_fn()
    for key, value in ref.state_dict().items():
        if key not in full:
            failures.append(f"{case}: full_state_dict lacks {key}")
        elif not _close(full[key], value):
            err = (full[key].float() - value.float()).abs().max().item() if full[key].shape == value.shape else "shape"
            failures.append(f"{case}: {key} differs from one device after {STEPS} steps (max err {err})")
    return losses


def rank_step(rp, inputs, target) -> float:
    """``rp.step`` (a RankProgram) on a batch given as a tuple or as keyword tensors."""
    if isinstance(inputs, dict):
        order = [n for n in rp.captured.inputs if n != rp.captured.target]
        inputs = tuple(inputs[n] for n in order)
    return rp.step(*inputs, target=target)


def planned(captured, model, mesh_shape, layers, rank: int, env):
    """The layout's strategies on every rank: rank 0 plans (DP, or DP x Megatron TP on 2-D meshes) and
    broadcasts; then ZeRO-3 storage."""
    from autoshard.api import plan_captured
    from autoshard.passes.mesh import Mesh
    from autoshard.plans import Plan
    from autoshard.runtime.groups import broadcast_json
    mesh = Mesh.of(mesh_shape)
    payload = None
    if rank == 0:
        payload = plan_captured(captured, mesh, hardware="cpu", time_limit_s=20,
                                pins=layout_pins(model, mesh_shape, layers)).to_json()
    plan = Plan.from_json(broadcast_json(payload, src=0, env=env)).attach(captured, mesh)
    return zero3(captured, plan.solution.strategies, mesh_shape)
