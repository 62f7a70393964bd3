"""Expert parallelism (``runtime/moe_dispatch.py``): HF Mixtral, Qwen2-MoE and DeepSeek-V3 tiny configs,
their MoE layers pinned to expert-parallel strategies (``autoshard.testing.moe_check``), train on 4
gloo ranks equal to one device running the model's own code (loss, first-step gradients, state after
2 SGD steps), on (4,) and on (2, 2) combined with data and tensor parallel, exact and with a
capacity factor large enough that nothing drops, and with every block recomputed; the program has
one pair of all-to-alls (dispatch, combine) per MoE layer, plus one route exchange when exact, and
the plan summary says whether tokens can be dropped. All cases run in one spawn of 4 ranks, each
planned once on one of them (``shared_work.spread_over_ranks``), each model captured once in the process the
ranks fork from (``moe_check.run_moe``).
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from autoshard.testing.moe_check import run_moe  # noqa: E402

CASES = [
    ("mixtral", (4,), ("ep",)),
    ("qwen2_moe", (4,), ("ep",)),
    ("mixtral", (4,), ("ep_local",)),
    ("mixtral", (2, 2), ("ep", "ep")),
    ("qwen2_moe", (2, 2), ("ep", "dp")),
    ("mixtral", (2, 2), ("ep", "ep_local")),
    ("qwen2_moe", (2, 2), ("tp", "ep")),
    ("deepseek_v3", (2, 2), ("dp", "ep")),
    # capacity factor 8 with 4 experts: every expert may take all of a rank's pairs, so nothing drops
    ("mixtral", (4,), ("ep",), 8.0),
    ("qwen2_moe", (2, 2), ("ep", "ep_local"), 8.0),
    # every block recomputed in the backward: the dispatch and combine run again there
    ("mixtral", (4,), ("ep",), None, "full"),
    ("qwen2_moe", (2, 2), ("ep", "dp"), 8.0, "full"),
]


@pytest.fixture(scope="module")
def results():
    return run_moe(CASES, 4, timeout=600)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_expert_parallel_plan_matches_one_device(results, case):
    name, mesh, roles, *options = CASES[case]
    capacity = options[0] if options else None
    for rank, per_rank in enumerate(results):
        failures, counts, summary, layers = per_rank[case]
        assert layers >= 1  # the capture's MoE layers, as the rank's program was lowered from
        assert failures == [], "\n".join(failures)
        dispatching = "ep" in roles
        # exact dispatch: uneven all-to-alls after a route exchange; with a capacity: even ones, static shapes
        uneven, even = (0, 2 * layers) if capacity else (2 * layers, 0)
        assert counts.get("all_to_all_v", 0) == (uneven if dispatching else 0), (rank, counts)
        assert counts.get("exchange_routes", 0) == (layers if dispatching and not capacity else 0), (rank, counts)
        assert counts.get("all_to_all", 0) == (even if dispatching else 0), (rank, counts)
        dropped = [line for line in summary if "tokens dropped" in line]
        assert len(dropped) == 1 and ("YES" in dropped[0]) == bool(capacity)
