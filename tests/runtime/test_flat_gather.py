"""All-gathers of one dim over several mesh axes run as ONE all-gather over those axes flattened,
and that is what the plan prices (``passes.layout.gathers.fused_gather``; ``CostModel.moves``).

An MLP on a (2, 2) mesh, 4 gloo ranks, every parameter and the first layer's activations sharded on
dim 0 over both axes (``(S(0), S(0))``) and gathered to ``(R, R)``: the parameters through the
program's parameter gatherer, the ReLU output through an explicit collective call. The program must
call one all-gather over the 4-rank group (not one per axis), and train like one device.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from autoshard.passes.capture.export import capture
from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.cost.model import CostModel
from autoshard.passes.mesh import Mesh
from autoshard.passes.spec import Replicate, Shard, Strategy
from autoshard.runtime.executor import RankProgram
from autoshard.runtime.groups import MeshEnv, setup_distributed
from autoshard.runtime.lower import COLLECTIVE_META, lower
from autoshard.testing.equivalence import Tolerance, adamw, failures_of, train_against_one_device
from autoshard.testing.models import MLP
from autoshard.testing.ranks import run_ranks

MESH = (2, 2)
SS, RR = (Shard(0), Shard(0)), (Replicate(), Replicate())


def _model() -> MLP:
    return MLP(16, 32, 8, activation=F.relu)


def _batch(step: int):
    g = torch.Generator().manual_seed(300 + step)
    return torch.randn(8, 16, generator=g), torch.randint(0, 8, (8,), generator=g)


def _captured_and_plan():
    x, y = _batch(0)
    cg = capture(_model(), (x,), loss_fn=F.cross_entropy, target=y)
    plan = {ph: Strategy((), (SS,)) for ph in cg.params}          # every parameter stored (S(0), S(0))
    plan |= {"x": Strategy((), (SS,)), "target": Strategy((), (RR,)),
             "linear": Strategy((SS, RR, RR), (SS,)),                # batch-sharded over both axes
             "relu": Strategy((SS,), (SS,)),
             "linear_1": Strategy((RR, RR, RR), (RR,)),              # reads the ReLU output gathered
             "cross_entropy_loss": Strategy((RR, RR), (RR,))}
    return cg, plan


def _flat_gathers(program) -> list[str]:
    """The comm names of the program's explicit all-gather calls."""
    return [n.args[-1].target for n in program.graph.nodes if n.meta.get(COLLECTIVE_META) == "all_gather"]


def test_program_calls_one_gather_over_both_axes_and_the_plan_prices_one():
    cg, plan = _captured_and_plan()
    program = lower(cg, plan, MeshEnv.offline(Mesh.of(MESH), rank=0))
    assert _flat_gathers(program) == ["comm_dp_tp"]                 # the ReLU output: one call, both axes
    assert program.comm_dp_tp.size == 4
    fused = [r.fused_gather() for g in program.param_gatherer.groups for r in g.members]
    assert len(fused) == 4 and all(f == ((0, 1), 0) for f in fused), fused   # every parameter too
    cm = CostModel(Mesh.of(MESH), get_hardware("cpu"))
    priced = cm.moves((0, 0), (-1, -1), 8 * 32 * 4, True)[0]        # (S(0), S(0)) -> (R, R) of the ReLU output
    assert [(c.kind, c.axis, c.phase) for c in priced] == [("all_gather", (0, 1), "fwd"),
                                                           ("reduce_scatter", (0, 1), "bwd")]


def _worker(rank: int, world: int) -> list[str]:
    env = setup_distributed(Mesh.of(MESH))
    cg, plan = _captured_and_plan()
    torch.manual_seed(0)
    model = _model()
    ref = copy.deepcopy(model)
    rp = RankProgram.of_strategies(cg, plan, MESH, env=env, model=model, seed=0)
    bad = train_against_one_device("flat gather (2, 2)", rp, ref, _batch, loss_fn=F.cross_entropy, steps=3,
                                   tol=Tolerance(rtol=1e-4, atol=1e-5), optimizer=adamw(lr=1e-2, eps=1e-8))
    if [getattr(rp.program, c).size for c in _flat_gathers(rp.program)] != [4]:
        bad.append(f"rank {rank}: expected one all-gather over 4 ranks, got {_flat_gathers(rp.program)}")
    return bad


def test_flat_gathers_train_like_one_device():
    failures = failures_of(run_ranks(_worker, 4))
    assert not failures, "\n".join(failures)
