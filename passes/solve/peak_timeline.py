"""The whole-step memory peak per device, as a timeline of live bytes.

The model: one training step runs the forward in program order, the backward in reverse program
order, then the optimizer step. Positions ``0 .. n-1`` are the program's nodes in order; each
quantity below is local bytes on one device (``StepTrace``, built by ``passes.solve.step_trace``):

- ``resident``: parameters (local shards), buffers, optimizer state (AdamW's ``step`` counters
  included), the step's input batch, alive the whole step;
- ``kept[i]``: what node ``i`` (and the redistributed copies it reads) leaves for the backward:
  saved activations and gathered parameter copies kept to the backward. Alive from ``i``'s forward
  to ``i``'s backward (autograd frees a node's saved tensors when its backward has run; freeing at
  the producer's backward, never earlier, is the conservative side);
- ``outputs[i]``: node ``i``'s own outputs, alive at its forward even when nothing keeps them;
- ``value_grads``: (producer position, last reader position, bytes): the gradient of a value is
  created by the backward of its last reader and released after its producer's backward, so it is
  alive at backward positions ``producer .. last reader`` inclusive (the logits' gradient, the loss's fp32
  upcast's gradient and every activation gradient in flight);
- ``param_grads[i]``: local gradient bytes of the parameters whose last reader is ``i``: created
  at ``i``'s backward, alive to the end of the step (gradient accumulation ``k > 1``: the earlier
  microsteps' gradients are alive the whole last microstep, ``grads_held``);
- ``grad_transient[i]``: any other gradient bytes alive only at ``i``'s backward (the gradient of
  a gathered parameter copy is a ``value_grads`` interval, its readers' span);
- ``reduce_after[i]``: buffers a gradient reduction allocates right after ``i``'s backward (a
  gathered group's flat reduce-scatter input, and the backend's staging copy of it), when ``i``'s
  own saved and recomputed tensors are freed. ``i`` is the group's first reader, early in its
  block, and autograd runs the group's reduction before the previous block's backward (a later
  forward sequence number runs first): no recompute region is alive then, and the group's own
  gathered copies, which only its block's saved tensors held, are freed (``reduce_frees[i]``: their
  bytes, out of ``gathered_in_flight``); the backward prefetch of an earlier group is in flight
  then (``reduce_prefetch[i]``: its flat gather's output and input; the copies alive at the
  reduction are the larger of the two figures);
- ``recompute[i]``: what a recomputing block instance re-creates before its backward (the live set
  of the recompute region), alive during the backward of that instance's nodes;
- ``gathered_in_flight``: gathered parameter copies that are not kept (resharded or recomputing
  blocks' copies, the next block's prefetch), alive while blocks run, forward and backward;
  ``gathered_backward[i]``: the same at backward position ``i`` from the groups (copies gathered
  again, alive down to each copy's first reader, and the earlier group's prefetched flat gather,
  output and input); the backward takes the larger of the two;
- ``reduce_output[i]``: the shard gradients the reduction after ``i`` makes; with held gradients
  (accumulation) they are alive next to them before they are added in;
- ``accumulate_after[i]``: bytes autograd makes right after ``i``'s backward to add ``i``'s gradient
  contribution to a value that a later op also read (the contribution and the out-of-place sum;
  ``step_trace``'s ``_accumulations``): the gradients ``i``'s backward consumed (those whose span
  starts at ``i``) and its saved tensors are freed by then;
- ``comm_buffer``: the gradient all-reduce's flat buckets (room for a copy of every synced
  gradient). ``runtime.gradsync`` allocates them once, when the program is built, and keeps them, as
  DDP's reducer does: alive the whole step, forward and loss included. Measured (issue 27): a 7.3 M
  Llama on (4,) peaks in the loss's backward (the log-softmax's gradient next to every saved
  activation), before any parameter gradient exists, with its 21 MB of buckets alive; the walk had
  counted them only once a gradient was made, and was 6% under the process's heap there;
- ``grads_in_buckets``: the synced gradients that are views into those buckets after the step
  (``GradSync.finish`` points each ``.grad`` at its reduced slice when the bucket holds the
  parameter's dtype): at the optimizer step they are not bytes of their own;
- ``held_unreduced``, ``after_step_gather``: the storage forms' terms (``storage_trace``): gradients
  held unreduced over the microsteps, and the buffers of the ZeRO parameters' gather after the step;
- ``reduce_scatter_buckets``: the ZeRO parameters' reduce-scatter buckets (``storage_trace``), which
  ``runtime.zero`` allocates when the first ZeRO gradient arrives (at backward position
  ``reduce_scatter_from``) and frees once reduced: alive at backward positions ``<=
  reduce_scatter_from`` only, not in the forward, the backward before it, or the optimizer step;
  ``reduce_scatter_end``: the last bucket and its staged copy, reduced after the backward, next to
  every gradient.
  Measured (HF Llama, ``small:llama`` on (4,), its replicated weights ZeRO-2): counting them all
  step like ``comm_buffer`` put the loss's backward 26% above the measured peak;
- ``optimizer_temporaries``: what the optimizer allocates inside its step. torch's AdamW with
  ``foreach`` (its default for CUDA tensors, ``torch/optim/optimizer.py
  _default_to_fused_or_foreach``) runs ``_multi_tensor_adam`` (``torch/optim/adam.py``), whose
  ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)`` is one new tensor per parameter
  (the other updates are in place: ``_foreach_lerp_``, ``_foreach_mul_``, ``_foreach_addcmul_``,
  ``_foreach_addcdiv_``): one copy of the parameters. The for-loop path (``_single_tensor_adam``,
  the default for CPU tensors) makes ``exp_avg_sq.sqrt()`` and its quotient for one parameter at a
  time: twice the largest parameter.

Phases: ``forward`` (live at each forward position: resident + the buckets + held gradients +
gathered in flight + kept so far + the node's outputs), ``backward`` (at each backward position:
resident + gathered in flight + kept by nodes not yet back-propagated + value gradients alive +
parameter gradients so far + the node's transients + the buckets), ``optimizer step`` (resident +
the buckets + the gradients that are not views into them + temporaries).
``peak`` is the largest, ``phase`` where it is (with the node, for forward and backward).
"""
from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StepTrace", "Peak", "peak_of", "optimizer_temporaries"]


