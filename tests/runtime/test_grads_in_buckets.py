"""Gradients accumulate in their all-reduce buckets (``runtime.gradsync``, DDP's gradient_as_bucket_view).

On 4 gloo ranks, the toy GPT (tied embedding and head) on mesh (4,), under the solver's plan with
every parameter replicated, accumulation 2 and every block checkpointed, and under a random plan: trained next to one device,
then stepped without ``zero_grad`` (gradients add up across steps), after ``zero_grad(set_to_none=False)``
(the buckets' zeros are kept, nothing set aside), and after an optimizer-like replacement of every
``.grad`` by a copy (plain SGD, gradients compared within 1e-5 once the parameters carry its rounding). A dispatch mode counts the copies into bucket storage during each step: none,
where before the change every synced gradient was copied into its bucket once per step. A
parameter that receives no gradient keeps ``None``. ZeRO-1 buckets on gloo are all-reduced in place
(no copy of a whole bucket in a step; gloo's reduce-scatter copied each) and match one device.
"""
from __future__ import annotations

import copy

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.testing.ranks import run_ranks


class _BucketCopies(TorchDispatchMode):
    """Counts ``copy_`` calls (more than one element) whose destination lives in one of ``flats``."""

    def __init__(self, flats):
        super().__init__()
        self.storages = {f.untyped_storage().data_ptr() for f in flats}
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default and args[0].numel() > 1 \
                and args[0].untyped_storage().data_ptr() in self.storages:
            self.count += 1
        return func(*args, **(kwargs or {}))


def _worker(rank: int, world: int) -> dict:
    import autoshard
    from autoshard.runtime.gradsync import GradSync
    from autoshard.testing.equivalence import Tolerance, compiled_gradient_mismatches, train_against_one_device
    from autoshard.testing.models import gpt
    from autoshard.testing.zoo_check import sgd

    torch.set_num_threads(1)
    bad, copies, synced = [], {}, {}
    # replicated parameters pinned: the solver's own choice may shard or ZeRO every one (then nothing
    # goes through the grad sync's buckets), and the buckets are what this test is about
    for label, levers in (("replicated, accumulation 2, checkpointed",
                           dict(accumulation=2, checkpoint="full", params={"*": ("R",)})),
                          ("random plan 5", dict(random_seed=5))):
        torch.manual_seed(0)
        model, (ids,), target, loss_fn = gpt()
        ref = copy.deepcopy(model)
        cm = autoshard.compile(model, (4,), example_inputs=(ids,), loss_fn=loss_fn, example_target=target,
                               hardware="cpu", time_limit_s=10, **levers)
        syncs = list(cm._program._syncs.values())
        synced[label] = sum(s.num_params for s in syncs)
        flats = [f for s in syncs for f in s.flat_buffers()]
        counts = copies.setdefault(label, [])

        class Counted:  # the program, each step under the copy counter
            def __getattr__(self, name):
                return getattr(cm, name)

            def step(self, *a, **kw):
                with _BucketCopies(flats) as mode:
                    out = cm.step(*a, **kw)
                counts.append(mode.count)
                return out

        prog = Counted()
        bad += train_against_one_device(label, prog, ref, ((ids,), target), loss_fn=loss_fn, steps=1,
                                        optimizer=sgd)
        opt, ref_opt = sgd(cm.parameters()), sgd(ref.parameters())
        tol = Tolerance(grad_atol=1e-5)  # the parameters differ by the SGD steps' rounding by then

        def both_step(what: str):
            prog.step(ids, target=target)
            loss_fn(ref(ids), target).backward()
            bad.extend(compiled_gradient_mismatches(f"{label}, {what}", cm, ref, tol))

        both_step("a step after set_to_none")
        both_step("a second step without zero_grad (gradients add up)")
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=False)
        both_step("after zero_grad(set_to_none=False)")
        for o in (opt, ref_opt):
            o.step()
        for p in cm.parameters():  # an optimizer that replaces .grad (clipping out of place, say)
            if p.grad is not None:
                p.grad = p.grad.clone()
        for o in (opt, ref_opt):
            o.zero_grad(set_to_none=False)
        both_step("after .grad was replaced")
        for s in syncs:
            for b in s.buckets:
                for p in b.params:
                    if p.grad is not None and p.grad.untyped_storage().data_ptr() != b.flat.untyped_storage().data_ptr():
                        bad.append(f"{label}: a synced gradient is not a view of its bucket after the step")

    # ZeRO-1 on gloo: each bucket's rows are all-reduced in place (gloo's reduce-scatter would copy them whole
    # first, then copy this rank's chunk out); the same sums, so the training matches one device
    torch.manual_seed(0)
    model, (ids,), target, loss_fn = gpt()
    ref = copy.deepcopy(model)
    cm = autoshard.compile(model, (4,), example_inputs=(ids,), loss_fn=loss_fn, example_target=target,
                           hardware="cpu", params={"*": ("R/zero1",)})
    bad += train_against_one_device("zero1", cm, ref, ((ids,), target), loss_fn=loss_fn, steps=2, optimizer=sgd)
    zero = cm._program._zero
    rows = {len(zero_bucket.members) and 4 * zero_bucket.numel for zero_bucket in zero.buckets}
    from torch.profiler import profile
    with profile(record_shapes=True) as prof:
        cm.step(ids, target=target)
    whole_copies = sum(1 for e in prof.events() if e.name == "aten::copy_" and e.input_shapes
                       and e.input_shapes[0] and len(e.input_shapes[0]) == 1 and e.input_shapes[0][0] in rows)
    if whole_copies:
        bad.append(f"zero1: {whole_copies} copies of a whole bucket's rows in a step (buckets of {sorted(rows)})")

    # a parameter that receives no gradient in the step keeps None (an optimizer then skips it)
    used, unused = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    sync = GradSync([(used, cm._program.env.comm_for([0])), (unused, cm._program.env.comm_for([0]))])
    sync.begin_step()
    sync.arm()
    (used * (rank + 1)).sum().backward()
    sync.finish()
    if unused.grad is not None or not torch.equal(used.grad, torch.full((4,), 10.0)) or sync.copies:
        bad.append(f"unused parameter: grad {unused.grad}, used {used.grad}, copies {sync.copies}")
    return {"bad": bad, "copies": copies, "synced": synced}


def test_gradients_accumulate_in_their_buckets_on_4_ranks():
    results = run_ranks(_worker, 4, timeout=300)
    for rank, r in enumerate(results):
        assert r["bad"] == [], f"rank {rank}:\n" + "\n".join(r["bad"])
    for label, n in results[0]["synced"].items():
        assert n > 0, f"{label}: no parameter is all-reduced by the grad sync, nothing was tested"
    for label, counts in results[0]["copies"].items():
        assert len(counts) == 5 and counts == [0] * 5, f"{label}: copies into buckets per step {counts}"
