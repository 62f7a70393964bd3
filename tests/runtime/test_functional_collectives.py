"""The functional collectives (``runtime/functional_collectives.py``) against the eager ones, on 4 gloo ranks.

Every step (all-gather, reduce-scatter, all-reduce, all-to-all, chunk, to-partial), on each axis of a
(2, 2) mesh and on both axes flattened, every dim, must give the eager call's output and, for an
upstream gradient, the eager call's input gradient bit for bit (the same c10d collectives on the same
data), run eagerly, on float64 and on bool and int64 tensors (masks and indices keep their dtype); and all of them at once (their outputs, and the input gradient of their
outputs' weighted sum) inside ``torch.compile(backend="aot_eager", fullgraph=True)``, where dynamo
traces them and AOTAutograd differentiates them with torch's registered formulas, with no graph break;
and a bool mask gathered, scattered and reduced by inductor's code stays bool with the same values.
``functionalize`` rewrites a lowered program's collective calls into them.
"""
from __future__ import annotations

import torch

from autoshard.passes.mesh import Mesh
from autoshard.runtime import collectives as C
from autoshard.runtime import functional_collectives as FC
from autoshard.runtime.groups import setup_distributed
from autoshard.testing.ranks import run_ranks


def _pairs(comm):
    """(name, eager call, functional call) for every step on ``comm`` (dims of a (4, 8, 4) tensor)."""
    g, n, r = comm.group.group_name, comm.size, comm.rank
    out = [("all_reduce", lambda x: C.all_reduce(x, comm), lambda x: FC.all_reduce(x, g)),
           ("to_partial", lambda x: C.to_partial(x, comm), lambda x: FC.to_partial(x, r))]
    for d in range(3):
        out += [(f"all_gather {d}", lambda x, d=d: C.all_gather(x, d, comm), lambda x, d=d: FC.all_gather(x, d, g, n)),
                (f"reduce_scatter {d}", lambda x, d=d: C.reduce_scatter(x, d, comm),
                 lambda x, d=d: FC.reduce_scatter(x, d, g, n)),
                (f"chunk {d}", lambda x, d=d: C.chunk(x, d, comm), lambda x, d=d: FC.chunk(x, d, n, r))]
        out += [(f"all_to_all {d}->{s}", lambda x, d=d, s=s: C.all_to_all(x, d, s, comm),
                 lambda x, d=d, s=s: FC.all_to_all(x, d, s, g, n)) for s in range(3) if s != d]
    return out


def _run(fn, x: torch.Tensor, seed: int) -> tuple:
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed), dtype=y.dtype)
    (y * grad).sum().backward()
    return y.detach(), x.grad


def _all(calls):
    """One function running every call on its input: the concatenation of their flattened outputs."""
    return lambda x: torch.cat([fn(x).reshape(-1) for fn in calls])


def _compare(bad: list, what: str, got: tuple, want: tuple) -> None:
    for kind, a, b in zip(("output", "input gradient"), got, want):
        if a.shape != b.shape or not torch.equal(a, b):
            bad.append(f"{what}: {kind} differs from the eager collective's")


def _worker(rank: int, world: int) -> list:
    env = setup_distributed(Mesh((2, 2)))
    bad = []
    x = torch.randn(4, 8, 4, generator=torch.Generator().manual_seed(10 + rank), dtype=torch.float64)
    for comm in (env.comm(0), env.comm(1), env.comm_for((0, 1))):
        pairs = _pairs(comm)
        for name, eager, functional in pairs:
            _compare(bad, f"{comm.name} {name}", _run(functional, x, 7), _run(eager, x, 7))
        compiled = torch.compile(_all([f for _, _, f in pairs]), backend="aot_eager", fullgraph=True)
        _compare(bad, f"{comm.name} every step compiled", _run(compiled, x, 8), _run(_all([e for _, e, _ in pairs]), x, 8))
        for mask in ((x > 0), (x * 10).long()):  # masks and indices move too, in their own dtype
            for name, eager, functional in pairs:
                want, got = eager(mask), functional(mask)
                if got.dtype != want.dtype or not torch.equal(got, want):
                    bad.append(f"{comm.name} {name} on {mask.dtype}: differs from the eager collective's")
    # inductor: a bool mask must come back bool (torch 2.13's inductor returns bool all-gathers and
    # reduce-scatters as int64 unless they travel as uint8)
    comm = env.comm_for((0, 1))
    g, n = comm.group.group_name, comm.size
    steps = lambda m: (FC.all_gather(m, 2, g, n), FC.reduce_scatter(m, 1, g, n), FC.all_reduce(m, g))
    mask = x > 0
    for got, want, name in zip(torch.compile(steps)(mask), (C.all_gather(mask, 2, comm), C.reduce_scatter(mask, 1, comm),
                                                            C.all_reduce(mask, comm)), ("gather", "scatter", "reduce")):
        if got.dtype != torch.bool or not torch.equal(got, want):
            bad.append(f"inductor: bool {name} comes back as {got.dtype} or other values")
    return bad


def test_functional_collectives_equal_the_eager_ones_on_4_ranks():
    bad = sorted({b for per_rank in run_ranks(_worker, 4, init="env") for b in per_rank})
    assert not bad, "\n".join(bad)
