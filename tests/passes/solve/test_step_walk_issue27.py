"""What issue 27's held-out models showed the step walk missed, each on its own: resident gradient
buckets, a node's backward intermediates, a tied weight's gradient contributions."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.passes.capture.backward_workspace import backward_workspace
from autoshard.passes.capture.export import capture
from autoshard.passes.solve.peak_timeline import StepTrace, peak_of


def _trace(**kw) -> StepTrace:
    n = len(kw.get("names", ["a", "b", "c"]))
    base = dict(names=["a", "b", "c"], kept=[0.0] * n, outputs=[0.0] * n, param_grads=[0.0] * n,
                grad_transient=[0.0] * n, recompute=[0.0] * n, reduce_after=[0.0] * n, reduce_frees=[0.0] * n,
                reduce_prefetch=[0.0] * n, gathered_backward=[0.0] * n, reduce_output=[0.0] * n,
                accumulate_after=[0.0] * n)
    base.update(kw)
    return StepTrace(**base)


def test_buckets_are_alive_from_the_first_op_and_hold_the_synced_gradients_after_the_step():
    # c is the loss: its backward holds a 50-byte gradient before any parameter gradient exists
    t = _trace(resident=100.0, grads=20.0, kept=[10.0, 10.0, 0.0], value_grads=[(2, 2, 50.0)],
               param_grads=[20.0, 0.0, 0.0], comm_buffer=20.0, grads_in_buckets=20.0)
    peak = peak_of(t)
    assert peak.phases["forward"] == 100 + 20 + 20          # resident + buckets + kept
    assert peak.bytes == 100 + 20 + 20 + 50 and peak.phase == "backward (c)"
    assert peak.phases["optimizer step"] == 100 + 20      # the gradients are views into the buckets
    # a gradient reduced in another dtype is cast back: its own bytes next to the bucket's
    assert peak_of(_trace(resident=100.0, grads=20.0, param_grads=[20.0, 0.0, 0.0], comm_buffer=10.0,
                          grads_in_buckets=0.0)).phases["optimizer step"] == 130.0


def test_zero_reduce_scatter_buckets_are_alive_only_from_the_first_zero_gradient_in_the_backward():
    # runtime.zero allocates a bucket's rows when its first gradient arrives (the parameter's last reader,
    # b), launches it once its last gradient has arrived and frees it once reduced; the plain all-reduce
    # buckets (comm_buffer) are kept all step
    from types import SimpleNamespace
    from autoshard.passes.solve.storage_trace import StorageTrace

    def walked(bucket_bytes):
        t = _trace(resident=100.0, grads=5.0, value_grads=[(2, 2, 50.0), (1, 1, 30.0)], param_grads=[0.0, 5.0, 0.0],
                   comm_buffer=1.0)
        storage = StorageTrace(bucket_bytes=bucket_bytes, staged=True)
        storage.parameter("w", SimpleNamespace(params=20.0, held_grads=0.0), zero_ways=4, reduced_bytes=20.0,
                          kind="fp32")
        storage.apply(t, {"w": 1}, microsteps=1, copies={})
        return t, peak_of(t)

    t, peak = walked(1000.0)  # one bucket: it reduces after the backward, its staged copy (gloo) then
    assert (t.reduce_scatter_buckets, t.reduce_scatter_from, t.reduce_scatter_end) == (20.0, 1, 40.0)
    assert peak.phases["forward"] == 100 + 1                # not in the forward
    # b: its whole gradient (20, grad_transient), the bucket's rows (20), its slice (5), b's own gradient (30)
    assert peak.bytes == 100 + 1 + 20 + 20 + 5 + 30 and peak.phase == "backward (b)"
    # the loss (c) runs before any ZeRO gradient exists: no bucket yet
    assert peak_of(_trace(resident=100.0, value_grads=[(2, 2, 50.0)], comm_buffer=1.0, reduce_scatter_buckets=40.0,
                          reduce_scatter_from=1)).bytes == 100 + 1 + 50
    # after the backward: every gradient, the last bucket and its staged copy
    assert peak_of(_trace(resident=100.0, grads=5.0, param_grads=[0.0, 5.0, 0.0], comm_buffer=1.0,
                          reduce_scatter_end=40.0)).phase == "backward (reduce-scatter)"
    # reduced and freed before the step: the slice's gradient and the after-step gather (output + slice)
    assert peak.phases["optimizer step"] == 100 + 1 + 5 + 20 * (1 + 1 / 4)
    t, _ = walked(8.0)  # several buckets: one filling, one reducing during the backward with its staged copy
    assert (t.reduce_scatter_buckets, t.reduce_scatter_end) == (16.0 + 8.0, 16.0)


def test_an_accumulation_is_counted_after_the_readers_backward_has_freed_its_inputs():
    # b's output gradient (30) is consumed by b's backward; then b's contribution to a's value and the
    # sum (2 x 8) are alive next to a's gradient (8, from c)
    t = _trace(resident=0.0, value_grads=[(0, 2, 8.0), (1, 2, 30.0)], accumulate_after=[0.0, 16.0, 0.0])
    assert peak_of(t).bytes == 8 + 30                      # the accumulation (8 + 16) never tops b's backward
    t = _trace(resident=0.0, value_grads=[(0, 2, 8.0), (1, 2, 1.0)], accumulate_after=[0.0, 16.0, 0.0])
    assert peak_of(t).bytes == 8 + 16 and peak_of(t).phase == "backward (b)"


def _loss_graph(vocab=512, n=64):
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(16, vocab)

        def forward(self, x):
            return self.fc(x).pow(2)
    x, y = torch.randn(n, 16), torch.randint(0, vocab, (n,))
    return capture(Head(), (x,), loss_fn=F.cross_entropy, target=y)


def test_cross_entropys_backward_holds_the_log_probabilities_gradient_and_mm_nothing():
    captured = _loss_graph()
    needs = {n.name for n in captured.gm.graph.nodes if n.op == "placeholder" and n.name in captured.params}
    by_op = {}
    for node in captured.gm.graph.nodes:
        if node.op == "call_function":
            needs.add(node.name)
            by_op[node.target.__name__.split(".")[0]] = backward_workspace(node, lambda a: a.name in needs)
    assert by_op["cross_entropy_loss"] == 64 * 512 * 4     # one logits-sized intermediate
    assert by_op["linear"] == 0
    assert by_op["pow"] == 2 * 64 * 512 * 4                # pow's backward: self.pow(1) and 2 * it


def test_a_tied_embeddings_step_peaks_at_the_embeddings_backward_with_three_gradients():
    vocab, d = 4096, 32

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)

        def forward(self, ids):
            return F.linear(self.emb(ids), self.emb.weight)
    with torch.device("meta"):
        model = Tied()
    ids = torch.empty(2, 8, dtype=torch.long, device="meta")
    plan = autoshard.plan(model, (1,), example_inputs=(ids,), hardware="cpu", example_target=ids, optimizer="sgd",
                          loss_fn=lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten()))
    weight = vocab * d * 4
    assert plan.memory_peak_phase == "backward (embedding)"
    # the weight (plain SGD keeps no state), and at the embedding's backward: the head's contribution,
    # the embedding's and their sum (the walk counted one gradient before: 2 x the weight)
    assert plan.estimated_memory >= weight * (1 + 3)
    assert plan.estimated_memory == pytest.approx(weight * 4, rel=0.05)
