"""On a GPU: a compiled program trains exactly like plain PyTorch on the same GPU (the CUDA / NCCL path).

    torchrun --nproc_per_node 1 benchmarks/cuda_check.py      # NCCL, one rank per GPU

No test can need a GPU, so the runtime's CUDA path (materialising on the device, NCCL groups, the
hardware preset ``"auto"`` resolves to) is checked here, on a machine that has one. The model is the
GPT of ``autoshard.testing.models`` at a width a GPU notices. Each lever case trains 5 AdamW steps,
compiled and plain side by side from the same weights and batch, and prints the loss and the largest
parameter difference. A mesh of several GPUs is the same command with more processes.

The ``compile=True`` cases run each rank's program through ``torch.compile`` (inductor: Triton
kernels on the GPU, the collectives inside the graphs as functional collectives on NCCL), with and
without checkpointing and resharding; they train with plain SGD, whose update is proportional to the
gradient (AdamW would turn the fused kernels' rounding in gradients that are zero in exact arithmetic
into full-size updates), and print what was compiled, graph breaks and compile seconds.
"""
from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist

import autoshard
from autoshard.api import resolve_hardware
from autoshard.testing.models import GPT, lm_loss


def check(levers: dict, world: int, rank: int, steps: int = 5) -> float:
    """Largest |loss| and parameter difference from plain PyTorch after ``steps`` steps (float32); AdamW,
    or SGD for a compiled program (see the module docstring)."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    model = GPT(256, 128, 4, 4, 64, True).to(device)
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 256, (8, 64), device=device)
    target = torch.randint(0, 256, (8, 64), device=device)
    cm = autoshard.compile(model, (world,), example_inputs=(ids,), loss_fn=lm_loss, example_target=target, **levers)
    make = (lambda ps: torch.optim.SGD(ps, lr=0.1)) if levers.get("compile") else \
        (lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    opt, ref_opt = make(cm.parameters()), make(reference.parameters())
    worst = 0.0
    for step in range(steps):
        loss = cm.step(ids, target=target)
        opt.step()
        opt.zero_grad()
        ref_loss = lm_loss(reference(ids), target)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        worst = max(worst, abs(loss - ref_loss.item()))
    full = cm.full_state_dict()
    for name, p in reference.state_dict().items():
        worst = max(worst, (full[name].to(device) - p).abs().max().item())
    if rank == 0:
        where = {p.device.type for p in cm.parameters()}
        print(f"cuda_check {levers or 'default'}: parameters on {sorted(where)}, hardware {resolve_hardware('auto')!r}, "
              f"final loss {loss:.5f} vs {ref_loss.item():.5f}, largest difference {worst:.2e}", flush=True)
        if cm.compile_report is not None:
            print("\n".join(cm.compile_report.lines()), flush=True)
    return worst


def main() -> int:
    if not torch.cuda.is_available() and "--cpu" not in sys.argv:
        print("cuda_check: no GPU here; run it on a machine with one (--cpu checks the script itself)", file=sys.stderr)
        return 2
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    cases = ({}, {"checkpoint": "full"}, {"compile": True},
             {"compile": True, "checkpoint": "full", "reshard_after_forward": True})
    worst = max(check(levers, world, rank) for levers in cases)
    if dist.is_initialized():
        dist.destroy_process_group()
    tolerance = 1e-4  # float32 throughout: only the order of reductions may differ
    if rank == 0:
        print(f"cuda_check: {'ok' if worst <= tolerance else 'FAILED'} (largest difference {worst:.2e})")
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
