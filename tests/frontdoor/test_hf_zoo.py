"""The Hugging Face zoo: 20 models built from tiny configs (``autoshard.testing.hf_zoo``) trace,
plan with no op lacking a sharding rule, and train equal to one device on 4 gloo ranks, under the
solver's plan on a (2, 2) mesh and random valid plans on (4,) and (2, 2) (``autoshard.testing.zoo_check``:
the loss at both steps, the first step's local gradients, the full state dict after 2 SGD steps).

Every model runs in ONE spawn of 4 ranks (module fixture), captured once in the process the ranks fork
from (``zoo_check.run_zoo``); each architecture is its own test item.
"""
from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from autoshard.testing.hf_zoo import KINDS, ZOO  # noqa: E402
from autoshard.testing.zoo_check import CASES, run_zoo  # noqa: E402


@pytest.fixture(scope="module")
def zoo_results():
    return run_zoo(list(ZOO), 4, timeout=900)


def test_the_zoo_covers_every_kind():
    kinds = " ".join(KINDS.values())
    assert len(ZOO) >= 15 and set(ZOO) == set(KINDS)
    for kind in ("encoder", "decoder", "encoder-decoder", "vision", "MoE"):
        assert kind in kinds


@pytest.mark.slow  # 21 models x 3 plans; HF models stay in the fast tier through test_equivalence
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_model_matches_one_device(zoo_results, name):
    result = zoo_results[name]
    assert result.status == "ok", "\n".join(result.failures)
    assert result.unruled == [], f"{name}: ops without a sharding rule: {result.unruled}"
    assert len(result.plan_s) == len(CASES)  # every case ran
