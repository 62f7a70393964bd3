"""DeepSpeed's pipeline engine gathers stage boundaries sent as 1/tp pieces with ``PartitionedTensor``:
``autoshard.plan(layout=megatron(..., deepspeed_partitioned_tensors=True))`` prices its copies around
every gather and send and the sender's second gather of its own output before its backward
(``passes/pipeline/stages/partitioned_tensors.py``). Meta-device model, one process."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import autoshard
from autoshard import layouts
from autoshard.layouts import LayoutError
from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.cost.model import CostModel
from autoshard.passes.mesh import Mesh
from autoshard.testing.models import GPT, lm_loss

BATCH, SEQ, DIM = 64, 256, 1024
#: each rank group (dp 2 x tp 2) a node: the stage boundary crosses the network, its pieces are
#: all-gathered over NVLink
FOUR_PER_NODE = dataclasses.replace(PRESETS["a100"], name="a100-4-per-node", devices_per_node=4)


def _plan(**kw):
    # 3 of the 4 blocks on the first stage: the sender is the pipeline's slowest stage
    layout = layouts.megatron(tp=2, pp=2, sequence_parallel=False, recompute="none", blocking_p2p=True,
                              decoder_first_pipeline_num_layers=3, **kw)
    x = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    with torch.device("meta"):
        model = GPT(256, DIM, 4, 8, SEQ, tied=False)
    return autoshard.plan(model, (4, 2), example_inputs=(x,), loss_fn=lm_loss, example_target=x,
                          hardware=FOUR_PER_NODE, layout=layout)


def test_deepspeed_gathers_cost_their_copies_and_the_senders_second_gather():
    plain = _plan()
    deepspeed = _plan(deepspeed_partitioned_tensors=True)
    m, p = plain.microbatches, 2
    assert deepspeed.microbatches == m and plain.pp == deepspeed.pp == p
    # the boundary: one microbatch's hidden states, fp32, whole on tp, per rank of the (dp 2, tp 2) stage
    whole = BATCH / 2 / m * SEQ * DIM * 4
    hw = FOUR_PER_NODE
    copy_rate = hw.memory_bandwidth * hw.memory_efficiency  # the "copy" kernel class runs at the copy rate
    full_copies = whole * (5 + 2 / 2) / copy_rate        # zero fill, piece in, NCCL copy-out, clone
    piece = whole * 2 / 2 / copy_rate                      # the sender's narrow().clone() of its piece
    gather = CostModel(Mesh((2, 2)), hw).collective_time("all_gather", 1, whole)
    sender = piece + full_copies + (gather + full_copies)  # piece out; copies on its receive; its re-gather
    receiver = full_copies + piece                         # copies on its receive; its gradient's piece out
    delta = deepspeed.estimated_step_time - plain.estimated_step_time
    assert full_copies > 1e-6 and gather > 1e-6
    # the slowest stage (the sender) is longer by its extra every microbatch; the warm-up and drain add
    # at most p - 1 more of either stage's
    assert m * sender * (1 - 1e-6) <= delta <= (m + p - 1) * max(sender, receiver) * (1 + 1e-6)


def test_deepspeed_partitioned_tensors_needs_pieces_and_a_pipeline():
    with pytest.raises(LayoutError, match="scatter_gather_tensors_in_pipeline=True"):
        layouts.megatron(tp=8, pp=35, scatter_gather_tensors_in_pipeline=False, deepspeed_partitioned_tensors=True)
    with pytest.raises(LayoutError, match="pp= > 1"):
        layouts.megatron(tp=8, deepspeed_partitioned_tensors=True)
    layout = layouts.megatron(tp=8, pp=35, blocking_p2p=True, deepspeed_partitioned_tensors=True)
    assert layouts.parse(layout.describe()) == layout and layouts.Layout.from_json(layout.to_json()) == layout
    assert "deepspeed_partitioned_tensors" not in layouts.megatron(tp=8, pp=35).describe()
