"""torchtitan's op-level selective activation checkpointing (``checkpoint="selective_op"``): it trains as
one device does, and the cost model prices as recomputed exactly the matmul work the runtime recomputes.

- 4 gloo ranks, ``autoshard.compile(layout=layouts.fsdp(checkpoint="selective_op"))`` on the lever tests'
  GPT: the loss at every step and the parameters after 3 AdamW steps match one device, and the program
  checkpoints its blocks under that policy.
- One process: torch's ``FlopCounterMode`` around one training step under "selective_op" and under "none";
  the extra matmul / attention FLOPs are what the recomputation ran. The planner's pricing
  (``LeverPricer``) marks the ops it recomputes (its seconds above the no-policy price); their forward
  FLOPs (``matmul_flops``) must be exactly that extra, and they must be the ops the policy does not keep
  and the recomputation reaches: per GPT block the 2nd plain ``mm`` (k) and the biased linears
  (``addmm``, off torchtitan's list) but the last, where torch's early stop ends the recomputation.
"""
from __future__ import annotations

import copy

import torch

from autoshard.testing.equivalence import Tolerance, adamw, failures_of, train_against_one_device
from autoshard.testing.levers import MICRO, build
from autoshard.testing.ranks import run_ranks

TOL = Tolerance(rtol=1e-4, atol=2e-5)


def _compiled(mesh, checkpoint: str):
    import autoshard
    from autoshard import layouts
    torch.manual_seed(0)
    model, batch, loss_fn, _ = build("gpt")
    inputs, target = batch(MICRO, 0)
    kw = dict(example_inputs=inputs, loss_fn=loss_fn, example_target=target, hardware="cpu")
    plan = autoshard.plan(model, mesh, layout=layouts.fsdp(checkpoint=checkpoint), **kw)
    cm = autoshard.compile(model, mesh, plan=plan, **kw)
    return cm, model, batch, loss_fn


def op_level_worker(rank: int, world: int) -> list:
    from autoshard.runtime.regions import CheckpointRegion
    torch.set_num_threads(1)
    cm, model, batch, loss_fn = _compiled((4,), "selective_op")
    failures = train_against_one_device("gpt fsdp selective_op", cm, copy.deepcopy(model),
                                        lambda step: batch(MICRO, 100 + step), loss_fn=loss_fn,
                                        optimizer=adamw(), tol=TOL)
    policies = {m.policy for m in cm.program.modules() if isinstance(m, CheckpointRegion)}
    if policies != {"selective_op"}:
        failures.append(f"rank {rank}: checkpoint regions ran {policies}, not selective_op")
    return failures


def test_op_level_checkpoint_trains_as_one_device():
    failures = failures_of(run_ranks(op_level_worker, 4, timeout=300))
    assert not failures, "\n".join(failures)


def _step_kernel_flops(checkpoint: str) -> float:
    from torch.utils.flop_counter import FlopCounterMode
    cm, _, batch, _ = _compiled((1,), checkpoint)
    inputs, target = batch(MICRO, 1)
    with FlopCounterMode(display=False) as counter:
        cm.step(*inputs, target=target)
    return counter.get_total_flops(), cm


def test_priced_recompute_is_what_the_op_level_policy_recomputes():
    from autoshard.passes.cost.hardware import PRESETS
    from autoshard.passes.cost.facts import matmul_flops
    from autoshard.passes.solve.blocks import block_map
    from autoshard.passes.levers import BlockPolicy
    from autoshard.passes.solve.lever_costs import LeverPricer, policy_index
    from autoshard.passes.solve.solution import pricing_for
    torch.set_num_threads(1)
    plain, _ = _step_kernel_flops("none")
    op_level, cm = _step_kernel_flops("selective_op")
    plan = cm.plan
    captured, strategies = plan.captured, plan.solution.strategies
    facts, cost = pricing_for(captured, plan.mesh, PRESETS["cpu"], "adamw", 1)
    pricer = LeverPricer(captured, facts, cost, block_map(captured, facts))
    in_blocks = [n for n in pricer.blocks.instance if facts.kind.get(n) == "op"]
    priced = []
    for name in in_blocks:
        base, price = pricer.node(name, strategies[name], policy_index(BlockPolicy("selective_op", True)))
        if price.seconds > base.seconds:
            priced.append(name)
    assert sorted(priced) == sorted(pricer.op_level_recomputed(in_blocks))
    nodes = {n.name: n for n in captured.gm.graph.nodes}
    kernels = {n: matmul_flops(nodes[n]) for n in priced if matmul_flops(nodes[n])}
    fqn = {n: str(nodes[n].meta.get("nn_module_stack", {}) and list(nodes[n].meta["nn_module_stack"].values())[-1][0])
           for n in kernels}
    # per block: k (the 2nd mm), o and fc (addmm) re-run; q, v (1st and 3rd mm) and attention are kept;
    # out (addmm) is the block's last packing op and packs only operands: the recomputation stops first
    assert sorted(fqn.values()) == sorted(f"model.blocks.{i}.{m}" for i in range(2) for m in ("k", "o", "fc")), fqn
    assert op_level - plain == sum(kernels.values()) > 0, (op_level, plain, kernels)
