"""The backward prefetch of a recomputed block's parameters, used or thrown away, side by side in one run.

    torchrun --nproc_per_node 4 benchmarks/gather_prefetch.py

A GPT (6 blocks, d 256, 8 heads, vocab 2048, separate q/k/v; 5.3 M parameters), global batch 8 x 64,
SGD, 4 gloo ranks (CPU), every parameter stored sharded (the data-parallel plan with ZeRO-3 storage),
reshard after forward on and every block checkpointed ("full", then "selective"). One compiled program
per policy runs two ways, rounds interleaved: "fixed" (this tree: a prefetch matches shards over the
same memory) and "id match" (the rule before it, reinstated here for the comparison: a prefetch matched
only the same Python tensor objects, which a checkpoint's recomputation does not hand back, so each
recomputed block waited for its prefetch and gathered again). Per step: the median wall time and the
all-gathers the runtime issued (``runtime.collectives``' entry point) with their elements.
Environment: BENCH_ROUNDS (default 7), BENCH_ITERS (3).
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time

import torch
import torch.distributed as dist

import autoshard
from autoshard.runtime import collectives, param_gather
from autoshard.testing.levers import zero3_plan
from autoshard.testing.models import gpt

SEQ, BATCH, VOCAB = 64, 8, 2048
_FIXED = param_gather._Pending.matches


def _id_match(self, shards) -> bool:
    """The matching rule before the fix: the very same Python objects at the same versions."""
    return (tuple(id(s) for s in self.shards) == tuple(id(s) for s in shards)
            and self.versions == tuple(s._version for s in shards))


@contextlib.contextmanager
def rule(matches):
    param_gather._Pending.matches = matches
    try:
        yield
    finally:
        param_gather._Pending.matches = _FIXED


class Counter:
    """Counts the all-gathers the runtime issues (calls, elements sent per rank)."""

    def __init__(self):
        self.calls = self.elements = 0
        self._real = collectives._all_gather_single

    def __call__(self, out, src, *args, **kwargs):
        self.calls += 1
        self.elements += src.numel()
        return self._real(out, src, *args, **kwargs)


def build():
    torch.manual_seed(0)
    return gpt(vocab=VOCAB, d=256, n_layer=6, n_head=8, seq=SEQ)[0]


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    rounds, iters = int(os.environ.get("BENCH_ROUNDS", 7)), int(os.environ.get("BENCH_ITERS", 3))
    g = torch.Generator().manual_seed(0)
    ids, target = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    mesh = (world,)
    kw = dict(example_inputs=(ids,), loss_fn=lambda logits, t: torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), t.reshape(-1)), example_target=target, hardware="cpu")
    base = autoshard.plan(build(), mesh, **kw, **autoshard.presets.data_parallel(mesh))
    zero3_plan(base, axes=(0,))
    rows = []
    for policy in ("full", "selective"):
        cm = autoshard.compile(build(), mesh, plan=base, checkpoint=policy, reshard_after_forward=True, **kw)
        opt = torch.optim.SGD(cm.parameters(), lr=1e-3)

        def step(cm=cm, opt=opt):
            cm.step(ids, target=target)
            opt.step()
            opt.zero_grad(set_to_none=True)

        ways = (("fixed", _FIXED), ("id match", _id_match))
        counts, times = {}, {name: [] for name, _ in ways}
        for name, matches in ways:
            with rule(matches):
                step()  # warm-up
                counter = collectives._all_gather_single = Counter()
                try:
                    step()
                finally:
                    collectives._all_gather_single = counter._real
                counts[name] = (counter.calls, counter.elements)
        for _ in range(rounds):
            for name, matches in ways:
                with rule(matches):
                    dist.barrier()
                    t = time.perf_counter()
                    for _ in range(iters):
                        step()
                    dist.barrier()
                    times[name].append((time.perf_counter() - t) / iters)
        rows.append((policy, [(name, statistics.median(times[name]), *counts[name]) for name, _ in ways]))
    if rank == 0:
        params = sum(p.numel() for p in build().parameters())
        print(f"GPT, 6 blocks, {params / 1e6:.2f} M parameters, batch {BATCH} x {SEQ}, {world} gloo ranks, ZeRO-3 "
              f"storage + reshard after forward, {rounds} rounds x {iters} steps interleaved (medians)")
        for policy, ways in rows:
            base_t = ways[0][1]
            print(f"checkpoint={policy}:")
            for name, t, calls, elements in ways:
                print(f"  {name:9s} {t * 1e3:8.1f} ms  ratio {t / base_t:5.2f}x   all-gathers/step {calls:3d}  "
                      f"elements sent/rank {elements / 1e6:6.2f} M")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
