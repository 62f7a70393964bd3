"""Known answer: a Llama (HF, bf16, on meta) with one long sequence gets its sequence split over the
mesh, attention run as ring attention; the same model on a short sequence and a large batch splits the
batch instead. And the ring's price: its key/value passes cost time, more for longer sequences."""
import pytest
import torch
import torch.nn.functional as F

import autoshard
from autoshard.passes.capture.export import capture
from autoshard.passes.cost.attention import ring_attention_seconds
from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.cost.hardware import PRESETS
from autoshard.passes.cost.model import CostModel
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import Shard, Strategy
from autoshard.testing.long_context import seq_attention


def _lm_loss(out, target):  # an HF model: the loss gets its output object
    logits = out.logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _plan(batch: int, seq: int, width: int = 256):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(num_hidden_layers=2, hidden_size=width, intermediate_size=2 * width, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=seq, use_cache=False)
    cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    plan = autoshard.plan(model, (4,), example_inputs=(ids,), loss_fn=_lm_loss, example_target=ids,
                          hardware="h100", time_limit_s=30, memory_limit=8 * 2 ** 30)
    return plan.solution.strategies


# the short-sequence case is 4x wider: at width 256 every kernel of 16 x 256 tokens is shorter than an
# H100 kernel launch (``min_kernel_s``), so splitting the batch would save nothing
@pytest.mark.parametrize("batch, seq, width, split", [(1, 32768, 256, "sequence"), (16, 256, 1024, "batch")])
def test_long_sequence_small_batch_splits_the_sequence(batch, seq, width, split):
    strategies = _plan(batch, seq, width)
    attention = [s for n, s in strategies.items() if n.startswith("scaled_dot_product_attention")]
    assert len(attention) == 2
    if split == "sequence":
        assert strategies["embedding"].outputs[0] == (Shard(1),), strategies["embedding"]
        assert all(s.lowerings == ("ring_attention",) for s in attention), [str(s) for s in attention]
    else:  # the attention runs on a quarter of the batch (the embedding's own output is a tie: its
        # kernel is launch-bound, split or not, and the next op's chunk of the batch is free)
        assert not any("ring_attention" in s.lowerings for s in attention), [str(s) for s in attention]
        assert all(s.inputs[0] == (Shard(0),) for s in attention), [str(s) for s in attention]


def test_kv_heads_that_do_not_divide_leave_the_ring():
    """8 query heads over 2 kv heads on 4 devices: head-split attention (Ulysses) cannot split the kv
    heads, so the long sequence goes to ring attention."""
    with torch.device("meta"):
        model, _, _, loss_fn = seq_attention(8, 2, True, seq=8, batch=1, d=256)
    x = torch.empty(1, 16384, 256, device="meta")
    plan = autoshard.plan(model, (4,), example_inputs=(x,), loss_fn=loss_fn, example_target=x, hardware="h100",
                          time_limit_s=30, memory_limit=2 ** 30)
    attention = [s for n, s in plan.solution.strategies.items() if n.startswith("scaled_dot_product_attention")]
    assert [s.lowerings for s in attention] == [("ring_attention",)], [str(s) for s in attention]


def test_ring_passes_are_priced():
    def price(seq):
        model, inputs, target, loss_fn = seq_attention(8, 4, True, seq=seq)
        cg = capture(model, inputs, loss_fn=loss_fn, target=target)
        node = next(n for n in cg.gm.graph.nodes if "scaled_dot_product_attention" in str(n.target))
        facts = GraphFacts(cg, PRESETS["h100"])
        cm = CostModel(Mesh.of((4,)), PRESETS["h100"])
        ring = Strategy(((Shard(2),),) * 3, ((Shard(2),),), ("ring_attention",))
        plain = Strategy(((Shard(1),),) * 3, ((Shard(1),),), (None,))
        fwd, bwd = facts.compute(node.name)
        assert ring_attention_seconds(cm, node, plain, fwd, bwd) == 0.0
        return ring_attention_seconds(cm, node, ring, fwd, bwd)
    short, long = price(16), price(256)
    assert 0 < short < long
