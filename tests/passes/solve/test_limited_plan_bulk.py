"""Work a memory-bound plan does in bulk or skips (issue 31, item 10), each checked to give the solvers the
same inputs and the search the same answers: a microstep count its nodes' floor cuts off prices no edge,
the CP-SAT model built from terms laid out once is the one a fresh layout builds after the peak retries
change its bounds and fixings, and GLOP's variables written as wire bytes are the fields set one by one."""
from __future__ import annotations

import random

import pytest
from ortools.linear_solver import linear_solver_pb2

from autoshard.passes.cost.hardware_lookup import get_hardware
from autoshard.passes.mesh import Mesh
from autoshard.passes.solve import lever_search, planner
from autoshard.passes.solve.context import PlanContext
from autoshard.passes.solve.cpsat_model import RowTerms, cpsat_model
from autoshard.passes.solve.ilp import cost_floor
from autoshard.passes.solve.ilp_model import unit_variables
from autoshard.passes.solve.lever_graph import node_cost_floor
from autoshard.passes.solve.lever_pins import LeverPins
from autoshard.passes.solve.lever_search import LeverSearch

H100 = get_hardware("h100")


def _decisions(sol) -> tuple:
    return (sol.levers, sorted((n, str(s)) for n, s in sol.strategies.items()), sol.estimated_memory,
            sol.solver_stats["accumulation_tried"])


def test_a_count_its_nodes_floor_cuts_off_has_no_edge_priced(monkeypatch, tiny_gpt, plan_within):
    """Under a binding limit the count of 2 microsteps is cut off by the floor of its nodes alone (edges
    only add seconds): no lever graph of that count is built, and the plan and the search's record are
    those of the search that builds the fastest policies' graph to read its floor."""
    captured, limit = tiny_gpt
    built: list[int] = []
    build = lever_search.build_lever_graph

    def counted(problem, pricer, policies, memory_limit):
        built.append(getattr(pricer.cm, "microbatches", 1))
        return build(problem, pricer, policies, memory_limit)
    monkeypatch.setattr(lever_search, "build_lever_graph", counted)
    by_nodes = plan_within(captured, limit)
    assert by_nodes.solver_stats["accumulation_tried"]["2"].startswith("CUTOFF")  # the premise
    assert 2 not in built
    monkeypatch.setattr(planner, "node_cost_floor", lambda *a: 0.0)  # the nodes' floor decides nothing
    built.clear()
    by_graph = plan_within(captured, limit)
    assert 2 in built
    assert _decisions(by_nodes) == _decisions(by_graph)


def test_the_nodes_floor_is_at_most_the_lever_graphs_floor(tiny_gpt):
    captured, limit = tiny_gpt
    ctx = PlanContext.of(H100, limit, "adamw", 30.0)
    search = LeverSearch(captured, Mesh.of((2, 2)), ctx, None, LeverPins(), False)
    for k in (1, 2, 4):
        problem, cm = search.problem(k)
        for policies in ({t: [a[0]] for t, a in search.policies.items()}, search.policies):
            nodes = node_cost_floor(problem, search.pricer(problem, cm), policies)
            graph = search.lever_graph(problem, cm, policies, None).graph
            assert 0 < nodes <= cost_floor(graph) * (1 + 1e-12)
            without_edges = type(graph)(graph.nodes, [], None, graph.groups)
            assert nodes == pytest.approx(cost_floor(without_edges), rel=1e-12)


def _rows(rng: random.Random, n: int) -> list:
    rows = []
    for _ in range(30):
        ids = [rng.randrange(n) for _ in range(rng.randrange(1, 9))]  # repeats and any order
        if rng.random() < 0.3:
            rows.append(("exactly_one", ids, [1] * len(ids), 1, 1))
        else:
            rows.append(("linear", ids, [rng.choice([-3, -1, 0, 1, 2, 5]) for _ in ids], rng.choice([0, -float("inf")]),
                         rng.randrange(0, 9)))
    return rows


@pytest.mark.parametrize("seed", range(6))
def test_terms_laid_out_once_build_the_model_a_fresh_layout_builds(seed):
    """One ``RowTerms`` serves every solve of an ILP (``ShardingILP.solve_cpsat``): after a row's bound
    changes and with other variables fixed, the model is the one built from the rows afresh."""
    rng = random.Random(seed)
    n = 40
    rows = _rows(rng, n)
    objective = ([rng.randrange(n) for _ in range(30)], [rng.randrange(0, 50) for _ in range(30)])
    terms = RowTerms(rows, objective)
    for _ in range(3):
        kind, ids, coefs, lo, _ = rows[-1]
        rows[-1] = (kind, ids, coefs, lo, rng.randrange(0, 9))  # as set_memory_limit lowers the memory row
        fixed = frozenset(rng.sample(range(n), rng.randrange(0, n)))  # none up to nearly all
        kept, kept_index = cpsat_model(n, rows, objective, fixed, terms)
        fresh, fresh_index = cpsat_model(n, rows, objective, fixed)
        assert str(kept.proto) == str(fresh.proto) and kept_index == fresh_index


@pytest.mark.parametrize("n", [0, 1, 5, 300])
def test_variables_as_wire_bytes_are_the_fields_set_one_by_one(n):
    rng = random.Random(n)
    costs = [rng.choice([0.0, 1.0, 2.5e-7, 1e9, float(rng.randrange(9))]) for _ in range(n)]
    by_fields = linear_solver_pb2.MPModelProto()
    for c in costs:
        var = by_fields.variable.add()
        var.lower_bound, var.upper_bound = 0.0, 1.0
        var.objective_coefficient = c
    by_bytes = linear_solver_pb2.MPModelProto()
    by_bytes.MergeFromString(unit_variables(costs))
    assert by_bytes == by_fields and by_bytes.SerializeToString() == by_fields.SerializeToString()


def test_each_answer_of_the_search_is_priced_once(monkeypatch, tiny_gpt, plan_within):
    """A policy combination's last answer was priced (its whole-step peak, ``evaluate``) by the peak retry
    that let it stand, and again when the search kept it as its best (a tiny Llama: 2 of 15 pricings, 0.03
    CPU s each); the search reuses the first pricing."""
    captured, limit = tiny_gpt
    seen: list[tuple] = []
    evaluate = planner.evaluate

    def counted(captured_, mesh, strategies, ctx, **kw):
        seen.append((tuple(sorted((n, str(s)) for n, s in strategies.items())), str(kw.get("levers"))))
        return evaluate(captured_, mesh, strategies, ctx, **kw)
    monkeypatch.setattr(planner, "evaluate", counted)
    plan = plan_within(captured, limit)
    assert "OPTIMAL" in str(plan.solver_stats["accumulation_tried"])  # the premise: the search solved under the limit
    assert len(seen) > 2 and len(set(seen)) == len(seen)
