"""Per-rank bytes of parameters + gradients + optimizer state: measured against the plan's estimate.

    torchrun --nproc_per_node 4 benchmarks/memory.py

For the GPT example's model (``autoshard.testing.models.GPT`` with fused qkv: op for op
examples/nanogpt.py's) under three layouts (the solver's, pinned DP, pinned FSDP) on a (4,) mesh and
the solver's on (2, 2): after one step and one AdamW step, each rank sums the bytes of its local
parameters, their gradients and the optimizer's state tensors; rank 0 prints the largest rank's
figures next to the plan's estimate.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import autoshard
from autoshard.testing.corpus import CharData, generate_corpus
from autoshard.testing.models import GPT, lm_loss


def measured_bytes(cm, opt) -> dict:
    params = sum(p.numel() * p.element_size() for p in cm.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in cm.parameters() if p.grad is not None)
    state = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items()
                if torch.is_tensor(t) and k != "step")
    return {"params": params, "grads": grads, "optimizer": state}


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = CharData(generate_corpus())
    x, y = data.batch(16, 32, step=0)
    rows = []
    for label, mesh, pins in (
        ("solver", (world,), {}),
        ("DP", (world,), "dp"),
        ("FSDP", (world,), "fsdp"),
        ("TP", (world,), "tp"),
        ("solver", (2, world // 2), {}),
    ):
        torch.manual_seed(0)
        model = GPT(vocab=data.vocab, d=64, n_layer=2, n_head=4, seq=32, fused_qkv=True)
        if pins == "dp":
            pins = autoshard.presets.data_parallel(mesh)
        elif pins == "fsdp":
            pins = autoshard.presets.fully_sharded(model, mesh)
        elif pins == "tp":
            pins = autoshard.presets.megatron_mlp(
                model, [f"blocks.{i}.{n}" for i in range(2) for n in ("qkv", "fc")],
                [f"blocks.{i}.{n}" for i in range(2) for n in ("o", "out")], mesh)
        cm = autoshard.compile(model, mesh, example_inputs=(x,), loss_fn=lm_loss, example_target=y, **pins)
        opt = torch.optim.AdamW(cm.parameters(), lr=1e-3)
        cm.step(x, target=y)
        opt.step()
        got = measured_bytes(cm, opt)
        t = torch.tensor([got["params"], got["grads"], got["optimizer"]], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        est = cm.plan.solution.memory_breakdown
        rows.append((label, mesh, [int(v) for v in t.tolist()], [int(est[k]) for k in ("params", "grads", "optimizer")]))
    if rank == 0:
        print(f"GPT example, {world} gloo ranks; bytes on the largest rank (measured / estimated)")
        for label, mesh, got, est in rows:
            cells = "  ".join(f"{k} {g}/{e}" for k, g, e in zip(("params", "grads", "optimizer"), got, est))
            print(f"  {label:6s} mesh {str(mesh):8s} {cells}  {'EQUAL' if got == est else 'DIFFERENT'}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
