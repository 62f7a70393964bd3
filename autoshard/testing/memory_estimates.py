"""Measured memory next to the plan's estimate, per lever case, on one rank (run it on every rank).

``memory_against_estimates(rank, models, cases)``: for each lever test model (``levers.build``) and
mesh, the ZeRO-3 layout ``levers.planned`` gives, and each lever case ``(name, accumulation,
checkpoint, reshard_after_forward)``, one step measured by ``runtime.memory_probe`` next to
``solution.evaluate``'s ``estimated`` for the same strategies and levers. Returns rows
``(model, mesh, case, saved, saved_estimated, gathered_peak, gathered_peak_estimated)``.

``peak_against_estimates(rank, models, cases)``: the same layouts and cases (models also from the
Hugging Face zoo: ``"hf:opt"``, ``"hf:gpt_neox"``, ``"hf:gemma"``, on (4,)), the whole step's peak:
torch's ``MemTracker`` (``MicrostepTracker``) around the second step and AdamW's step, tracking
the rank's parameters, gradients and optimizer state (``runtime.local_module``), next to
``plan.estimated_memory`` (``peak_timeline``) and the phase it says sets it. Returns rows
``(model, mesh, case, measured_peak, estimated_peak, phase, measured_phase)`` (``measured_phase``:
where ``MemTracker`` saw the peak: "forward", "backward" or "optimizer step").

Used by ``tests/runtime/test_memory_estimates.py``, ``tests/runtime/test_memory_peak.py`` and
``benchmarks/memory_estimates.py``.
"""
from __future__ import annotations

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from .levers import BLOCK_TYPES, MICRO, Probed, build, planned

__all__ = ["LEVER_CASES", "PEAK_CASES", "MicrostepTracker", "memory_against_estimates", "peak_against_estimates"]

#: (name, accumulation, checkpoint, reshard after forward): every lever, alone and combined
LEVER_CASES = (("none", 1, "none", False), ("selective + reshard", 1, "selective", True), ("full", 1, "full", False),
               ("acc 2 + full + reshard", 2, "full", True), ("acc 4 + selective", 4, "selective", False),
               ("acc 2 + reshard", 2, "none", True))

#: the whole-step peak's lever cases
PEAK_CASES = (("none", 1, "none", False), ("full + reshard", 1, "full", True), ("selective", 1, "selective", False),
              ("acc 2", 2, "none", False), ("acc 2 + selective + reshard", 2, "selective", True))

_ZOO_BLOCKS = {"hf:opt": "model.decoder.layers.#", "hf:gpt_neox": "gpt_neox.layers.#", "hf:gemma": "model.layers.#"}


class MicrostepTracker(MemTracker):
    """torch's ``MemTracker`` for a step of several microsteps: the program's GraphModule is called
    once per microstep, which ``MemTracker`` takes for a second iteration of a root module and
    refuses; this one clears its per-module statistics before such a call (the peak and the
    tracked storages are kept, so the step's peak is whole). ``peak_phase`` names the phase the
    peak was reached in."""

    peak_phase = ""  #: "forward", "backward" or "optimizer step": where the peak was reached

    def _update_peak_stats(self, peak_state) -> None:
        before = sum(self._peak_mem.values())
        super()._update_peak_stats(peak_state)
        if sum(self._peak_mem.values()) > before:
            self.peak_phase = ("optimizer step" if self._in_opt else
                               "backward" if self._mod_tracker.is_bw else "forward")

    def _pre_fw_hook(self, module, inputs) -> None:
        tracker = self._mod_tracker
        if (module in self.memory_tracking and not tracker.is_bw
                and set(tracker.parents) - {tracker.get_known_fqn(module)} == {"Global"}):
            self.reset_mod_stats()
        super()._pre_fw_hook(module, inputs)


