"""What DeepSpeed's pipeline engine spends around a stage boundary sent as 1/tp pieces, beyond the
network transfer and the receiver's all-gather (``scoring.cut_seconds``).

DeepSpeed's ``PipelineEngine`` (deepspeed/runtime/pipe/engine.py, 2021: ``is_pipe_partitioned`` and,
since #1407 of 2021-09-29, ``is_grad_partitioned``, both on under tensor parallelism) sends a stage's
output and its input's gradient as ``PartitionedTensor`` pieces (deepspeed/runtime/utils.py):

- the sender cuts its piece out first: ``_partition_tensor`` = ``contiguous().view(-1).narrow(...)
  .clone()``: its 1/tp of the tensor read and written (``piece_copy_bytes``);
- every gather is ``PartitionedTensor.full()``: a zero-filled whole buffer (``torch.zeros``, the whole
  tensor written), the local piece copied into it (1/tp read and written), ``dist.all_gather`` into a
  list of views, which torch's NCCL backend runs into a flat buffer of its own and then copies out to
  the list (``ProcessGroupNCCL::allgather``: the whole tensor read and written), then ``.clone()`` of
  the result (read and written again) (``gather_copy_bytes``: 5 + 2 / tp wholes);
- the sending stage gathers its own output again before its backward (``_exec_backward_pass``:
  ``part_output.full()``, its output having been replaced by a 1-element placeholder after the send to
  free memory): one more tp all-gather and its copies per microbatch, on the sender (``regather``).

Left out (each under 0.03 ms at MT-NLG's 84 MB boundary): the receiver's two ``clone()`` of the
received piece (``_exec_recv_activations``, ``_exec_forward_pass``), the metadata tensor sent with
each piece and the host sync of its ``meta.tolist()``.

>>> gather_copy_bytes(8e6, 8), piece_copy_bytes(8e6, 8)
(42000000.0, 2000000.0)
"""
from __future__ import annotations

from autoshard.passes.cost.hardware import Hardware
from autoshard.passes.cost.kernel_classes import class_seconds
from autoshard.passes.cost.kernels import achievable

__all__ = ["gather_copy_bytes", "piece_copy_bytes", "copy_seconds"]


def gather_copy_bytes(whole: float, tp: int) -> float:
    """Bytes ``PartitionedTensor.full()`` moves on one rank besides its all-gather, for a tensor of
    ``whole`` bytes split ``tp`` ways: zero fill (1), the local piece in (2 / tp), the NCCL list
    all-gather's copy out (2), the clone (2)."""
    return whole * (5.0 + 2.0 / tp)


def piece_copy_bytes(whole: float, tp: int) -> float:
    """Bytes one rank moves cutting its piece out before a send (``_partition_tensor``'s clone)."""
    return whole * 2.0 / tp


def copy_seconds(hw: Hardware, nbytes: float) -> float:
    """Seconds of copy kernels moving ``nbytes`` (``kernel_classes``' "copy" class; plain bandwidth on a
    device without the achievable model)."""
    if nbytes <= 0:
        return 0.0
    if achievable(hw):
        return class_seconds(hw, "copy", nbytes)
    return nbytes / hw.memory_bandwidth
