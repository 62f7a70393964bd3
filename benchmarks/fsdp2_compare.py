"""autoshard's reshard-after-forward FSDP against torch's ``fully_shard`` (FSDP2), side by side in one run.

    torchrun --nproc_per_node 4 benchmarks/fsdp2_compare.py

A small Llama-style model (HF ``LlamaForCausalLM``: 6 blocks, hidden 256, 8 heads / 4 KV heads, MLP
768, vocab 2048: 5.8 M parameters), global batch 8 x 64, AdamW, 4 gloo ranks (CPU).

- mesh (4,): FSDP2 applied as torchtitan applies it (``fully_shard`` on every decoder layer, then
  on the root; reshard after forward) against autoshard layouts, every one with
  ``reshard_after_forward=True``: "zero3" (the data-parallel plan with every parameter stored
  sharded: the layout FSDP2 runs, its op strategies pinned), the solver's own plan, and the
  ``fully_sharded`` preset (parameters pinned sharded, the solver choosing the ops); and, for
  reference, "zero3" keeping its gathered copies for backward;
- mesh (2, 2): FSDP2 x TP2 (``parallelize_module`` ColwiseParallel q/k/v/gate/up and RowwiseParallel
  o/down on "tp", then ``fully_shard`` over "dp") against autoshard's Megatron pins with ZeRO-3
  storage on "dp" and the solver's plan.

Step time: rounds interleaved (each round times every contender for ``BENCH_ITERS`` steps), medians,
ratio = autoshard / FSDP2 (below 1.0: autoshard faster). Peak bytes: ``torch.distributed._tools.
mem_tracker.MemTracker`` around one step + optimizer step of each contender, the same measurement
both ways (every tensor storage alive, parameters, gradients and optimizer state included), the
largest rank's peak. Environment: BENCH_ROUNDS (default 5), BENCH_ITERS (3), BENCH_MESHES ("4,2x2").
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import autoshard
from autoshard.testing.levers import zero3_plan

SEQ, BATCH, VOCAB = 64, 8, 2048
COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROW = ("self_attn.o_proj", "mlp.down_proj")


class Logits(torch.nn.Module):
    """The HF model returning its logits (what autoshard traces and FSDP2 wraps alike)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def build() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=6, num_attention_heads=8,
                         num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False)
    torch.manual_seed(0)
    return Logits(LlamaForCausalLM(config))