def memory_against_estimates(rank: int, models, cases=LEVER_CASES) -> list[tuple]:
    """See the module docstring. ``models``: ``[(name, [mesh_shape, ...]), ...]``."""
    from autoshard.passes.levers import BlockPolicy, Levers
    from autoshard.passes.mesh import Mesh
    from autoshard.passes.solve.solution import evaluate
    from autoshard.runtime.executor import RankProgram

    rows = []
    for model_name, mesh_shape, env, captured, model, batch, strategies in _layouts(rank, models):
        for case, k, checkpoint, reshard in cases:
            levers = Levers(k, {BLOCK_TYPES[model_name]: BlockPolicy(checkpoint, reshard)})
            probed = Probed(RankProgram(captured, strategies, mesh_shape, env=env, model=model, levers=levers))
            x, y = batch(MICRO * k, 1)
            probed.step(**x, target=y) if isinstance(x, dict) else probed.step(*x, target=y)
            est = evaluate(captured, Mesh.of(mesh_shape), strategies, "cpu", "adamw", levers=levers,
                           traced_at_microbatch=True).estimated
            rows.append((model_name, str(mesh_shape), case, probed.measured["saved"],
                         est["saved_activation_bytes"], probed.measured["gathered"], est["gathered_peak_bytes"]))
    return rows


def peak_against_estimates(rank: int, models, cases=PEAK_CASES) -> list[tuple]:
    """See the module docstring. ``models``: ``[(name, [mesh_shape, ...]), ...]``."""
    from autoshard.passes.levers import BlockPolicy, Levers
    from autoshard.passes.mesh import Mesh
    from autoshard.passes.solve.solution import evaluate
    from autoshard.runtime.executor import RankProgram
    from autoshard.runtime.local_module import local_module

    rows = []
    for model_name, mesh_shape, env, captured, model, batch, strategies in _layouts(rank, models):
        block = _ZOO_BLOCKS.get(model_name) or BLOCK_TYPES[model_name]
        for case, k, checkpoint, reshard in cases:
            levers = Levers(k, {block: BlockPolicy(checkpoint, reshard)})
            program = RankProgram(captured, strategies, mesh_shape, env=env, model=model, levers=levers)
            optimizer = torch.optim.AdamW(program.parameters(), lr=1e-3)
            x, y = batch(MICRO * k, 1)
            args = tuple(x.values()) if isinstance(x, dict) else x  # traced inputs, in order

            def step():
                program.step(*args, target=y)
                optimizer.step()

            step()  # the first step creates the optimizer state
            optimizer.zero_grad()
            tracker = MicrostepTracker()
            tracker.track_external(local_module(program), optimizer)
            with tracker:
                step()
            measured = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
            sol = evaluate(captured, Mesh.of(mesh_shape), strategies, "cpu", "adamw", levers=levers,
                           traced_at_microbatch=True)
            rows.append((model_name, str(mesh_shape), case, measured, sol.estimated_memory, sol.memory_peak_phase,
                         tracker.peak_phase))
    return rows


def _layouts(rank: int, models):
    """(model name, mesh shape, env, captured, model, batch, this rank's strategies) per model and mesh."""
    from autoshard.passes.capture.export import capture
    from autoshard.passes.mesh import Mesh
    from autoshard.runtime.groups import setup_distributed

    torch.set_num_threads(1)
    for model_name, meshes in models:
        torch.manual_seed(0)
        model, batch, loss_fn, layers = _zoo_build(model_name) if model_name in _ZOO_BLOCKS else build(model_name)
        inputs, target = batch(MICRO, 0)
        captured = capture(model, inputs, loss_fn=loss_fn, target=target)
        for mesh_shape in meshes:
            env = setup_distributed(Mesh.of(mesh_shape))
            yield model_name, mesh_shape, env, captured, model, batch, planned(captured, model, mesh_shape, layers,
                                                                              rank, env)


def _zoo_build(name: str):
    """A Hugging Face zoo model (``hf_zoo``) in ``levers.build``'s form (no Megatron layers)."""
    from .hf_zoo import SEQ, VOCAB, ZOO
    model, _, _, loss_fn = ZOO[name.split(":", 1)[1]]()

    def batch(n: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        return ({"input_ids": torch.randint(0, VOCAB, (n, SEQ), generator=g)},
                torch.randint(0, VOCAB, (n, SEQ), generator=g))

    return model, batch, loss_fn, None