@dataclass
class StepTrace:
    """Per-position live-byte quantities of one step on one device (module docstring)."""
    names: list[str]
    resident: float = 0.0
    grads: float = 0.0
    grads_held: bool = False
    kept: list[float] = field(default_factory=list)
    outputs: list[float] = field(default_factory=list)
    value_grads: list[tuple[int, int, float]] = field(default_factory=list)
    param_grads: list[float] = field(default_factory=list)
    grad_transient: list[float] = field(default_factory=list)
    recompute: list[float] = field(default_factory=list)
    reduce_after: list[float] = field(default_factory=list)
    reduce_frees: list[float] = field(default_factory=list)
    reduce_prefetch: list[float] = field(default_factory=list)
    gathered_backward: list[float] = field(default_factory=list)
    reduce_output: list[float] = field(default_factory=list)
    gathered_in_flight: float = 0.0
    comm_buffer: float = 0.0
    grads_in_buckets: float = 0.0
    accumulate_after: list[float] = field(default_factory=list)
    optimizer_temporaries: float = 0.0
    # storage forms (``storage_trace``): unreduced gradients held over the microsteps (alive in the
    # forward and backward, reduced before the optimizer step), and the after-step gather's buffers
    held_unreduced: float = 0.0
    after_step_gather: float = 0.0
    # the ZeRO reduce-scatter buckets, alive at backward positions <= reduce_scatter_from (-1: none)
    reduce_scatter_buckets: float = 0.0
    reduce_scatter_from: int = -1
    reduce_scatter_end: float = 0.0


@dataclass(frozen=True)
class Peak:
    """The step's peak live bytes and the phase (and node) that sets it; ``phases``: each phase's peak;
    ``resident``: the bytes alive through the whole forward and backward (``resident``, the gradient
    buckets, gradients held unreduced), which a pipeline stage keeps while another stage of its rank runs."""
    bytes: float
    phase: str
    phases: dict
    resident: float = 0.0


