"""Measured memory next to the plan's estimate, per lever: the whole step's peak, and its parts.

    python benchmarks/memory_estimates.py            # the whole-step peak (issue 21)
    python benchmarks/memory_estimates.py --parts    # saved activations and gathered copies (issue 10)

The test models of ``autoshard.testing.levers`` (GPT with tied embeddings, HF Llama from a config, a
CNN with BatchNorm and dropout) and tiny Hugging Face zoo models (OPT, GPT-NeoX, Gemma) on 4 gloo
ranks under the layouts that gather their block weights (ZeRO-3 on (4,), DP x Megatron TP on (2, 2)).

- peak (default): torch's ``MemTracker`` around a step plus AdamW's step (the least of three) on every rank
  (``autoshard.testing.memory_estimates.peak_against_estimates``) next to ``plan.estimated_memory``
  (``passes.solve.peak_timeline``), the phase where ``MemTracker`` saw the peak and the phase (and
  node) the estimate says sets it; prints rank 0's rows and the range of gaps over every rank;
- ``--parts``: one step measured by ``runtime.memory_probe`` (activation bytes autograd keeps at the
  end of the forward; parameter-copy bytes alive at once) next to ``solution.evaluate``'s figures.

Every rank is checked by ``tests/runtime/test_memory_peak.py`` and ``tests/runtime/test_memory_estimates.py``.
"""
from __future__ import annotations

import sys

from autoshard.testing.memory_estimates import memory_against_estimates, peak_against_estimates
from autoshard.testing.ranks import run_ranks

MODELS = (("gpt", ((4,), (2, 2))), ("hf_llama", ((4,), (2, 2))), ("cnn", ((4,), (2, 2))))
PEAK_MODELS = (("gpt", ((4,), (2, 2))), ("hf_llama", ((4,), (2, 2))), ("cnn", ((4,),)),
               ("hf:opt", ((4,),)), ("hf:gpt_neox", ((4,),)), ("hf:gemma", ((4,),)))


def worker(rank: int, world: int) -> list:
    return memory_against_estimates(rank, MODELS)


def peak_worker(rank: int, world: int) -> list:
    return peak_against_estimates(rank, PEAK_MODELS)


def parts() -> None:
    rows = run_ranks(worker, 4, timeout=1200)[0]
    print("| model | mesh | levers | saved measured | saved estimated | gap | gathered peak measured "
          "| gathered estimated | gap |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, mesh, case, saved, saved_est, gathered, gathered_est in rows:
        print(f"| {model} | {mesh} | {case} | {saved:,} | {saved_est:,.0f} | {(saved - saved_est) / saved_est:+.1%} "
              f"| {gathered:,} | {gathered_est:,.0f} | {(gathered - gathered_est) / gathered_est:+.1%} |")


def peak() -> None:
    results = run_ranks(peak_worker, 4, timeout=1800)
    worst = {}
    for rows in results:
        for model, mesh, case, measured, estimated, *_ in rows:
            gap = (estimated - measured) / measured
            key = (model, mesh, case)
            worst[key] = (min(worst.get(key, (gap, gap))[0], gap), max(worst.get(key, (gap, gap))[1], gap))
    print("| model | mesh | levers | measured peak (rank 0) | estimated peak | estimate vs measured | "
          "range over ranks | measured in | estimated phase (node) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, mesh, case, measured, estimated, phase, measured_phase in results[0]:
        lo, hi = worst[model, mesh, case]
        print(f"| {model} | {mesh} | {case} | {measured:,} | {estimated:,.0f} | {(estimated - measured) / measured:+.1%} "
              f"| {lo:+.1%} .. {hi:+.1%} | {measured_phase} | {phase} |")


if __name__ == "__main__":
    parts() if "--parts" in sys.argv[1:] else peak()
