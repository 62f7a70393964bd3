"""Context parallelism through the planner, on 4 gloo ranks, against one device.

One attention layer (``autoshard.testing.long_context``) with its activations split along the
sequence, attention run as ring attention (output pinned ``S(seq)``) or Ulysses (output pinned
``S(heads)``: all-to-all in and out), causal and not, with and without grouped-query heads, on (4,),
on (2, 2) with the sequence on both axes (ring) and on (2, 2) with the batch on axis 0, the sequence on
axis 1: losses, gradients and parameters after two AdamW steps equal one device, and the program
holds the ring (zig-zag when causal) or the all-to-alls the layout promises. Then Hugging Face Llama
trained with ring attention on its sequence-split activations, also mixed with head-split attention on
(2, 2), and with Ulysses on (4,).
"""
from __future__ import annotations

import copy

import pytest
import torch

from autoshard.testing.equivalence import (Tolerance, adamw, compiled_gradient_mismatches, failures_of,
                                           train_against_one_device)
from autoshard.testing.ranks import run_ranks

TOL = Tolerance(rtol=1e-4, atol=2e-5, grad_atol=1e-5)
STEPS = 2


def _train(case, model, inputs, target, loss_fn, mesh_shape, pins, env):
    from autoshard.api import plan_captured
    from autoshard.compiled import CompiledModel
    from autoshard.passes.capture.export import capture
    from autoshard.passes.mesh import Mesh
    from autoshard.plans import Plan
    from autoshard.runtime.groups import broadcast_json
    from autoshard.runtime.ring_attention import ring_attention
    captured = capture(model, inputs, loss_fn=loss_fn, target=target)
    mesh = Mesh.of(mesh_shape)
    payload = None
    if torch.distributed.get_rank() == 0:
        payload = plan_captured(captured, mesh, hardware="cpu", time_limit_s=10, pins=pins).to_json()
    plan = Plan.from_json(broadcast_json(payload, src=0, env=env)).attach(captured, mesh)
    cm = CompiledModel(model, plan, env)
    rings = [n.args[7] for n in cm.program.graph.nodes if n.target is ring_attention]  # their layouts
    counts = cm.collective_counts()
    ref = copy.deepcopy(model)
    failures = train_against_one_device(
        case, cm, ref, (inputs, target), loss_fn=loss_fn, steps=STEPS, tol=TOL, optimizer=adamw(),
        check_gradients=lambda program, reference: compiled_gradient_mismatches(case, program, reference, TOL))
    return failures, rings, counts


def layer_worker(rank: int, world: int) -> list:
    from autoshard.passes.mesh import Mesh
    from autoshard.runtime.groups import setup_distributed
    from autoshard.testing.long_context import cp_pins, seq_attention
    torch.set_num_threads(1)
    failures = []
    layouts = [((4,), mode, None) for mode in ("ring", "ulysses")]
    layouts += [((2, 2), "ring", None), ((2, 2), "ring", (1,)), ((2, 2), "ulysses", (1,))]
    for mesh_shape, mode, seq_axes in layouts:
        env = setup_distributed(Mesh.of(mesh_shape))
        for causal in (True, False):
            for heads, kv_heads in ((4, 4), (8, 4)):
                case = f"{mode} mesh={mesh_shape} seq_axes={seq_axes} causal={causal} heads={heads}/{kv_heads}"
                torch.manual_seed(0)
                model, inputs, target, loss_fn = seq_attention(heads, kv_heads, causal)
                found, rings, counts = _train(case, model, inputs, target, loss_fn, mesh_shape,
                                              cp_pins(mesh_shape, mode, seq_axes), env)
                failures += found
                want = ["zigzag" if causal else "contiguous"] if mode == "ring" else []
                if rings != want:
                    failures.append(f"{case}: ring attention calls {rings} in the program, want {want}")
                if mode == "ulysses" and not counts.get("all_to_all"):
                    failures.append(f"{case}: Ulysses program without all-to-all: collectives {counts}")
    return failures


def test_ring_and_ulysses_layers_equal_one_device():
    failures = failures_of(run_ranks(layer_worker, 4, timeout=900))
    assert not failures, "\n".join(failures)


def llama_worker(rank: int, world: int) -> list:
    from autoshard.passes.mesh import Mesh
    from autoshard.runtime.groups import setup_distributed
    from autoshard.testing.long_context import SDPA_NODES
    from autoshard.testing.models import hf_llama
    torch.set_num_threads(1)
    failures = []
    for mesh_shape, attention in (((4,), ("S(2)",)), ((2, 2), ("S(2)", "S(2)")), ((2, 2), ("S(2)", "S(1)")),
                                  ((4,), ("S(1)",))):
        env = setup_distributed(Mesh.of(mesh_shape))
        seq = tuple("S(1)" for _ in mesh_shape)
        pins = {"inputs": {"input_ids": seq, "target": seq}, "ops": {SDPA_NODES: attention}}
        if "S(2)" not in attention:  # Ulysses keeps the projections sequence-split (the planner may otherwise
            pins["ops"]["linear*"] = seq  # gather the sequence once and slice heads, a program without all-to-all)
        case = f"hf_llama mesh={mesh_shape} attention={attention}"
        torch.manual_seed(0)
        model, inputs, target, loss_fn = hf_llama()
        found, rings, counts = _train(case, model, inputs, target, loss_fn, mesh_shape, pins, env)
        failures += found
        if "S(2)" not in attention:  # Ulysses: sequence-split ids, head-split attention
            if rings or not counts.get("all_to_all"):
                failures.append(f"{case}: want all-to-all and no ring, got rings {rings}, collectives {counts}")
        elif rings != ["contiguous"] * model.config.num_hidden_layers:  # HF passes an explicit causal mask
            failures.append(f"{case}: ring attention calls {rings}, want one contiguous ring per layer")
    return failures


@pytest.mark.slow  # an HF model end to end; the layer test covers ring and Ulysses in the fast tier
def test_hf_llama_with_ring_attention_equals_one_device():
    failures = failures_of(run_ranks(llama_worker, 4, timeout=900))
    assert not failures, "\n".join(failures)
