"""Overlap: one training step as a compute stream plus a communication stream.

The additive estimate (compute + communication + gradient sync) is what the ILP minimises; a GPU
runtime runs collectives on their own stream, so part of them hides behind compute. This module
re-scores a priced step with a stream-level model of ``L`` identical blocks (the repeated layers):

- **forward**: the weight all-gathers of block ``i+1`` (FSDP prefetch) run while block ``i``
  computes; the first block's gathers have nothing to hide behind:
  ``T_f = g_f + (L-1) * overlap(c_f, g_f) + c_f``;
- **backward**: block ``i``'s weight re-gathers, the reduce-scatters of block ``i+1``'s weight
  gradients and the bucketed data-parallel all-reduces of its gradients run while block ``i``
  computes; the first re-gather and the last reduction are exposed:
  ``T_b = a_b + (L-1) * overlap(c_b, a_b + r_b) + c_b + r_b``;
- ``overlap(c, g) = max(c + s * min(c, g), g)``: both streams run; while a collective runs, compute
  slows by ``s`` (its kernels give up the SMs NCCL's channels occupy: ``s = channels / SMs``);
- everything else (tensor-parallel all-reduces and all-gathers, resharding of activations, MoE
  all-to-alls) sits on the critical path: exposed, as Megatron / torchtitan run them without async TP.

``per-block`` figures are the step's totals divided by ``L``: compute and communication spread evenly
over the blocks (the embedding, head and loss included), an approximation that holds for stacks of
identical layers. With ``L <= 1`` (no repeated blocks) or a hardware without a communication stream
(``Hardware.comm_streams == 0``: gloo on a CPU runs a collective on the calling thread), nothing hides
and the result equals the additive step.

>>> r = overlap_step(fwd_compute=3.0, bwd_compute=6.0, exposed=1.0, fwd_prefetch=2.0, bwd_prefetch=2.0,
...                  bwd_reduce=2.0, blocks=4, slowdown=0.0)
>>> round(r.step_time, 6), round(r.exposed, 6), round(r.hidden, 6)   # additive: 15 s
(11.5, 2.5, 4.5)

Exposed there: the 1 s that cannot overlap, the first block's forward gathers (0.5 s) and backward
re-gathers (0.5 s), the last block's reductions (0.5 s); the other 4.5 s of communication hide.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Overlap", "overlap_step", "NCCL_CHANNELS", "compute_slowdown"]

#: Channels NCCL runs a large collective on inside an 8-GPU NVSwitch node: one CTA (one SM) per
#: channel (NCCL docs, environment variables NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS: "each channel
#: uses one CUDA block"); 16 is the usual ring count NCCL builds on DGX A100 / H100 (estimate).
NCCL_CHANNELS = 16


def compute_slowdown(hw) -> float:
    """Fraction by which compute slows while a collective shares the GPU: NCCL's channels over the SMs
    (0 on hardware without an SM count)."""
    sms = getattr(hw, "sm_count", 0)
    return NCCL_CHANNELS / sms if sms else 0.0


@dataclass(frozen=True)
class Overlap:
    """A step re-scored with overlap. ``step_time``: seconds; ``exposed``: communication seconds on the
    critical path; ``hidden``: communication seconds run under compute; ``slowdown``: compute seconds
    lost to collectives sharing the SMs."""
    step_time: float
    exposed: float
    hidden: float
    slowdown: float

    def to_json(self) -> dict:
        return {"overlapped_step_s": self.step_time, "exposed_communication_s": self.exposed,
                "hidden_communication_s": self.hidden, "overlap_slowdown_s": self.slowdown}


def _phase(compute: float, head: float, body: float, tail: float, blocks: int, slowdown: float) -> tuple[float, float]:
    """(time, slowdown seconds) of one phase: ``head`` exposed before the first block, ``body`` per
    block overlapped with the compute of the block before, ``tail`` exposed after the last."""
    c = compute / blocks
    lost = slowdown * min(c, body)
    return head + (blocks - 1) * max(c + lost, body) + c + tail, (blocks - 1) * lost


def overlap_step(*, fwd_compute: float, bwd_compute: float, exposed: float, fwd_prefetch: float = 0.0,
                 bwd_prefetch: float = 0.0, bwd_reduce: float = 0.0, blocks: int = 1,
                 slowdown: float = 0.0) -> Overlap:
    """Re-score a step. ``fwd_compute`` / ``bwd_compute`` (recomputation included in the backward):
    compute-stream seconds; ``exposed``: communication that cannot overlap; ``fwd_prefetch``: weight
    all-gathers of the forward; ``bwd_prefetch``: weight re-gathers of the backward; ``bwd_reduce``:
    gradient reduce-scatters and bucketed all-reduces; ``blocks``: identical blocks ``L``."""
    overlappable = fwd_prefetch + bwd_prefetch + bwd_reduce
    additive = fwd_compute + bwd_compute + exposed + overlappable
    if blocks <= 1 or overlappable <= 0.0:
        return Overlap(additive, exposed + overlappable, 0.0, 0.0)
    L = int(blocks)
    t_f, lost_f = _phase(fwd_compute, fwd_prefetch / L, fwd_prefetch / L, 0.0, L, slowdown)
    t_b, lost_b = _phase(bwd_compute, bwd_prefetch / L, (bwd_prefetch + bwd_reduce) / L, bwd_reduce / L, L, slowdown)
    step = t_f + t_b + exposed
    lost = lost_f + lost_b
    hidden_exposed = step - (fwd_compute + bwd_compute + lost) - exposed  # overlappable comm left exposed
    return Overlap(step, exposed + hidden_exposed, overlappable - hidden_exposed, lost)