def optimizer_temporaries(param_bytes: list[float], optimizer, foreach: bool) -> float:
    """Bytes AdamW / Adam allocate inside ``step`` (module docstring); 0 for other optimizers
    (SGD without momentum updates in place)."""
    if str(optimizer).lower() not in ("adam", "adamw") or not param_bytes:
        return 0.0
    return float(sum(param_bytes)) if foreach else 2.0 * max(param_bytes)


def peak_of(trace: StepTrace) -> Peak:
    """Walk the step (module docstring) and return its peak."""
    n = len(trace.names)
    held = (trace.grads if trace.grads_held else 0.0) + trace.held_unreduced
    best = {"forward": (0.0, ""), "backward": (0.0, ""), "optimizer step": (0.0, "")}

    def note(phase: str, live: float, where: str) -> None:
        if live > best[phase][0]:
            best[phase] = (live, where)

    kept_so_far = 0.0
    for i in range(n):
        kept_so_far += trace.kept[i]
        note("forward", trace.resident + trace.comm_buffer + held + trace.gathered_in_flight + kept_so_far
             + trace.outputs[i], trace.names[i])
    grads_alive = [0.0] * (n + 1)  # difference array over backward positions
    own_grads = [0.0] * n  # gradients freed once their producer's backward has run
    for producer, last, nbytes in trace.value_grads:
        if last >= producer:
            grads_alive[producer] += nbytes
            grads_alive[last + 1] -= nbytes
            own_grads[producer] += nbytes
    in_flight = [0.0] * n
    running = 0.0
    for i in range(n):
        running += grads_alive[i]
        in_flight[i] = running
    made = held
    for j in range(n - 1, -1, -1):
        made_here = trace.param_grads[j]  # with held gradients: the incoming summand, added in place
        bucket = trace.comm_buffer + (trace.reduce_scatter_buckets if j <= trace.reduce_scatter_from else 0.0)
        gathered = max(trace.gathered_in_flight, trace.gathered_backward[j] if trace.gathered_backward else 0.0)
        live = (trace.resident + gathered + kept_so_far + in_flight[j] + made + made_here
                + trace.grad_transient[j] + trace.recompute[j] + bucket)
        note("backward", live, trace.names[j])
        kept_so_far -= trace.kept[j]
        if not trace.grads_held:
            made += made_here
        if trace.accumulate_after and trace.accumulate_after[j]:  # after j's backward: its own inputs freed
            note("backward", trace.resident + gathered + kept_so_far + in_flight[j] - own_grads[j] + made
                 + (made_here if trace.grads_held else 0.0) + trace.recompute[j] + bucket
                 + trace.accumulate_after[j], trace.names[j])
        if trace.reduce_after and trace.reduce_after[j]:
            held_summand = made_here if trace.grads_held else 0.0
            if trace.grads_held and trace.reduce_output:  # the reduced shards, before they are added in
                held_summand += trace.reduce_output[j]
            copies = max(trace.gathered_in_flight - trace.reduce_frees[j],
                         trace.reduce_prefetch[j] if trace.reduce_prefetch else 0.0, 0.0)
            note("backward", trace.resident + copies + kept_so_far + in_flight[j] + made
                 + held_summand + trace.reduce_after[j] + bucket, trace.names[j])
    if trace.reduce_scatter_end:  # the last ZeRO bucket reduced after the backward
        note("backward", trace.resident + trace.comm_buffer + made + trace.reduce_scatter_end, "reduce-scatter")
    note("optimizer step", trace.resident + trace.comm_buffer + trace.grads - trace.grads_in_buckets
         + max(trace.optimizer_temporaries, trace.after_step_gather), "")
    phase, (peak, where) = max(best.items(), key=lambda kv: kv[1][0])
    label = f"{phase} ({where})" if where else phase
    return Peak(peak, label, {p: v for p, (v, _) in best.items()},
                trace.resident + trace.comm_buffer + trace.held_unreduced)
