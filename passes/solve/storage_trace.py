"""The whole-step memory walk's terms for parameters in ZeRO-1/2 and reduce-once storage forms
(``passes.sharding.storage_forms``), kept apart from ``step_trace`` so the plain forms' walk reads as
before. ``StorageTrace`` is fed each such parameter's price (``passes.cost.storage_prices``) and adds to
the ``StepTrace``, as the runtime (``runtime.zero``, ``runtime.param_gather``) allocates:

- the optimizer sees the ZeRO slice: AdamW's temporaries are priced on slices (``optimizer_sizes``);
- a ZeRO parameter's gradient is made whole by its last reader's backward and copied into a
  reduction bucket at once, which frees it (``grad_transient`` there), except that ``zero1`` under
  accumulation keeps adding the microsteps' gradients into it unreduced (``held_unreduced``: alive the
  whole walked microstep, forward and backward, freed before the optimizer step);
- the reduce-scatter buckets: at most two alive (one reducing, the next filling), each a
  ``bucket_bytes`` buffer in the reduce dtype (together at most the ZeRO gradients' bytes), and where
  the backend stages a copy of a reduce-scatter's input (gloo) a copy of the one reducing
  (``reduce_scatter_buckets``). Unlike the plain all-reduce buckets (``comm_buffer``, allocated once
  when the program is built and kept all step), ``runtime.zero`` allocates a bucket's rows when its
  first gradient arrives and frees them once its reduce-scatter has been waited on: they are alive
  only in the backward, from the first ZeRO gradient's arrival (its parameter's last reader,
  ``reduce_scatter_from``) on, and not in the forward, the loss's backward before it, or the optimizer
  step. A bucket is launched once its last gradient has arrived, so with one bucket (every ZeRO
  gradient of one kind within ``bucket_bytes``) nothing reduces during the backward: its staged copy
  is made after it (``ZeroSync.finish``), next to the bucket and every gradient, when the activations
  are freed (``reduce_scatter_end``: the last bucket and its copy);
- a form reducing its sharded axes once per step holds its gathered copies' gradients unreduced over
  the microsteps (``held_unreduced``, with accumulation);
- after the optimizer step the ZeRO parameters are gathered one bucket at a time: the bucket's
  output and this rank's slices concatenated (``after_step_gather``, at the optimizer step's phase).

With one microstep nothing is held: a ``zero1`` parameter then runs exactly as a ``zero2`` one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["StorageTrace"]


@dataclass
class StorageTrace:
    """One assignment's storage-form terms (module docstring). ``bucket_bytes``: the runtime's bucket
    cap; ``staged``: the backend stages a reduce-scatter's input (gloo)."""
    bucket_bytes: float
    staged: bool = False
    slices: dict[str, float] = field(default_factory=dict)  # ZeRO parameter -> optimizer slice bytes
    whole_grads: dict[str, float] = field(default_factory=dict)  # ZeRO parameter -> its local gradient bytes
    held: float = 0.0
    reduced: float = 0.0  # ZeRO gradients in the reduce dtype, summed
    gathered: float = 0.0  # ZeRO parameters' local bytes, summed
    smallest_group: Optional[int] = None
    held_copies: set = field(default_factory=set)  # parameters whose copies' gradients are held (``once``)
    kinds: set = field(default_factory=set)  # bucket kinds of the ZeRO parameters

    def parameter(self, name: str, base, zero_ways: int, reduced_bytes: float, copies: float = 0.0,
                  kind=None) -> None:
        """Parameter ``name``'s ``NodePrice`` ``base`` in a non-plain form; ``zero_ways``: the product of its
        ZeRO axes (1: none); ``reduced_bytes``: its local gradient in the reduce dtype; ``copies``: what
        ``base.held_grads`` counts for its held copies' gradients (an upper bound: ``apply`` takes the
        copies the plan gathers instead); ``kind``: what parameters sharing a bucket share (at least
        ``storage_buckets.BucketKey``'s distinctions; parameters of different kinds never share one)."""
        self.held += base.held_grads - copies
        if copies:
            self.held_copies.add(name)
        if zero_ways == 1:
            return
        self.kinds.add(kind)
        self.slices[name] = base.params / zero_ways
        self.whole_grads[name] = base.params
        self.reduced += reduced_bytes
        self.gathered += base.params
        self.smallest_group = zero_ways if self.smallest_group is None else min(self.smallest_group, zero_ways)

    def optimizer_sizes(self, name: str, params: float) -> float:
        """The bytes the optimizer steps of parameter ``name`` (its slice under ZeRO)."""
        return self.slices.get(name, params)

    def apply(self, trace, last_reader: dict, microsteps: int, copies: dict) -> None:
        """Add the terms to ``trace`` (a ``StepTrace``); ``last_reader``: parameter -> its last reader's
        position; ``copies``: parameter -> the bytes of its gathered copies' gradients in the reduce dtype."""
        for name, nbytes in self.whole_grads.items():
            at = last_reader.get(name, len(trace.names) - 1)
            trace.grad_transient[at] += nbytes
        if microsteps > 1:
            trace.held_unreduced += self.held + sum(copies.get(n, 0.0) for n in self.held_copies)
        if self.reduced:  # one bucket reducing, the next filling, from the first ZeRO gradient's arrival
            one = min(self.bucket_bytes, self.reduced)
            several = self.reduced > self.bucket_bytes or len(self.kinds) > 1  # one may reduce in the backward
            trace.reduce_scatter_buckets += min(2 * self.bucket_bytes, self.reduced) + (one if self.staged and several else 0.0)
            trace.reduce_scatter_end = one * (2.0 if self.staged else 1.0)
            trace.reduce_scatter_from = max(trace.reduce_scatter_from,
                                            max(last_reader.get(n, len(trace.names) - 1) for n in self.whole_grads))
        if self.gathered:
            one = min(self.bucket_bytes, self.gathered)
            trace.after_step_gather = one * (1.0 + 1.0 / (self.smallest_group or 1))
