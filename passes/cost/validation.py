"""How far the calibrated GPU cost model is from published measurements: the residuals of
``benchmarks/literature.py`` (Megatron-LM 2021 Table 1, 10 rows on A100; torchtitan's 3 Llama
recipes on A100 / H100), each run's layout priced through ``autoshard.plan(layout=...)``, predicted
throughput / measured - 1, per row.

These figures are copied from that script's output (its last run is in benchmarks/RESULTS.md) and
must be updated with it; ``tests/passes/cost/test_validation.py`` reprices one row (slow) and fails
when it drifts. The plan summary prints the band so that an estimate is read with its known error.
"""
from __future__ import annotations

__all__ = ["LITERATURE_RESIDUALS", "error_band_line"]

#: run -> predicted / measured - 1 (positive: the cost model is optimistic), as printed by
#: ``python benchmarks/literature.py``
LITERATURE_RESIDUALS = {
    "Megatron 1.7B": 0.125, "Megatron 3.6B": 0.116, "Megatron 7.5B": 0.098, "Megatron 18.4B": 0.097,
    "Megatron 39.1B": 0.037, "Megatron 76.1B": 0.102, "Megatron 145.6B": 0.066, "Megatron 310.1B": 0.003,
    "Megatron 529.6B": -0.045, "Megatron 1T": -0.035,
    "torchtitan Llama-3.1 8B": 0.12, "torchtitan Llama-3 70B": 0.094, "torchtitan Llama-3.1 405B": 0.087,
}


def error_band_line() -> str:
    """One summary line: the band of the residuals and their median."""
    errs = sorted(LITERATURE_RESIDUALS.values())
    median = errs[len(errs) // 2]
    return (f"  expected error (calibrated GPU model vs {len(errs)} published runs, benchmarks/literature.py): "
            f"throughput {100 * errs[0]:+.0f}% to {100 * errs[-1]:+.0f}% of measured, median {100 * median:+.0f}% "
            f"(optimistic: the real step is likely longer)")
