"""The whole-step peak on held-out models, through ``autoshard.compile``: measured three ways next to
the plan's estimate (run on every rank).

``heldout_peaks(rank, models, meshes, cases)``: for each model of ``heldout_models`` (or the zoo's
``"hf:<name>"``), mesh and lever case ``(name, accumulation, checkpoint, reshard)``, the model is
compiled with those levers pinned (the planner chooses the placements, as for a user) and trained
one step; then the step plus AdamW's step is measured

- by ``MicrostepTracker`` (torch's ``MemTracker`` that does not hold gradients, ``tracker_hooks``),
  tracking ``cm.local_module`` (parameters, buffers, gradient buckets) and the optimizer;
- by torch's ``MemTracker`` as it ships (``torch_tracker``; it holds every gradient that passes a
  module input to the module's backward end): the figure issue 27 reported. Its ModTracker leaves
  those hooks on the parameters (leaf inputs of the program) after it exits, so every later step
  of the same program holds its gradients too: it is measured last;
- by a bare storage counter with no hooks (``storage_probe``, ``bare``) and by the heap (``heap_probe``;
  glibc only, which this sets up first; allocations of 64 KiB and more only), each plus what was alive
  at the step's start that the estimate counts (parameters, buffers, optimizer state, gradient
  buckets, the batch);

each the least of ``REPEATS`` steps. Returns one dict per case: ``model, mesh, case, tracker,
torch_tracker`` (NaN with accumulation: it refuses a root module called twice)``, bare, heap`` (None
without glibc)``, estimated, phase`` (the estimate's)``, tracker_phases``.
"""
from __future__ import annotations

import math

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from . import heap_probe
from .memory_estimates import MicrostepTracker
from .storage_probe import StorageProbe, storage_key

__all__ = ["HELDOUT_CASES", "REPEATS", "heldout_peaks"]

#: (name, accumulation, checkpoint, reshard after forward)
HELDOUT_CASES = (("none", 1, "none", False), ("full + reshard", 1, "full", True), ("selective", 1, "selective", False),
                 ("acc 2", 2, "none", False))
REPEATS = 2


def _build(name: str):
    from .heldout_models import HELDOUT
    if name in HELDOUT:
        model, batch, loss_fn, _ = HELDOUT[name]()
        return model, batch, loss_fn
    from .hf_zoo import SEQ, VOCAB, ZOO
    model, _, _, loss_fn = ZOO[name.split(":", 1)[1]]()

    def batch(n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        return ({"input_ids": torch.randint(0, VOCAB, (n, SEQ), generator=g)},
                torch.randint(0, VOCAB, (n, SEQ), generator=g))
    return model, batch, loss_fn


def _state(cm, optimizer, batch_tensors) -> list:
    """Tensors alive when a step begins that the estimate counts: local parameters and buffers (the
    gradient buckets among them), optimizer state, the batch."""
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return list(cm.local_module.parameters()) + list(cm.local_module.buffers()) + state + list(batch_tensors)


def _storages(tensors) -> dict[int, int]:
    return {storage_key(t): t.untyped_storage().nbytes() for t in tensors}


def _least(measure, step, repeats: int):
    best = (math.inf, "")
    for _ in range(repeats):
        got = measure(step)
        if got[0] < best[0]:
            best = got
    return best


def heldout_peaks(rank: int, models, meshes, cases=HELDOUT_CASES, repeats: int = REPEATS) -> list[dict]:
    """See the module docstring."""
    import autoshard

    torch.set_num_threads(1)
    if heap_probe.available():
        heap_probe.use_mmap_for_large()  # before any model is built: every tensor the step makes is counted
    rows = []
    for name in models:
        for mesh in meshes:
            for case, k, checkpoint, reshard in cases:
                torch.manual_seed(0)
                model, batch, loss_fn = _build(name)
                x, y = batch(8 * k, 1)
                cm = autoshard.compile(model, tuple(mesh), example_inputs=x, loss_fn=loss_fn, example_target=y,
                                       hardware="cpu", accumulation=k, checkpoint=checkpoint,
                                       reshard_after_forward=reshard)
                optimizer = torch.optim.AdamW(cm.parameters(), lr=1e-3)

                def step():
                    cm.step(**x, target=y)
                    optimizer.step()

                step()  # the first step makes the optimizer state

                def tracked(step, kind=MicrostepTracker):
                    optimizer.zero_grad()
                    tracker = kind()
                    tracker.track_external(cm.local_module, optimizer)
                    with tracker:
                        step()
                    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
                    return peak, getattr(tracker, "peak_phases", "")

                def heap(step):
                    optimizer.zero_grad()
                    with heap_probe.HeapProbe() as probe:
                        step()
                    return probe.peak_rise + sum(_storages(_state(cm, optimizer, batch_tensors)).values()), ""

                def bare(step):
                    optimizer.zero_grad()
                    known = _storages(_state(cm, optimizer, batch_tensors))
                    with StorageProbe(known) as probe:
                        step()
                    return probe.peak + sum(known.values()), ""

                batch_tensors = list(x.values()) + [y]
                # no tracker first, torch's MemTracker last: its hooks on the parameters outlive it
                bare_peak = _least(bare, step, repeats)[0]
                heap_peak = _least(heap, step, repeats)[0] if heap_probe.available() else None
                measured, phases = _least(tracked, step, repeats)
                plain = _least(lambda s: tracked(s, MemTracker), step, repeats)[0] if k == 1 else math.nan
                sol = cm.plan.solution
                rows.append({"model": name, "mesh": str(tuple(mesh)), "case": case, "tracker": measured,
                             "torch_tracker": plain, "bare": bare_peak, "heap": heap_peak,
                             "estimated": sol.estimated_memory, "phase": sol.memory_peak_phase,
                             "tracker_phases": phases})
    return rows
