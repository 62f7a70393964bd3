"""``cm.clip_grad_norm_`` equals ``torch.nn.utils.clip_grad_norm_`` on one device, for every layout.

On 4 gloo ranks: data parallel, FSDP, Megatron tensor parallel on (2, 2), randomly drawn 2-D plans (a
mix of everything) and a pipeline with a tied embedding. Each case takes one step on the same batch as a
single-device copy, clips with a max norm small enough to bite, and compares the returned norm and
the parameters after an SGD step (lr 1: the parameters move by exactly the clipped gradient). The 2-norm
and the inf norm are both checked. Counting a replicated gradient once per replica, or a tied weight
once per stage, would give a different norm.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch

from autoshard.testing.ranks import run_ranks

RTOL, ATOL = 1e-4, 1e-6


def _cases(model_name: str):
    from autoshard import presets
    if model_name == "mlp":
        return [("dp", (4,), {"params": {"*": ("R",)}}),
                ("fsdp", (4,), {"params": {"*": ("S(0)",)}}),
                ("tp", (2, 2), "megatron"),
                ("random 2-D a", (2, 2), {"random_seed": 3}),
                ("random 2-D b", (2, 2), {"random_seed": 11})]
    return [("pipeline", (4,), {"pp": 2, "schedule": "1f1b", "microbatches": 2, "time_limit_s": 5})]


def clip_worker(rank: int, world: int, model_name: str) -> list:
    import autoshard
    from autoshard import presets
    from autoshard.testing.models import gpt_pipeline, mlp
    failures = []
    for norm_type in (2.0, math.inf):
        for label, mesh, kw in _cases(model_name):
            torch.manual_seed(0)
            model, inputs, target, loss_fn = (mlp() if model_name == "mlp" else gpt_pipeline(n_layer=2)[:4])
            if kw == "megatron":
                kw = presets.megatron_mlp(model, ["fc1"], ["fc2"], mesh)
            ref = copy.deepcopy(model)
            cm = autoshard.compile(model, mesh, example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                                   hardware="cpu", **kw)
            cm.step(*inputs, target=target)
            loss_fn(ref(*inputs), target).backward()
            max_norm = 0.5 * torch.nn.utils.get_total_norm([p.grad for p in ref.parameters()], norm_type).item()
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type)
            got = cm.clip_grad_norm_(max_norm, norm_type)
            case = f"{label} norm {norm_type}"
            if not math.isclose(got.item(), want.item(), rel_tol=RTOL):
                failures.append(f"{case}: norm {got.item():.7g}, one device {want.item():.7g}")
            torch.optim.SGD(cm.parameters(), lr=1.0).step()
            torch.optim.SGD(ref.parameters(), lr=1.0).step()
            full = cm.full_state_dict()
            for key, value in ref.state_dict().items():
                if not torch.allclose(full[key], value, rtol=RTOL, atol=ATOL):
                    failures.append(f"{case}: {key} after the clipped step differs from one device by "
                                    f"{(full[key] - value).abs().max().item():.3g}")
    return failures


@pytest.mark.slow  # a sweep of layouts and random plans; the pipeline clip test stays fast
def test_clip_grad_norm_equals_one_device_for_dp_fsdp_tp_and_random_2d_plans():
    failures = run_ranks(clip_worker, 4, "mlp", timeout=300)
    assert failures == [[]] * 4, failures


def test_clip_grad_norm_equals_one_device_on_a_pipeline_with_a_tied_embedding():
    failures = run_ranks(clip_worker, 4, "gpt", timeout=300)
    assert failures == [[]] * 4, failures
