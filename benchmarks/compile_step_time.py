"""autoshard eager, autoshard compiled (``compile=True``) and FSDP2 + ``torch.compile``, side by side in one run.

    torchrun --nproc_per_node 4 benchmarks/compile_step_time.py

Models (``BENCH_MODELS``, default "gpt,llama"):

- gpt: the GPT of ``autoshard/testing/models.py`` (the example's architecture) at d = 512: 4 blocks,
  8 heads, vocabulary 2048, sequence 128, global batch 16;
- llama: Hugging Face ``LlamaForCausalLM``, 4 blocks, hidden 512, 8 heads / 4 KV heads, MLP 1408,
  vocabulary 2048, sequence 128, global batch 16.

Contenders, on mesh (4,), 4 gloo ranks (CPU, one thread each), the same model values and batch:

- autoshard eager: ``autoshard.compile(model, (4,), ...)``, the solver's plan for ``hardware="cpu"``;
- autoshard compiled: the same plan with ``compile=True`` (its program's regions through inductor);
- FSDP2 + torch.compile: torchtitan's recipe, every block ``torch.compile``'d then ``fully_shard``'d,
  then the root ``fully_shard``'d (reshard after forward); each rank steps on its quarter of the batch;
- autoshard zero3 compiled: FSDP2's layout in autoshard (the data-parallel plan with every parameter
  stored sharded, ``testing.levers.zero3_plan``, reshard after forward), compiled: the same layout as
  FSDP2, for the like-for-like ratio.

``BENCH_AB=1`` adds autoshard eager and compiled with the gradients copied into their all-reduce buckets
and ZeRO's buckets reduce-scattered by gloo from a copy (``GradSync.grads_in_buckets`` and
``ZeroSync.reduce_in_place`` off: the runtime before both), for the levers' before / after in one run. ``BENCH_PLAN=dp``: autoshard's contenders run the data-parallel
preset's plan (every parameter replicated, so every gradient goes through the bucketed all-reduce)
instead of the solver's.

A step is forward + backward + ``torch.optim.AdamW`` step (not compiled, on every contender). Each
contender is warmed up first (its compiles happen there), then rounds interleave the contenders
(``BENCH_ROUNDS`` rounds of ``BENCH_ITERS`` steps, default 5 x 3), so machine noise hits all alike;
rank 0 prints medians and the ratios compiled / eager and compiled / FSDP2 + compile, of wall time and
of CPU time (``time.process_time`` summed over the ranks: the work done, which other processes on a
loaded machine disturb less than the clock). Timing on a loaded machine moves every contender; the
ratios are what this script is for.
"""
from __future__ import annotations

import copy
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autoshard
from autoshard.testing.levers import zero3_plan
from autoshard.testing.models import GPT

