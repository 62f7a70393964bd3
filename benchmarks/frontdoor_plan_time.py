"""Front-door plan time on a small GPT: ``autoshard.plan`` as users call it, trace included.

    python benchmarks/frontdoor_plan_time.py

Three entry paths of the driver (``autoshard/driver.py``): levers chosen, accumulation pinned, and
``pp="auto"``, each the best of three calls on a (2, 2) H100 mesh, the model on the meta device. It
measures the front door's own overhead next to tracing and solving: compare two trees in the same
minute (the machine is noisy).
"""
from __future__ import annotations

import time
import warnings

import torch

import autoshard
from autoshard.testing.models import gpt, lm_loss


def best_of(model, ids, repeats: int = 3, **keywords) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        autoshard.plan(model, (2, 2), example_inputs=(ids,), loss_fn=lm_loss, example_target=ids, hardware="h100",
                       **keywords)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    warnings.simplefilter("ignore")
    with torch.device("meta"):
        model = gpt(vocab=256, d=128, n_layer=4, n_head=4, seq=64)[0]
    ids = torch.zeros(16, 64, dtype=torch.long, device="meta")
    print(f"plan()                 {best_of(model, ids):.3f} s")
    print(f"plan(accumulation=2)   {best_of(model, ids, accumulation=2):.3f} s")
    print(f"plan(pp='auto')        {best_of(model, ids, pp='auto'):.3f} s")


if __name__ == "__main__":
    main()
