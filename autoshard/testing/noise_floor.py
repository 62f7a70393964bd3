"""Tolerances measured, not chosen: how far a float32 program may be from the exact result.

A distributed program computes the same sums as one device in another order (partial sums per rank,
matmuls split along the contraction, collectives that add in ring order), so in float32 it cannot
match the one-device run bit for bit; it can only be as close to the exact answer as that run is.
``NoiseFloor`` measures that closeness instead of guessing it: the harness trains a float64 twin of
the one-device reference next to the float32 one, and for every compared quantity (the loss at each
step, each first-step gradient, each tensor of the final state) the float32 reference's distance from
the float64 one is the noise floor. The program passes where its own distance from the float64 twin
is at most ``factor`` times that floor::

    |program - ref64| <= factor * max(|ref32 - ref64|, UNIT_ROUNDOFF * |ref64|)     (max over elements)

The second term keeps the floor above zero where float32 happens to be exact (a tensor the first
steps leave unchanged). A wrong program (a missing all-reduce, a gradient off by a factor of the mesh
size) is off by the size of the quantity itself, orders of magnitude above either term.

Why ``factor`` is 16: the program's rounding is another draw of the same error, not a smaller one. On
the Hugging Face zoo's float32 runs (``benchmarks/noise_floor.py`` prints the distribution: 16,872
comparisons over 17 models and 3 plans each) the program's distance was a median 0.96 and at most
3.11 times the reference's, so 16 leaves a factor of five over everything seen while staying orders of
magnitude below a real error.

Where float64 gives the verdict on its own, run the program in float64 too (``zoo_check``'s
``dtype=torch.float64``): a correct plan agrees there to ~1e-12.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import torch

__all__ = ["NoiseFloor", "UNIT_ROUNDOFF", "measured_distance", "allowed_distance", "allowed_distances"]

#: float32's unit roundoff, 2**-24 (IEEE 754 binary32: 24 significand bits).
UNIT_ROUNDOFF = 2.0 ** -24


@dataclasses.dataclass(frozen=True)
class NoiseFloor:
    """Pass where the program is within ``factor`` times the float32 reference's own distance from a
    float64 twin (see the module docstring). A ``ratios`` list, if given, receives ``(quantity,
    distance / floor)`` for every comparison, to see how close to the bound real programs come."""
    factor: float = 16.0
    ratios: Optional[list] = dataclasses.field(default=None, compare=False, hash=False)
    #: used, with a warning, when the float64 twin cannot run (an op with no float64 kernel, such as
    #: ``torch._grouped_mm``): a fixed ``Tolerance`` (None: the harness's default ``Tolerance()``)
    fallback: Any = None


def measured_distance(got: torch.Tensor, exact: torch.Tensor) -> float:
    """max |got - exact| over the elements, computed in float64 (inf for a shape mismatch)."""
    if got.shape != exact.shape:
        return float("inf")
    if got.numel() == 0:
        return 0.0
    return (got.detach().double() - exact.detach().double()).abs().max().item()


def allowed_distance(reference32: torch.Tensor, reference64: torch.Tensor, factor: float) -> float:
    """``factor * max(|ref32 - ref64|, UNIT_ROUNDOFF * |ref64|)`` (max over elements)."""
    scale = reference64.detach().double().abs().max().item() if reference64.numel() else 0.0
    return factor * max(measured_distance(reference32, reference64), UNIT_ROUNDOFF * scale)


def allowed_distances(reference32: Mapping[str, torch.Tensor], reference64: Mapping[str, torch.Tensor],
                      factor: float) -> dict[str, float]:
    """``allowed_distance`` for every name the two mappings share."""
    return {k: allowed_distance(reference32[k], reference64[k], factor) for k in reference64 if k in reference32}
