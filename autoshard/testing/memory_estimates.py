"""Measured memory next to the plan's estimate, per lever case, on one rank (run it on every rank).

``memory_against_estimates(rank, models, cases)``: for each lever test model (``levers.build``) and
mesh, the ZeRO-3 layout ``levers.planned`` gives, and each lever case ``(name, accumulation,
checkpoint, reshard_after_forward)``, one step measured by ``runtime.memory_probe`` next to
``solution.evaluate``'s ``estimated`` for the same strategies and levers. Returns rows
``(model, mesh, case, saved, saved_estimated, gathered_peak, gathered_peak_estimated)``.

``peak_against_estimates(rank, models, cases)``: the same layouts and cases (models also from the
Hugging Face zoo: ``"hf:opt"``, ``"hf:gpt_neox"``, ``"hf:gemma"``, on (4,)), the whole step's peak:
torch's ``MemTracker`` (``MicrostepTracker``) around a step and AdamW's step after the first (the
least peak of ``REPEATS`` such steps), tracking the rank's parameters, gradients and optimizer
state (``runtime.local_module``), next to
``plan.estimated_memory`` (``peak_timeline``) and the phase it says sets it. Returns rows
``(model, mesh, case, measured_peak, estimated_peak, phase, measured_phase)`` (``measured_phase``:
the phases where ``MemTracker`` saw the step reach its peak, within 5%: "forward", "backward" or
"optimizer step", "|"-joined when two tie).

Used by ``tests/runtime/test_memory_estimates.py``, ``tests/runtime/test_memory_peak.py`` and
``benchmarks/memory_estimates.py``.
"""
from __future__ import annotations

import copy
import math

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from .levers import MICRO, Probed, layouts, policy_levers
from .tracker_hooks import gradients_not_held
from autoshard.passes.solve.context import PlanContext

__all__ = ["LEVER_CASES", "PEAK_CASES", "MicrostepTracker", "memory_against_estimates", "peak_against_estimates"]

#: (name, accumulation, checkpoint, reshard after forward): every lever, alone and combined
LEVER_CASES = (("none", 1, "none", False), ("selective + reshard", 1, "selective", True), ("full", 1, "full", False),
               ("acc 2 + full + reshard", 2, "full", True), ("acc 4 + selective", 4, "selective", False),
               ("acc 2 + reshard", 2, "none", True))

#: tracked steps per case; the smallest peak is the measure. A buffer a collective used can be freed
#: by gloo's worker thread a moment after the step moved on, so a step on busy cores sometimes
#: measures more than the program needs (seen: +48 KB, 12%, on one rank of four, with the machine
#: loaded); such noise only ever adds, so the least of a few steps is the program's own peak.
REPEATS = 3

#: the whole-step peak's lever cases
PEAK_CASES = (("none", 1, "none", False), ("full + reshard", 1, "full", True), ("selective", 1, "selective", False),
              ("acc 2", 2, "none", False), ("acc 2 + selective + reshard", 2, "selective", True))

class MicrostepTracker(MemTracker):
    """torch's ``MemTracker`` for a step of several microsteps: the program's GraphModule is called
    once per microstep, which ``MemTracker`` takes for a second iteration of a root module and
    refuses; this one clears that module's own statistics before such a call (the peak and the
    tracked storages are kept, so the step's peak is whole; the other root modules' statistics are kept,
    as a rank of an interleaved pipeline runs several stage programs in turn). ``peak_phases`` names the phases whose
    own peak comes within ``TIE`` of the step's: where a forward and a backward peak differ by a few
    transient buffers, either may be the step's peak from one run to the next.

    Why 5%: the measure moves between runs of the same program by a buffer or so (most likely a gloo
    collective's buffers, which gloo's worker thread releases a moment after ``wait()`` returns, so
    whether one still counts at a given op depends on thread timing; not proven). Seen on 4 ranks:
    the optimizer step's peak moving by 8 KiB (99,048 / 107,240 bytes) between runs of the same
    program, and a CI run where ``hf_llama`` on (4,) measured its peak in the forward though its
    forward and backward peaks differ by 2.4% (335,696 / 343,892) in every local run. A phase is named
    alone only when it leads the others by more than such transients.

    It also keeps ``ModTracker`` from holding every gradient that passes a module input until the
    module's backward ends: a compiled program takes its parameters as inputs, so under plain
    ``MemTracker`` each parameter gradient is alive twice to the end of the backward, which no step
    without the tracker does (``tracker_hooks.gradients_not_held``)."""

    TIE = 0.05  #: phases within 5% of the step's peak all set it

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._phase_peak: dict[str, float] = {}

    def __enter__(self) -> "MicrostepTracker":
        if self._depth == 0:
            self._not_held = gradients_not_held(self._mod_tracker)
            self._not_held.__enter__()
        return super().__enter__()

    def __exit__(self, *args) -> None:
        super().__exit__(*args)
        if self._depth == 0:
            self._not_held.__exit__(None, None, None)

    def _update_peak_stats(self, peak_state) -> None:
        """After every op: the step's peak per device (what ``get_tracker_snapshot("peak")`` returns, as
        ``MemTracker`` keeps it) and each phase's. Not ``MemTracker``'s per-module peaks: its version
        also loops over every tracked module after every op and deep-copies a snapshot at each module's
        new peak, which no user of this tracker reads (they read the step's peak). Without that: the
        same peaks, bit for bit, for ~17% less CPU per rank on ``test_memory_peak``'s models."""
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                self._peak_mem[dev] = dev_snap["Total"]
                self._peak_mem_snap[dev] = copy.deepcopy(dev_snap)
        phase = "optimizer step" if self._in_opt else "backward" if self._mod_tracker.is_bw else "forward"
        current = float(sum(snap["Total"] for snap in self._curr_mem_snap.values()))
        self._phase_peak[phase] = max(self._phase_peak.get(phase, 0.0), current)

    @property
    def peak_phases(self) -> str:
        """The phases at the step's peak (within ``TIE``), "|"-joined, highest first."""
        if not self._phase_peak:
            return ""
        top = max(self._phase_peak.values())
        return "|".join(p for p, v in sorted(self._phase_peak.items(), key=lambda kv: -kv[1])
                        if v >= (1.0 - self.TIE) * top)

    def _pre_fw_hook(self, module, inputs) -> None:
        tracker = self._mod_tracker
        if (module in self.memory_tracking and not tracker.is_bw
                and set(tracker.parents) - {tracker.get_known_fqn(module)} == {"Global"}):
            # only this root's statistics: a rank running several stages (interleaved 1F1B) calls
            # another stage's program between a forward and its backward, whose backward hooks then
            # look its statistics up (clearing them all raised KeyError in ``_pre_bw_hook``)
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)


