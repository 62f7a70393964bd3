"""Per-rank memory of MoE layouts on gloo ranks: measured next to the plan's estimate.

    python benchmarks/moe_memory.py

A small HF Mixtral (2 layers, hidden 64, 8 experts of intermediate 256, top-2, vocabulary 96; the
experts hold 94% of the parameters), global batch 8 x 32, AdamW, on 4 CPU gloo ranks, under the
MoE layouts of ``autoshard.testing.moe_check`` pinned on every MoE layer (the solver places the rest):
expert parallel on (4,), data parallel with the experts replicated on (4,), and expert parallel over
both axes of (2, 2). After one step and one AdamW step each rank sums the bytes of its local
parameters, gradients and optimizer state; ``cm.memory_probe()`` measures what autograd saved in
the forward (``runtime.memory_probe``). Printed: the largest rank's figures, measured / estimated.
The saved activations of an expert-parallel layer depend on how many pairs the routing sends to the
rank (the estimate assumes an even share), so the measured figure moves with the data.
"""
from __future__ import annotations

import torch

from autoshard.testing.moe_check import expert_pins
from autoshard.testing.ranks import run_ranks

LAYOUTS = (("expert parallel", (4,), ("ep",)), ("data parallel, experts R", (4,), ("dp",)),
           ("expert parallel x2", (2, 2), ("ep", "ep")))


def build():
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=256, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=96, num_local_experts=8, num_experts_per_tok=2,
                        router_jitter_noise=0.0, use_cache=False)
    return MixtralForCausalLM(cfg)


def lm_loss(out, target):  # an HF model: the loss gets its output object
    logits = out.logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def worker(rank: int, world: int) -> list:
    import torch.distributed as dist

    from autoshard.api import plan_captured
    from autoshard.compiled import CompiledModel
    from autoshard.passes.capture.export import capture
    from autoshard.passes.mesh import Mesh
    from autoshard.plans import Plan
    from autoshard.runtime.groups import run_and_broadcast, setup_distributed

    torch.set_num_threads(1)
    rows = []
    for label, mesh_shape, roles in LAYOUTS:
        torch.manual_seed(0)
        model = build()
        ids, target = torch.randint(0, 96, (8, 32)), torch.randint(0, 96, (8, 32))
        captured = capture(model, {"input_ids": ids}, loss_fn=lm_loss, target=target)
        mesh = Mesh.of(mesh_shape)
        env = setup_distributed(mesh)
        pins = expert_pins(captured, roles)
        if "dp" in roles:
            pins["params"] = {"*experts.*": tuple("R" for _ in mesh_shape)}
        plan = Plan.from_json(run_and_broadcast(lambda: plan_captured(
            captured, mesh, hardware="cpu", pins=pins, time_limit_s=10).to_json(), env=env)).attach(captured, mesh)
        cm = CompiledModel(model, plan, env)
        opt = torch.optim.AdamW(cm.parameters(), lr=1e-3)
        with cm.memory_probe() as probe:
            cm.step(ids, target=target)
        opt.step()
        got = [sum(p.numel() * p.element_size() for p in cm.parameters()),
               sum(p.grad.numel() * p.grad.element_size() for p in cm.parameters() if p.grad is not None),
               sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items()
                   if torch.is_tensor(t) and k != "step"),
               probe.saved_bytes]
        t = torch.tensor(got, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        est = plan.solution.memory_breakdown
        rows.append((label, mesh_shape, [int(v) for v in t.tolist()],
                     [int(est[k]) for k in ("params", "grads", "optimizer", "activations")]))
    return rows


def main() -> None:
    print(f"torch {torch.__version__}; small Mixtral, 4 gloo ranks; bytes on the largest rank (measured / estimated)")
    for label, mesh, got, est in run_ranks(worker, 4, timeout=600)[0]:
        cells = "  ".join(f"{k} {g:,}/{e:,}" for k, g, e in zip(("params", "grads", "optimizer", "saved"), got, est))
        print(f"  {label:26s} mesh {str(mesh):7s} {cells}")


if __name__ == "__main__":
    main()