def lm_loss(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def fsdp2(model, mesh_shape):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    layers = model.model.model.layers
    if len(mesh_shape) == 1:
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp",))
        dp = mesh
    else:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
        for layer in layers:
            parallelize_module(layer, mesh["tp"], {**{n: ColwiseParallel() for n in COLUMN},
                                                    **{n: RowwiseParallel() for n in ROW}})
        dp = mesh["dp"]
    for layer in layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    return model


def timed(step_fn, iters: int) -> float:
    dist.barrier()
    t = time.perf_counter()
    for _ in range(iters):
        step_fn()
    dist.barrier()
    return (time.perf_counter() - t) / iters


def peak_bytes(step_fn, module, opt) -> int:
    """The largest rank's peak of tracked bytes over one step (MemTracker: every storage alive)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    tracker = MemTracker()
    tracker.track_external(module, opt)
    with tracker:
        step_fn()
    peak = max(tracker.get_tracker_snapshot("peak").get(d, {}).get("Total", 0)
               for d in tracker.get_tracker_snapshot("peak"))
    t = torch.tensor([peak], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


class _Params(torch.nn.Module):
    """autoshard's local shards as a module, so MemTracker can count them like FSDP2's."""

    def __init__(self, cm):
        super().__init__()
        self.ps = torch.nn.ParameterList(cm.parameters())


def contenders(mesh_shape, ids, target):
    """(name, step, module, optimizer) for FSDP2 first, then the autoshard layouts."""
    rank = dist.get_rank()
    out = []
    ref = fsdp2(build(), mesh_shape)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    local_ids, local_target = ids, target
    if len(mesh_shape) == 1:
        local_ids, local_target = ids.chunk(mesh_shape[0])[rank], target.chunk(mesh_shape[0])[rank]
    else:
        dp_rank = rank // mesh_shape[1]
        local_ids, local_target = ids.chunk(mesh_shape[0])[dp_rank], target.chunk(mesh_shape[0])[dp_rank]

    def torch_step(m=ref, o=opt):
        lm_loss(m(local_ids), local_target).backward()
        o.step()
        o.zero_grad(set_to_none=True)

    out.append(("FSDP2" if len(mesh_shape) == 1 else "FSDP2 x TP2", torch_step, ref, opt))
    model = build()
    kw = dict(example_inputs=(ids,), loss_fn=lm_loss, example_target=target, hardware="cpu")
    layouts = []
    if len(mesh_shape) == 1:
        base = autoshard.plan(model, mesh_shape, **kw, **autoshard.presets.data_parallel(mesh_shape))
        zero3_plan(base, axes=(0,))
        layouts.append(("autoshard zero3", {"plan": base}))
        layouts.append(("autoshard solver", {}))
        layouts.append(("autoshard fully_sharded preset", autoshard.presets.fully_sharded(model, mesh_shape)))
    else:
        names = [f"model.model.layers.{i}.{n}" for i in range(6) for n in COLUMN], \
                [f"model.model.layers.{i}.{n}" for i in range(6) for n in ROW]
        base = autoshard.plan(model, mesh_shape, **kw, **autoshard.presets.megatron_mlp(model, *names, mesh_shape))
        zero3_plan(base, axes=(0,))
        layouts.append(("autoshard zero3 x TP2", {"plan": base}))
        layouts.append(("autoshard solver", {}))
    if len(mesh_shape) == 1:  # the same layout keeping gathered copies for backward, for reference
        layouts.append(("autoshard zero3, no reshard", {"plan": base, "reshard_after_forward": False}))
    for name, extra in layouts:
        extra = {"reshard_after_forward": True, **extra}
        cm = autoshard.compile(build(), mesh_shape, **kw, **extra)
        opt_a = torch.optim.AdamW(cm.parameters(), lr=1e-3)

        def ours(cm=cm, o=opt_a):
            cm.step(ids, target=target)
            o.step()
            o.zero_grad(set_to_none=True)

        out.append((name, ours, _Params(cm), opt_a))
    return out


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    rounds, iters = int(os.environ.get("BENCH_ROUNDS", 5)), int(os.environ.get("BENCH_ITERS", 3))
    meshes = [tuple(int(n) for n in m.split("x")) for m in os.environ.get("BENCH_MESHES", "4,2x2").split(",")]
    g = torch.Generator().manual_seed(0)
    ids, target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    params = sum(p.numel() for p in build().parameters())
    report = []
    for mesh_shape in meshes:
        if torch.Size(mesh_shape).numel() != world:
            continue
        runs = contenders(mesh_shape, ids, target)
        for _, step, _, _ in runs:
            step()  # warm-up
        peaks = [peak_bytes(step, module, opt) for _, step, module, opt in runs]
        times = [[] for _ in runs]
        for _ in range(rounds):
            for k, (_, step, _, _) in enumerate(runs):
                times[k].append(timed(step, iters))
        med = [statistics.median(t) for t in times]
        report.append((mesh_shape, [(name, m, p) for (name, *_), m, p in zip(runs, med, peaks)]))
    if rank == 0:
        print(f"Llama-style model, 6 blocks, {params / 1e6:.2f} M parameters, batch {BATCH} x {SEQ}, {world} gloo "
              f"ranks, {rounds} rounds x {iters} steps interleaved (medians); peak = MemTracker, largest rank")
        for mesh_shape, rows in report:
            base_t, base_p = rows[0][1], rows[0][2]
            print(f"mesh {mesh_shape}:")
            for name, t, p in rows:
                print(f"  {name:34s} {t * 1e3:8.1f} ms  ratio {t / base_t:5.2f}x   peak {p / 2**20:7.2f} MiB  "
                      f"ratio {p / base_p:5.2f}x")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
