"""The oracle is one device: distributed training under autoshard equals single-device training.

For each model (MLP, GPT with tied embeddings, a CNN with BatchNorm, Hugging Face GPT-2 and Llama
built from configs, a Llama whose rotary embedding multiplies complex numbers), on 4 gloo ranks with meshes (4,) and (2, 2), and for each layout (the solver's
plan, pinned DP, FSDP and Megatron TP, and several randomly drawn valid plans): the loss at every
step and the full parameters after 2 AdamW steps match a single-device copy (float32, rtol 1e-4).
One process spawn per model, captured once in the process the ranks fork from; every case runs inside
it, planned once on one of the ranks.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch

from autoshard.testing.equivalence import (Tolerance, adamw, compiled_gradient_mismatches, failures_of,
                                           train_against_one_device)
from autoshard.testing.models import BUILDERS
from autoshard.testing.ranks import run_ranks
from autoshard.testing.shared_work import spread_over_ranks

MESHES = ((4,), (2, 2))
N_RANDOM = 5
STEPS = 2  # the first step checks gradients and loss, the second the optimizer state carried over
TOL = Tolerance(rtol=1e-4, atol=2e-5, grad_atol=1e-6)
ADAM_EPS = 1e-6  # damps the amplification of rounding noise in (near-)zero gradient entries

# Megatron pins per model: column-split Linears (weight rows) and row-split Linears (weight columns).
TP_LAYERS = {
    "mlp": (["fc1"], ["fc2"]),
    "gpt": ([f"blocks.{i}.{n}" for i in range(2) for n in ("q", "k", "v", "fc")],
            [f"blocks.{i}.{n}" for i in range(2) for n in ("o", "out")]),
    "hf_llama": ([f"model.layers.{i}.{n}" for i in range(2)
                  for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")],
                 [f"model.layers.{i}.{n}" for i in range(2) for n in ("self_attn.o_proj", "mlp.down_proj")]),
    "complex_rope_llama": ([f"layers.{i}.{n}" for i in range(2) for n in ("wq", "wk", "wv", "w1", "w3")],
                           [f"layers.{i}.{n}" for i in range(2) for n in ("wo", "w2")]),
}


def tp_pins(model_name: str, model, mesh) -> dict:
    """Megatron tensor parallel on the last mesh axis, data parallel on the others."""
    from autoshard import presets
    if model_name in TP_LAYERS:
        col, row = TP_LAYERS[model_name]
        return presets.megatron_mlp(model, col, row, mesh)
    last = len(mesh) - 1
    on_tp = lambda pl: tuple(pl if a == last else "R" for a in range(len(mesh)))  # noqa: E731
    batch = {0: tuple("R" if a == last else "S(0)" for a in range(len(mesh)))}
    if model_name == "hf_gpt2":  # transformers Conv1D: weight is (in, out)
        params = {}
        for i in range(2):
            for n in ("attn.c_attn", "mlp.c_fc"):
                params[f"transformer.h.{i}.{n}.weight"] = on_tp("S(1)")
                params[f"transformer.h.{i}.{n}.bias"] = on_tp("S(0)")
            for n in ("attn.c_proj", "mlp.c_proj"):
                params[f"transformer.h.{i}.{n}.weight"] = on_tp("S(0)")
        return {"inputs": batch, "params": params}
    if model_name == "cnn":  # output channels of the conv split, classifier row-split
        return {"inputs": batch, "params": {"conv.weight": on_tp("S(0)"), "bn.weight": on_tp("S(0)"),
                                            "bn.bias": on_tp("S(0)")}}
    raise KeyError(model_name)


def layouts(model_name: str, model, mesh) -> list:
    from autoshard import presets
    out = [("solver", {}, None), ("dp", presets.data_parallel(mesh), None),
           ("fsdp", presets.fully_sharded(model, mesh), None), ("tp", tp_pins(model_name, model, mesh), None)]
    out += [(f"random{k}", {}, 1000 + k) for k in range(N_RANDOM)]
    return out


def captured_model(model_name: str) -> tuple:
    """``(model, inputs, target, loss_fn, captured)``: made once, in the process the ranks fork from
    (``run_ranks(prepare=)``), instead of once on every rank."""
    from autoshard.passes.capture.export import capture
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, inputs, target, loss_fn = BUILDERS[model_name]()
    return model, inputs, target, loss_fn, capture(model, inputs, loss_fn=loss_fn, target=target)


def equivalence_worker(rank: int, world: int, prepared: tuple, model_name: str, meshes, only=None) -> list:
    """Run every (mesh, layout) case for one model (``prepared``: ``captured_model(model_name)``); return a
    list of failure descriptions."""
    from autoshard.api import plan_captured
    from autoshard.compiled import CompiledModel
    from autoshard.passes.mesh import Mesh
    from autoshard.plans import Plan
    from autoshard.runtime.groups import setup_distributed

    torch.set_num_threads(1)
    failures = []
    model, inputs, target, loss_fn, captured = prepared
    cases = [(mesh_shape, name, pins, seed) for mesh_shape in meshes
             for name, pins, seed in layouts(model_name, model, mesh_shape) if not only or name in only]

    def solve(mesh_shape, pins, seed):
        return plan_captured(captured, Mesh.of(mesh_shape), hardware="cpu", random_seed=seed, time_limit_s=20,
                             pins=pins).to_json()
    # every case planned once, the cases spread over the ranks (rank 0 alone planned them all, one core idle)
    planned = spread_over_ranks([lambda c=c: solve(c[0], c[2], c[3]) for c in cases])
    for (mesh_shape, name, _, _), outcome in zip(cases, planned):
        mesh = Mesh.of(mesh_shape)
        env = setup_distributed(mesh)
        case = f"{model_name} mesh={mesh_shape} layout={name}"
        plan = Plan.from_json(outcome.value()).attach(captured, mesh)
        cm = CompiledModel(model, plan, env)
        ref = copy.deepcopy(model)
        failures += train_against_one_device(
            case, cm, ref, (inputs, target), loss_fn=loss_fn, steps=STEPS, tol=TOL,
            optimizer=adamw(lr=1e-3, eps=ADAM_EPS),
            check_gradients=lambda program, reference: compiled_gradient_mismatches(case, program, reference, TOL))
        del cm
    return failures


@pytest.mark.parametrize("model_name", ["mlp", "gpt", "cnn", pytest.param("hf_gpt2", marks=pytest.mark.slow), "hf_llama",
                                        pytest.param("complex_rope_llama", marks=pytest.mark.slow)])
def test_matches_single_device(model_name):
    failures = failures_of(run_ranks(equivalence_worker, 4, model_name, MESHES, timeout=900,
                                     prepare=functools.partial(captured_model, model_name)))
    assert not failures, "\n".join(failures)