def memory_against_estimates(rank: int, models, cases=LEVER_CASES, captures=None) -> list[tuple]:
    """See the module docstring. ``models``: ``[(name, [mesh_shape, ...]), ...]``; ``captures``:
    ``levers.layout_captures(models)`` made once for every rank (``run_ranks(prepare=)``), else made here."""
    from autoshard.passes.mesh import Mesh
    from autoshard.passes.solve.solution import evaluate
    from autoshard.runtime.executor import RankProgram

    rows = []
    for lay in layouts(rank, models, captures):
        for case, k, checkpoint, reshard in cases:
            levers = policy_levers(lay.model_name, k, checkpoint, reshard)
            probed = Probed(RankProgram.of_strategies(lay.captured, lay.strategies, lay.mesh_shape, env=lay.env, model=lay.model,
                                        levers=levers))
            x, y = lay.batch(MICRO * k, 1)
            probed.step(**x, target=y) if isinstance(x, dict) else probed.step(*x, target=y)
            est = evaluate(lay.captured, Mesh.of(lay.mesh_shape), lay.strategies, PlanContext.of("cpu", optimizer="adamw"),
                           levers=levers, traced_at_microbatch=True).estimated
            rows.append((lay.model_name, str(lay.mesh_shape), case, probed.measured["saved"],
                         est["saved_activation_bytes"], probed.measured["gathered"], est["gathered_peak_bytes"]))
    return rows


def peak_against_estimates(rank: int, models, cases=PEAK_CASES, captures=None) -> list[tuple]:
    """See the module docstring. ``models``: ``[(name, [mesh_shape, ...]), ...]``; ``captures`` as in
    ``memory_against_estimates``."""
    from autoshard.passes.mesh import Mesh
    from autoshard.passes.solve.solution import evaluate
    from autoshard.runtime.executor import RankProgram
    from autoshard.runtime.local_module import local_module

    rows = []
    for lay in layouts(rank, models, captures):
        model_name, mesh_shape, captured, strategies, batch = (lay.model_name, lay.mesh_shape, lay.captured,
                                                               lay.strategies, lay.batch)
        for case, k, checkpoint, reshard in cases:
            levers = policy_levers(model_name, k, checkpoint, reshard)
            program = RankProgram.of_strategies(captured, strategies, mesh_shape, env=lay.env, model=lay.model, levers=levers)
            optimizer = torch.optim.AdamW(program.parameters(), lr=1e-3)
            x, y = batch(MICRO * k, 1)
            args = tuple(x.values()) if isinstance(x, dict) else x  # traced inputs, in order

            def step():
                program.step(*args, target=y)
                optimizer.step()

            step()  # the first step creates the optimizer state
            measured, phases = math.inf, ""
            for _ in range(REPEATS):
                optimizer.zero_grad()
                tracker = MicrostepTracker()
                tracker.track_external(local_module(program), optimizer)
                with tracker:
                    step()
                peak = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
                if peak < measured:
                    measured, phases = peak, tracker.peak_phases
            sol = evaluate(captured, Mesh.of(mesh_shape), strategies, PlanContext.of("cpu", optimizer="adamw"),
                           levers=levers, traced_at_microbatch=True)
            rows.append((model_name, str(mesh_shape), case, measured, sol.estimated_memory, sol.memory_peak_phase,
                         phases))
    return rows
