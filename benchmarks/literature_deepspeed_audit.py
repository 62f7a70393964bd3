"""What DeepSpeed's pipeline engine does per microbatch and per step beyond Megatron-LM's runtime, priced
on a held-out MT-NLG row's own sizes, next to what the row misses: which of them the planner prices
(``layouts.megatron(blocking_p2p=True, deepspeed_partitioned_tensors=True)``) and how big the rest are.

    python benchmarks/literature_deepspeed_audit.py [--row 420]

Sources (DeepSpeed of 2021-10, 1fc74cb; Megatron-DeepSpeed of 2021-11, acc3e9b5):
- deepspeed/runtime/utils.py ``PartitionedTensor``: ``_partition_tensor`` clones the sender's piece;
  ``full()`` zero-fills a whole buffer, copies the piece in, ``dist.all_gather``s into a list (torch's
  NCCL backend copies out of its flat buffer) and clones the result;
- deepspeed/runtime/pipe/engine.py: ``_exec_recv_activations`` clones the received piece and
  ``_exec_forward_pass`` clones the input buffer again; ``_exec_backward_pass`` gathers the stage's own
  output again (``part_output.full()``); ``_exec_forward_pass`` starts ``tput_timer`` (utils/timer.py
  ``ThroughputTimer.start``: ``torch.cuda.synchronize()`` every forward); ``PartitionedTensor.from_meta``
  reads the metadata with ``meta.tolist()`` (a host sync per received piece);
- deepspeed/runtime/engine.py ``allreduce_bucket`` / ``allreduce_and_copy`` (the data-parallel gradient
  all-reduce after the pipeline, ``_exec_reduce_grads``): flatten, all-reduce, post-scale ``mul_``,
  copy back: 12 bytes per fp16 gradient element besides the all-reduce;
- deepspeed/runtime/fp16/fused_optimizer.py ``FP16_Optimizer.step``: fp16 gradients cast to fp32 and
  flattened (6 + 8), the norm (4), unscale and clip (8), fused Adam (28), the fp32 copy back (6): 60 bytes
  per element, as Megatron-LM's optimizer (``optimizer_step.MEGATRON_ADAM_STEP_BYTES``), which the row
  prices with.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import literature  # noqa: E402
from literature_deepspeed import held_out_row_of_args, planner_stage_costs  # noqa: E402
from autoshard.passes.pipeline.stages.partitioned_tensors import copy_seconds, gather_copy_bytes, piece_copy_bytes  # noqa: E402

#: DeepSpeed's allreduce_bucket besides the all-reduce, per fp16 element: flatten (2 + 2), post-scale
#: mul_ (2 + 2), copy back (2 + 2)
ALLREDUCE_BUCKET_COPY_BYTES = 12.0


def main() -> None:
    row = held_out_row_of_args()
    prob, starts, recompute, step = planner_stage_costs(row)
    hw = literature.HARDWARE[row.hardware]
    tp, p, m = row.layout.tp, len(starts), prob.m
    mid = p // 2
    a, e = starts[mid], starts[mid + 1]
    whole = prob.cut_bytes[e - 1]  # one microbatch's boundary, per rank, held whole on tp
    layers, h = e - a, 20480
    params = layers * (12 * h * h + 13 * h) / tp  # the middle stage's parameters per rank (biases approximate)
    gather = copy_seconds(hw, gather_copy_bytes(whole, tp))
    piece = copy_seconds(hw, piece_copy_bytes(whole, tp))
    rows = [
        ("per microbatch", "receiver's full() copies, activation and gradient", 2 * gather, True),
        ("per microbatch", "sender's piece clone, output and input gradient", 2 * piece, True),
        ("per microbatch", "sender's second gather of its output (all-gather + copies)",
         prob.regather_seconds[e - 1] if prob.regather_seconds else 0.0, prob.regather_seconds is not None),
        ("per microbatch", "receiver's two clones of the received piece", copy_seconds(hw, 2 * piece_copy_bytes(whole, tp)), False),
        ("per step", "data-parallel all-reduce of the stage's gradients", sum(prob.grad_sync[a:e]), True),
        ("per step", "allreduce_bucket's flatten, scale, copy back", copy_seconds(hw, ALLREDUCE_BUCKET_COPY_BYTES * params), False),
        ("per step", "FP16_Optimizer step (60 B/element, priced as megatron_adam's 60)",
         sum(prob.opt_step[a:e]) if prob.opt_step else 0.0, True),
    ]
    print(f"{row.name}: p {p}, m {m}, planner step {step:.3f} s vs measured {row.measured_step():.3f} s; a middle stage "
          f"({layers} blocks, {params / 1e9:.2f} B parameters per rank), boundary {whole / 1e6:.1f} MB per rank")
    print(f"{'when':<15} {'what DeepSpeed does (2021)':<62} {'ms':>9}  priced")
    for when, what, seconds, priced in rows:
        print(f"{when:<15} {what:<62} {seconds * 1e3:>9.3f}  {'yes' if priced else 'no'}")
    left_mb = sum(s for w, _, s, pr in rows if w == "per microbatch" and not pr)
    left_step = sum(s for w, _, s, pr in rows if w == "per step" and not pr)
    print(f"unpriced: {left_mb * 1e3:.3f} ms per microbatch, {left_step * 1e3:.1f} ms per step; host syncs not priced "
          f"(no GPU constant): one torch.cuda.synchronize per forward, one meta.tolist() per received piece (2 per "
          f"microbatch)")
    print("the three rows' fit (benchmarks/literature.py --held-out) misses ~25 ms per microbatch and ~7 s per step")


if __name__ == "__main__":
    main()
