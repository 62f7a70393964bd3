"""The whole-step peak walk (``passes.solve.peak_timeline``) on hand-made traces, and its place in plans."""
from __future__ import annotations

import json

from autoshard.passes.mesh import Mesh
from autoshard.passes.solve.peak_timeline import StepTrace, optimizer_temporaries, peak_of
from autoshard.passes.solve.solution import Solution
from autoshard.passes.solve.context import PlanContext


def _trace(**kw) -> StepTrace:
    n = len(kw.get("names", ["a", "b", "c"]))
    base = dict(names=["a", "b", "c"], kept=[0.0] * n, outputs=[0.0] * n, param_grads=[0.0] * n,
                grad_transient=[0.0] * n, recompute=[0.0] * n, reduce_after=[0.0] * n, reduce_frees=[0.0] * n,
                reduce_prefetch=[0.0] * n, gathered_backward=[0.0] * n, reduce_output=[0.0] * n)
    base.update(kw)
    return StepTrace(**base)


def test_backward_start_holds_everything_kept_plus_the_gradients_in_flight():
    # a -> b -> c, each keeps 10; b's output gradient (5) lives from c's backward to b's
    t = _trace(resident=100.0, grads=6.0, kept=[10.0, 10.0, 10.0], outputs=[1.0, 1.0, 1.0],
               value_grads=[(1, 2, 5.0)], param_grads=[6.0, 0.0, 0.0])
    peak = peak_of(t)
    assert peak.phases["forward"] == 100 + 30 + 1
    # backward at c: all 30 kept + b's gradient (made by c's backward) = 135; at b: 30 + 5 = 135
    assert peak.phases["backward"] == 135.0
    assert peak.phases["optimizer step"] == 106.0
    assert peak.bytes == 135.0 and peak.phase == "backward (c)"


def test_parameter_gradients_accumulate_as_kept_activations_are_freed():
    t = _trace(resident=0.0, grads=60.0, kept=[0.0, 0.0, 10.0], param_grads=[20.0, 20.0, 20.0])
    peak = peak_of(t)
    # at c: 10 kept + 20 made; at b: 20 + 20; at a: 40 + 20 = 60
    assert peak.phases["backward"] == 60.0 and peak.phase in ("backward (a)", "optimizer step")


def test_held_gradients_count_for_the_whole_last_microstep_and_the_summand_on_top():
    t = _trace(grads=30.0, grads_held=True, kept=[5.0, 0.0, 0.0], param_grads=[10.0, 10.0, 10.0])
    peak = peak_of(t)
    assert peak.phases["forward"] == 30 + 5
    assert peak.phases["backward"] == 30 + 5 + 10


def test_a_reduction_counts_the_earlier_groups_backward_prefetch_in_flight():
    # a gathered group read at a (first reader) and c; its reduce-scatter after a's backward holds
    # 2 x 40 (flat input and gloo's staging copy); the earlier group's prefetched gather (30 out +
    # 10 in) is in flight then, more than gathered_in_flight - frees (50 - 40)
    t = _trace(resident=100.0, kept=[0.0, 0.0, 0.0], reduce_after=[80.0, 0.0, 0.0], reduce_frees=[40.0, 0.0, 0.0],
               reduce_prefetch=[40.0, 0.0, 0.0], gathered_in_flight=50.0)
    assert peak_of(t).bytes == 100 + 40 + 80
    t.reduce_prefetch = [0.0, 0.0, 0.0]
    assert peak_of(t).bytes == 100 + max(50, 10 + 80)


def test_gathered_copies_in_the_backward_follow_the_groups_when_larger():
    t = _trace(resident=10.0, gathered_in_flight=5.0, gathered_backward=[0.0, 30.0, 0.0])
    peak = peak_of(t)
    assert peak.phases["backward"] == 40.0 and peak.phase == "backward (b)"
    assert peak.phases["forward"] == 15.0  # the forward keeps the step-wide figure


def test_with_held_gradients_the_reduced_shards_are_alive_next_to_them():
    # accumulation: every gradient (30) is held; the reduction after a's backward makes its shards (6)
    # before they are added in
    t = _trace(grads=30.0, grads_held=True, reduce_after=[20.0, 0.0, 0.0], reduce_frees=[10.0, 0.0, 0.0],
               reduce_output=[6.0, 0.0, 0.0])
    assert peak_of(t).phases["backward"] == 30 + 20 + 6
    t.grads_held = False
    assert peak_of(t).phases["backward"] == 20.0


def test_the_optimizer_phase_sets_the_peak_when_activations_are_small():
    t = _trace(resident=300.0, grads=100.0, optimizer_temporaries=100.0, kept=[1.0, 1.0, 1.0])
    assert peak_of(t).phase == "optimizer step" and peak_of(t).bytes == 500.0


def test_adamw_temporaries_follow_torchs_implementations():
    sizes = [10.0, 40.0, 20.0]
    assert optimizer_temporaries(sizes, "adamw", foreach=True) == 70.0  # one exp_avg_sq_sqrt per parameter
    assert optimizer_temporaries(sizes, "adamw", foreach=False) == 80.0  # sqrt and quotient of the largest
    assert optimizer_temporaries(sizes, "sgd", foreach=True) == 0.0


def test_the_peak_phase_survives_json():
    sol = Solution(mesh=Mesh.of(2), strategies={}, param_placements={}, estimated_memory=5.0,
                   memory_peak_phase="backward (linear_3)")
    again = Solution.from_json(json.loads(json.dumps(sol.to_json())))
    assert again.memory_peak_phase == "backward (linear_3)" and again.estimated_memory == 5.0


def test_a_planned_gpt_reports_its_peak_above_the_saved_activations_and_fits_its_limit():
    import torch
    from autoshard.passes.capture.export import capture
    from autoshard.passes.solve.lever_pins import LeverPins
    from autoshard.passes.solve.planner import plan_sharding
    from autoshard.testing.models import gpt, lm_loss
    model = gpt(vocab=512, d=64, n_layer=2, n_head=4, seq=32)[0]
    ids = torch.randint(0, 512, (8, 32))
    cg = capture(model, (ids,), loss_fn=lm_loss, target=ids)
    free = plan_sharding(cg, Mesh.of(4), PlanContext.of("h100"), levers=LeverPins())
    state = sum(free.memory_breakdown[k] for k in ("params", "grads", "optimizer"))
    assert free.estimated_memory > state + free.estimated["saved_activation_bytes"] / 2
    assert free.memory_peak_phase.split(" ")[0] in ("forward", "backward", "optimizer")
    limit = 0.6 * free.estimated_memory
    tight = plan_sharding(cg, Mesh.of(4), PlanContext.of("h100", memory_limit=limit), levers=LeverPins())
    assert tight.estimated_memory <= limit  # the peak, not the additive sum, fits

