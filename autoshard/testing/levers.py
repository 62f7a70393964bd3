"""Support for the memory-lever tests and benchmarks: models with a batch maker, ZeRO-3 layouts, the
one-device reference of gradient accumulation, and program wrappers.

- ``build(name, dropout=0.0)``: ``(model, batch, loss_fn, megatron_layers)`` for "gpt", "hf_llama" or
  "cnn" (``models.BlockCNN``: BatchNorm and dropout inside numbered blocks); ``batch(n, seed)`` gives
  ``(inputs, target)`` of n samples (inputs a tuple, or a dict for the HF model).
- ``zero3(captured, strategies, mesh_shape, axes=None)``: every parameter's storage sharded on each
  axis (of ``axes``) where it was replicated, its ops unchanged, so they gather it: FSDP's layout;
  ``zero3_plan(plan, axes=None)`` does it to a ``Plan`` (its parameter placements too).
- ``planned(captured, model, mesh_shape, layers, rank, env)``: rank 0 plans data parallel (DP x
  Megatron TP on a 2-D mesh with ``layers``) and broadcasts it; every rank returns its ZeRO-3 strategies.
- ``layouts(rank, models)``: per model (``build``'s, a Hugging Face zoo model ``"hf:opt"``,
  ``"hf:gpt_neox"``, ``"hf:gemma"``, or a held-out one of ``heldout_models``: ``"mid:llama"``, ...) and mesh, a ``Layout``: the model captured at ``MICRO`` samples,
  the rank's mesh env and its ``planned`` strategies (the one worker loop the lever and memory tests share;
  every model is captured before the first is yielded, and the plans are spread over the ranks,
  ``shared_work.spread_over_ranks``); ``layout_captures(models)`` captures them once for every rank
  (``run_ranks(..., prepare=)``, then ``layouts(rank, models, captures=)``);
  ``policy_levers(model_name, k, checkpoint, reshard)``: ``Levers`` with that policy on its block type.
- ``accumulated_loss(loss_fn, k, twice=False)``: the ``reference_loss`` for
  ``equivalence.train_against_one_device`` of one device doing the same accumulation: k microbatches,
  each forward on its own (BatchNorm statistics updated per microbatch), loss summed / k; ``twice``:
  the step runs twice on its batch (its value once, its gradient twice).
- ``Twice(program)``: each ``step`` runs twice before the optimizer (the second adds to the
  gradients the first left); ``Probed(program)``: its first ``step`` is measured by
  ``runtime.memory_probe.MemoryProbe`` (``.measured``: saved and gathered bytes).
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch

from autoshard.passes.graph import META
from autoshard.passes.levers import BlockPolicy, Levers
from autoshard.passes.spec import Replicate, Shard, Strategy
from autoshard.runtime.memory_probe import MemoryProbe

from .models import BlockCNN, gpt, hf_llama, hf_lm_loss, lm_loss

__all__ = ["MICRO", "BLOCK_TYPES", "build", "zero3", "zero3_plan", "layout_pins", "planned", "Layout", "layouts",
           "layout_captures",
           "block_type", "policy_levers", "accumulated_loss", "Twice", "Probed"]

MICRO = 8  # the (micro)batch programs are traced at; a global batch is MICRO * accumulation
#: each model's repeated-block type, the key of its per-block lever policy
BLOCK_TYPES = {"gpt": "blocks.#", "hf_llama": "model.layers.#", "cnn": "blocks.#"}
_ZOO_BLOCKS = {"hf:opt": "model.decoder.layers.#", "hf:gpt_neox": "gpt_neox.layers.#", "hf:gemma": "model.layers.#"}

_TP = {
    "gpt": ([f"blocks.{i}.{n}" for i in range(2) for n in ("q", "k", "v", "fc")],
            [f"blocks.{i}.{n}" for i in range(2) for n in ("o", "out")]),
    "hf_llama": ([f"model.layers.{i}.{n}" for i in range(2) for n in
                  ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")],
                 [f"model.layers.{i}.{n}" for i in range(2) for n in ("self_attn.o_proj", "mlp.down_proj")]),
}


def build(name: str, dropout: float = 0.0):
    """See the module docstring. Draws the model's initial values from the global RNG."""
    if name == "gpt":
        model = gpt()[0]
    elif name == "hf_llama":
        model = hf_llama()[0]
    elif name == "cnn":
        model = BlockCNN(dropout)
    else:
        raise KeyError(f"no lever test model {name!r}; choose gpt, hf_llama or cnn")

    def batch(n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        if name == "cnn":
            return (torch.randn(n, 3, 8, 8, generator=g),), torch.randint(0, 10, (n,), generator=g)
        ids, target = torch.randint(0, 64, (n, 16), generator=g), torch.randint(0, 64, (n, 16), generator=g)
        return ({"input_ids": ids} if name == "hf_llama" else (ids,)), target

    return model, batch, hf_lm_loss if name == "hf_llama" else lm_loss, _TP.get(name)


def zero3(captured, strategies: dict, mesh_shape, axes: Optional[tuple] = None) -> dict:
    """See the module docstring: a dim no other axis shards is chosen when one divides."""
    out = dict(strategies)
    for ph in captured.params:
        st = strategies[ph]
        storage = list(st.outputs[0])
        local = list(captured.node(ph).meta[META].shape)
        for a, p in enumerate(storage):
            if isinstance(p, Shard):
                local[p.dim] //= mesh_shape[a]
        for a, p in enumerate(storage):
            if not isinstance(p, Replicate) or mesh_shape[a] == 1 or (axes is not None and a not in axes):
                continue
            used = {q.dim for q in storage if isinstance(q, Shard)}
            dims = [d for d in range(len(local)) if local[d] % mesh_shape[a] == 0]
            dims = [d for d in dims if d not in used] or dims
            if dims:
                storage[a] = Shard(dims[0])
                local[dims[0]] //= mesh_shape[a]
        # the plain forms: FSDP on the axes made S, DDP elsewhere (a planned ZeRO form needs R storage)
        out[ph] = Strategy(st.inputs, (tuple(storage),), ())
    return out


def zero3_plan(plan, axes: Optional[tuple] = None) -> None:
    """``zero3`` applied to ``plan`` in place: its strategies and its parameter placements."""
    captured = plan.captured
    plan.solution.strategies = zero3(captured, plan.solution.strategies, plan.mesh.shape, axes)
    for ph, fqn in captured.params.items():
        storage = tuple(plan.solution.strategies[ph].outputs[0])
        for name in [fqn] + [alias for alias, canon in captured.aliases.items() if canon == fqn]:
            plan.solution.param_placements[name] = storage


def layout_pins(model, mesh_shape, layers) -> dict:
    """Data parallel, or DP x Megatron TP on the last axis of a 2-D mesh when ``layers`` are given."""
    from autoshard import presets
    if len(mesh_shape) == 2 and layers is not None:
        return presets.megatron_mlp(model, layers[0], layers[1], mesh_shape)
    return presets.data_parallel(mesh_shape)


def planned(captured, model, mesh_shape, layers, rank: int, env, mixed_precision=None) -> dict:
    """See the module docstring. ``mixed_precision``: the policy ``captured`` was traced for."""
    from autoshard.api import plan_captured
    from autoshard.passes.mesh import Mesh
    from autoshard.plans import Plan
    from autoshard.runtime.groups import broadcast_json
    mesh = Mesh.of(mesh_shape)
    payload = None
    if rank == 0:
        payload = plan_captured(captured, mesh, hardware="cpu", time_limit_s=20, mixed_precision=mixed_precision,
                                pins=layout_pins(model, mesh_shape, layers)).to_json()
    plan = Plan.from_json(broadcast_json(payload, src=0, env=env)).attach(captured, mesh)
    return zero3(captured, plan.solution.strategies, mesh_shape)


class Layout(NamedTuple):
    model_name: str
    mesh_shape: tuple
    env: Any  # runtime.groups.MeshEnv
    captured: Any  # passes.graph.CapturedGraph
    model: torch.nn.Module
    batch: Callable
    loss_fn: Callable
    strategies: dict


def block_type(model_name: str) -> str:
    """The repeated-block type of a ``layouts`` model (the key of its per-block lever policy)."""
    from .heldout_models import HELDOUT_BLOCKS
    return _ZOO_BLOCKS.get(model_name) or HELDOUT_BLOCKS.get(model_name) or BLOCK_TYPES[model_name]


def policy_levers(model_name: str, k: int, checkpoint: str, reshard: bool) -> Levers:
    """``Levers`` of k microsteps with one policy on the model's block type."""
    return Levers(k, {block_type(model_name): BlockPolicy(checkpoint, reshard)})


def layout_captures(models) -> list:
    """Every model of ``models`` (``layouts``' argument) built (``torch.manual_seed(0)`` first) and captured
    at ``MICRO`` samples, in order: ``[(model, batch, loss_fn, layers, captured), ...]``. Made once for
    every rank as ``run_ranks(..., prepare=functools.partial(layout_captures, models))`` and handed to
    ``layouts(..., captures=)``: four ranks on a 2-core machine each capturing the same models cost four
    captures."""
    from autoshard.passes.capture.export import capture

    torch.set_num_threads(1)
    out = []
    for model_name, _ in models:
        torch.manual_seed(0)
        model, batch, loss_fn, layers = _build_any(model_name)
        inputs, target = batch(MICRO, 0)
        out.append((model, batch, loss_fn, layers, capture(model, inputs, loss_fn=loss_fn, target=target)))
    return out


def layouts(rank: int, models, captures: Optional[list] = None) -> Iterator[Layout]:
    """See the module docstring. ``models``: ``[(name, [mesh_shape, ...]), ...]``; run on every rank.
    ``captures``: ``layout_captures(models)``, made once for every rank (else each rank captures here)."""
    from autoshard.api import plan_captured
    from autoshard.passes.mesh import Mesh
    from autoshard.plans import Plan
    from autoshard.runtime.groups import setup_distributed

    from .shared_work import spread_over_ranks

    torch.set_num_threads(1)
    if captures is None:
        captures = layout_captures(models)
    built, jobs = [], []
    for (model_name, meshes), (model, batch, loss_fn, layers, captured) in zip(models, captures):
        for mesh_shape in meshes:  # every model captured first, so that the plans can be spread
            built.append((model_name, mesh_shape, captured, model, batch, loss_fn))
            jobs.append(lambda c=captured, m=model, s=mesh_shape, l=layers: plan_captured(
                c, Mesh.of(s), hardware="cpu", time_limit_s=20, pins=layout_pins(m, s, l)).to_json())
    # ``planned``'s plans, each made once, on one rank (rank 0 alone planned them all, one core idle)
    for (model_name, mesh_shape, captured, model, batch, loss_fn), outcome in zip(built, spread_over_ranks(jobs)):
        env = setup_distributed(Mesh.of(mesh_shape))
        plan = Plan.from_json(outcome.value()).attach(captured, Mesh.of(mesh_shape))
        yield Layout(model_name, mesh_shape, env, captured, model, batch, loss_fn,
                     zero3(captured, plan.solution.strategies, mesh_shape))


def _build_any(name: str):
    """``build``'s form for a lever test model, a zoo model or a held-out one (``heldout_models``)."""
    from .heldout_models import HELDOUT
    if name in _ZOO_BLOCKS:
        return _zoo_build(name)
    if name in HELDOUT:
        return HELDOUT[name]()
    return build(name)


def _zoo_build(name: str):
    """A Hugging Face zoo model (``hf_zoo``) in ``build``'s form (no Megatron layers)."""
    from .hf_zoo import SEQ, VOCAB, ZOO
    model, _, _, loss_fn = ZOO[name.split(":", 1)[1]]()

    def batch(n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        return ({"input_ids": torch.randint(0, VOCAB, (n, SEQ), generator=g)},
                torch.randint(0, VOCAB, (n, SEQ), generator=g))

    return model, batch, loss_fn, None


def _call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def _slice(inputs, k: int, j: int):
    if isinstance(inputs, dict):
        return {n: x.chunk(k)[j] for n, x in inputs.items()}
    return tuple(x.chunk(k)[j] for x in inputs)


def accumulated_loss(loss_fn: Callable, k: int, twice: bool = False) -> Callable:
    """See the module docstring."""
    def once(model, inputs, target):
        return sum(loss_fn(_call(model, _slice(inputs, k, j)), target.chunk(k)[j]) for j in range(k)) / k

    def reference_loss(model, inputs, target):
        first = once(model, inputs, target)
        if not twice:
            return first
        second = once(model, inputs, target)
        return first + (second - second.detach())

    return reference_loss


class _Wrapped:
    def __init__(self, program):
        self.program = program
        self.captured = program.captured

    def parameters(self):
        return self.program.parameters()

    def full_state_dict(self):
        return self.program.full_state_dict()

    def _step(self, *inputs, target=None, **named):
        if named:
            order = [n for n in self.captured.inputs if n != self.captured.target]
            inputs = tuple(named[n] for n in order)
        return self.program.step(*inputs, target=target)


class Twice(_Wrapped):
    """See the module docstring; ``step`` returns the first run's loss."""

    def step(self, *inputs, target=None, **named):
        loss = self._step(*inputs, target=target, **named)
        self._step(*inputs, target=target, **named)
        return loss


class Probed(_Wrapped):
    """See the module docstring."""

    def __init__(self, program):
        super().__init__(program)
        self.measured: dict = {}

    def step(self, *inputs, target=None, **named):
        if self.measured:
            return self._step(*inputs, target=target, **named)
        with MemoryProbe(self.program) as probe:
            loss = self._step(*inputs, target=target, **named)
        self.measured.update(saved=probe.saved_bytes, gathered=probe.gathered_peak_bytes)
        return loss
