"""What crosses a stage boundary per rank: the producer's piece, where the groups' submeshes match.

``sent_placement`` keeps the producer's placement (partial sums included) when every consumer group
has the producer's submesh shape, and sends the whole value (``R``) otherwise; ``piece_bytes`` is one
rank's share; a stage's whole-step peak counts its p2p buffers at those pieces (``stage_solution``).
One process, meta-device model.
"""
import torch

from autoshard.passes.capture.export import capture
from autoshard.passes.mesh import Mesh
from autoshard.passes.pipeline.stages.boundary_pieces import piece_bytes, sent_placement
from autoshard.passes.pipeline.stages.by_hand import make_pipeline_plan
from autoshard.passes.pipeline.stages.stage_graphs import split_stages, stage_nodes_from_starts
from autoshard.passes.sharding.pins import Pins
from autoshard.passes.solve.planner import plan_sharding
from autoshard.passes.spec import Partial, Replicate, Shard, Strategy, TensorMeta
from autoshard.testing.models import GPT, lm_loss
from autoshard.passes.solve.context import PlanContext

R, P, S0, S1 = Replicate(), Partial(), Shard(0), Shard(1)


def test_sent_placement_keeps_the_producers_piece_only_between_equal_submeshes():
    st = Strategy((), ((S0, S1),))
    assert sent_placement(st, Mesh((2, 2)), [Mesh((2, 2))]) == (S0, S1)
    assert sent_placement(Strategy((), ((R, P),)), Mesh((2, 2)), [Mesh((2, 2))]) == (R, P)
    assert sent_placement(st, Mesh((2, 2)), [Mesh((2, 2)), Mesh((4, 1))]) == (R, R)
    assert sent_placement(st, Mesh((1, 4)), [Mesh((1, 4))]) == (R, S1)  # a size-1 axis splits nothing
    assert sent_placement(None, Mesh((2, 2)), [Mesh((2, 2))]) == (R, R)
    meta = TensorMeta((8, 16, 32), torch.bfloat16)
    assert piece_bytes(meta, (S0, S1), (2, 2)) == 8 * 16 * 32 * 2 / 4
    assert piece_bytes(meta, (R, P), (2, 2)) == piece_bytes(meta, None, (2, 2)) == 8 * 16 * 32 * 2


def test_a_stages_p2p_buffers_are_the_pieces_its_ranks_hold():
    with torch.device("meta"):
        model = GPT(64, 32, 4, 4, 16, False)
    ids = torch.empty(8, 16, dtype=torch.long, device="meta")
    captured = capture(model, (ids,), loss_fn=lm_loss, target=ids.clone())
    nodes = stage_nodes_from_starts(captured, [_first_node_of(captured, "blocks.2")])

    def solve(graph, submesh):  # data parallel over the submesh's first axis: every activation S(0)
        return plan_sharding(graph.captured, submesh, PlanContext.of("h100"),
                             pins=Pins(params={"*": ("R", "R")}, inputs={0: ("S(0)", "R")}))

    plan = make_pipeline_plan(captured, nodes, (2, 2, 2), schedule="1f1b", microbatches=2, solve=solve)
    first, second = split_stages(captured, nodes)
    crossing = [n for n, _ in first.sends]
    whole = sum(captured.node(n).meta["autoshard.meta"].nbytes for n in crossing)
    pieces = sum(piece_bytes(captured.node(n).meta["autoshard.meta"],
                             plan.stages[0].solution.strategies[n].outputs[0], (2, 2)) for n in crossing)
    assert pieces < whole, "premise: the boundary is split over the submesh"
    assert plan.stages[1].solution.estimated["stage_p2p_bytes"] == pieces  # received; it sends nothing
    assert plan.stages[0].solution.estimated["stage_p2p_bytes"] == pieces  # the gradients of what it sends


def _first_node_of(captured, prefix):
    from autoshard.passes.graph import MODULE
    return next(n.name for n in captured.gm.graph.nodes
                if n.op == "call_function" and str(n.meta.get(MODULE, "")).startswith(prefix))
