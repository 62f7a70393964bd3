"""Measured memory next to the plan's estimate, per lever: saved activations and gathered copies.

    python benchmarks/memory_estimates.py

The test models of ``autoshard.testing.levers`` (GPT with tied embeddings, HF Llama from a config, a
CNN with BatchNorm and dropout) on 4 gloo ranks under the layouts that gather their block weights
(ZeRO-3 on (4,), DP x Megatron TP on (2, 2)); for each lever case one step is measured by
``runtime.memory_probe`` (``autoshard.testing.memory_estimates``; activation bytes autograd keeps at the end of the forward; parameter-copy
bytes alive at once, prefetches in flight included) and the same strategies and levers are priced
by ``solution.evaluate``. Prints a markdown table of rank 0's figures (every rank is checked by
``tests/runtime/test_memory_estimates.py``).
"""
from __future__ import annotations

from autoshard.testing.memory_estimates import memory_against_estimates
from autoshard.testing.ranks import run_ranks

MODELS = (("gpt", ((4,), (2, 2))), ("hf_llama", ((4,), (2, 2))), ("cnn", ((4,), (2, 2))))


def worker(rank: int, world: int) -> list:
    return memory_against_estimates(rank, MODELS)


def main() -> None:
    rows = run_ranks(worker, 4, timeout=1200)[0]
    print("| model | mesh | levers | saved measured | saved estimated | gap | gathered peak measured "
          "| gathered estimated | gap |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model, mesh, case, saved, saved_est, gathered, gathered_est in rows:
        print(f"| {model} | {mesh} | {case} | {saved:,} | {saved_est:,.0f} | {(saved - saved_est) / saved_est:+.1%} "
              f"| {gathered:,} | {gathered_est:,.0f} | {(gathered - gathered_est) / gathered_est:+.1%} |")


if __name__ == "__main__":
    main()