SEQ, BATCH, VOCAB = 128, 16, 2048


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class Logits(torch.nn.Module):
    """The HF model returning its logits (what autoshard traces and FSDP2 wraps alike)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def build(name: str) -> tuple:
    """(model, its list of blocks) with seed-0 values."""
    torch.manual_seed(0)
    if name == "gpt":
        model = GPT(VOCAB, 512, 4, 8, SEQ)
        return model, model.blocks
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False)
    model = Logits(LlamaForCausalLM(config))
    return model, model.model.model.layers


def fsdp2_compiled(model: torch.nn.Module, blocks, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    for i, block in enumerate(list(blocks)):
        blocks[i] = torch.compile(block)
        fully_shard(blocks[i], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def timed(step, iters: int) -> tuple:
    """(wall seconds per step, CPU seconds per step summed over the ranks)."""
    dist.barrier()
    started, cpu = time.perf_counter(), time.process_time()
    for _ in range(iters):
        step()
    cpu = torch.tensor([time.process_time() - cpu], dtype=torch.float64)
    dist.barrier()
    wall = (time.perf_counter() - started) / iters
    dist.all_reduce(cpu)
    return wall, cpu.item() / iters


def contenders(name: str, ids: torch.Tensor, target: torch.Tensor) -> list:
    """(label, step function, compiled model or None) of the four contenders for model ``name``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = build(name)
    kw = dict(example_inputs=(ids,), loss_fn=lm_loss, example_target=target, hardware="cpu")
    given = autoshard.plan(model, (world,), **kw, **autoshard.presets.data_parallel((world,))) \
        if os.environ.get("BENCH_PLAN") == "dp" else None
    eager = autoshard.compile(copy.deepcopy(model), (world,), plan=given, **kw)
    compiled = autoshard.compile(copy.deepcopy(model), (world,), plan=eager.plan, compile=True, **kw)
    pairs = [("autoshard eager", eager), ("autoshard compiled", compiled)]
    if os.environ.get("BENCH_AB") == "1":  # the same programs with their gradients copied into the buckets
        for label, on in (("eager, grads copied", False), ("compiled, grads copied", True)):
            cm = autoshard.compile(copy.deepcopy(model), (world,), plan=eager.plan, compile=on, **kw)
            for sync in cm._program._syncs.values():
                sync.grads_in_buckets = False
            for zero in cm._program._zeros.syncs.values():  # and ZeRO's buckets reduce-scattered from a copy
                zero.reduce_in_place = False
            pairs.append((label, cm))
    base = autoshard.plan(model, (world,), **kw, **autoshard.presets.data_parallel((world,)))
    zero3_plan(base)
    zero3 = autoshard.compile(copy.deepcopy(model), (world,), plan=base, reshard_after_forward=True, compile=True, **kw)
    ref, blocks = build(name)
    ref = fsdp2_compiled(ref, blocks, world)
    local_ids, local_target = ids.chunk(world)[rank], target.chunk(world)[rank]

    def autoshard_step(cm):
        opt = torch.optim.AdamW(cm.parameters(), lr=1e-3)

        def step():
            cm.step(ids, target=target)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return step

    out = [(label, autoshard_step(cm), cm) for label, cm in pairs[:2]]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)

    def torch_step():
        lm_loss(ref(local_ids), local_target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    out.append(("FSDP2 + torch.compile", torch_step, None))
    out.append(("autoshard zero3 compiled", autoshard_step(zero3), zero3))
    out += [(label, autoshard_step(cm), cm) for label, cm in pairs[2:]]
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    rounds, iters = int(os.environ.get("BENCH_ROUNDS", 5)), int(os.environ.get("BENCH_ITERS", 3))
    g = torch.Generator().manual_seed(0)
    ids, target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    for name in os.environ.get("BENCH_MODELS", "gpt,llama").split(","):
        runs = contenders(name, ids, target)
        warm = []
        for _, step, _ in runs:  # compiles happen here
            started = time.perf_counter()
            step()
            step()
            warm.append(time.perf_counter() - started)
        times, cpus = [[] for _ in runs], [[] for _ in runs]
        for _ in range(rounds):
            for k, (_, step, _) in enumerate(runs):
                wall, cpu = timed(step, iters)
                times[k].append(wall)
                cpus[k].append(cpu)
        med = [statistics.median(t) for t in times]
        cpu = [statistics.median(c) for c in cpus]
        if rank == 0:
            cm = runs[1][2]
            print(f"{name}: {sum(p.numel() for p in build(name)[0].parameters()) / 1e6:.1f} M parameters, batch "
                  f"{BATCH} x {SEQ}, mesh ({dist.get_world_size()},), plan: {_layout(cm)}; {rounds} rounds x {iters} "
                  "steps interleaved, medians")
            for (label, _, _), t, c, w in zip(runs, med, cpu, warm):
                print(f"  {label:24s} {t * 1e3:8.1f} ms/step  {c:6.2f} CPU s/step (all ranks)  "
                      f"(first two steps {w:6.1f} s)")
            print(f"  compiled / eager:                 {med[1] / med[0]:.3f}   CPU time {cpu[1] / cpu[0]:.3f}")
            print(f"  compiled / FSDP2 + torch.compile: {med[1] / med[2]:.3f}   CPU time {cpu[1] / cpu[2]:.3f}")
            print(f"  zero3 compiled / FSDP2 + compile: {med[3] / med[2]:.3f}   CPU time {cpu[3] / cpu[2]:.3f}")
            if len(runs) > 4:
                print(f"  grads in buckets / copied, eager:    {med[0] / med[4]:.3f}   CPU time {cpu[0] / cpu[4]:.3f}")
                print(f"  grads in buckets / copied, compiled: {med[1] / med[5]:.3f}   CPU time {cpu[1] / cpu[5]:.3f}")
                print(f"  compiled / eager, both copied:       {med[5] / med[4]:.3f}   CPU time {cpu[5] / cpu[4]:.3f}")
            print("\n".join(line for line in cm.plan.summary().splitlines() if line.startswith(("  compiled", "    "))
                            and ("compiled" in line or "eager between" in line or "graph break" in line
                                 or "note" in line)))
    dist.destroy_process_group()


def _layout(cm) -> str:
    """The plan in a few words: how many parameters are stored sharded."""
    sharded = sum(1 for pls in cm.plan.param_placements.values() if any(p.is_shard() for p in pls))
    return f"{sharded} of {len(cm.plan.param_placements)} parameters stored sharded"


if __name__ == "__main__":
    main()
