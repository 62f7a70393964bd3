"""What autograd keeps for the backward: the saved-tensor analysis of a captured program.

``saved_info(captured)`` runs the program once on the meta device (nothing is allocated), node by
node, with autograd on (parameters require grad, inputs and buffers do not) under
``torch.autograd.graph.saved_tensors_hooks``, and records for every node what the ops it runs
pack for backward. A packed tensor is attributed by its storage (views share their base's
storage) to the node that created that storage: its *owner*. The answer per node is a
``SavedInfo``, also written to ``node.meta[SAVED]``:

- ``saved_outputs``: the node's own tensor outputs (slots among its tensor outputs) whose storage
  some op saves (a view's storage belongs to its base, so a view node owns nothing);
- ``saved_operands``: the operand indices (``passes.graph.operands`` order) whose storage this node
  saves; a node whose output aliases an operand (a view, an in-place op) saves that operand
  *through* its users: when a user saves the alias, the aliasing node saves the operand too, so a
  redistributed copy feeding a view is kept exactly when what reads the view keeps it;
- ``internal_bytes``: bytes of tensors the node creates inside itself and saves that are not its
  outputs (``cross_entropy``'s log-softmax, ``layer_norm``'s statistics, attention's log-sum-exp
  and float mask);
- ``selective_bytes``: bytes of the outputs of the matmul and attention kernels the node runs (the
  kernels whose ``OpFacts.selective_save`` is set): what selective checkpointing keeps of it;
- ``kernel_outputs``: ``(op name, bytes)`` of every matmul / attention kernel the node runs
  (the selective-save kernels), in dispatch order, with bytes 0 where the node does not own the
  output's storage: what torchtitan's op-level policy (``op_policy_saves``) decides on, kernel by kernel;
- ``alias_of``: ``(owner, slot)`` when the node's output shares another node's storage;
- ``self_saved_outputs``: the slots of ``saved_outputs`` the node's own backward saves (``relu``,
  ``softmax``): kept whatever placement its readers need.

Placeholders own their storages (parameters, buffers, inputs), so what they own is never an
activation; the cost model counts only storages owned by call_function nodes.

An op whose ``OpFacts.saved_as`` is set runs as that instead: attention runs as the fused kernel
(``fused_attention_call``, registered with the attention rule) that keeps only its inputs, output and
log-sum-exp (a boolean mask first becomes a float mask the kernel keeps), as on CPU and GPU alike; on
the meta device torch would otherwise pick the reference math path, which keeps the whole attention
matrix. The op facts (``passes/op_facts.py``) are registered with the sharding rules: a caller imports
``passes.sharding.rules`` first (the cost model does).

When the program cannot run on the meta device (an op without a meta kernel, data-dependent
shapes), ``saved_info`` returns None and the cost model falls back to counting every op output
(``saved_status`` says why).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.passes.capture.export import set_graph_device
from autoshard.passes.graph import META, CapturedGraph, operands
from autoshard.passes.op_facts import op_facts

__all__ = ["SAVED", "SavedInfo", "saved_info", "saved_status", "is_selective_save_op", "fused_attention_call",
           "fused_attention", "attention_call", "run_as_saved", "OP_POLICY_COUNTED", "OP_POLICY_SAVE_OPS", "op_policy_saves"]

SAVED = "autoshard.saved"
_STATUS = "autoshard.saved_status"

# torchtitan's op-level selective activation checkpointing (``selective_ac_option="op"``; torchtitan
# torchtitan/parallelisms/parallelize_llama.py, ``_apply_ac_to_transformer_block``, 2024-12): in each
# checkpointed block, the outputs of ``aten.mm`` and of the SDPA kernels are saved, except every second
# ``aten.mm`` (the 2nd, 4th, ... of the block, counted apart in the forward and the recomputation),
# which is recomputed with everything else. Its list also names the functional reduce-scatter (this
# runtime's collectives write in place and are re-issued instead) and ``aten.max`` (for float8 scales).
# The SDPA kernels here are the fused ones torch picks on GPU and on CPU; ``addmm`` (a biased linear) is
# not on the list, so torchtitan recomputes it, and so does this policy.
OP_POLICY_COUNTED = "mm"
OP_POLICY_SAVE_OPS = frozenset({
    "mm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
})


def op_policy_saves(op_name: str, mm_ordinal: int) -> bool:
    """Whether torchtitan's op-level policy saves the output of a kernel named ``op_name`` (an op
    packet name), ``mm_ordinal`` being the count of ``aten.mm`` calls of the block so far, this one
    included (1 for the block's first)."""
    if op_name == OP_POLICY_COUNTED:
        return mm_ordinal % 2 == 1
    return op_name in OP_POLICY_SAVE_OPS


def is_selective_save_op(func) -> bool:
    """Whether an ATen op (an OpOverload) is one whose outputs selective checkpointing keeps
    (``OpFacts.selective_save``, registered with the op's rule)."""
    return op_facts(func).selective_save


@dataclass(frozen=True)
class SavedInfo:
    """What autograd keeps of one node (see the module docstring)."""
    output_saved: bool
    saved_operands: tuple[int, ...]
    saved_outputs: tuple[int, ...] = ()
    internal_bytes: int = 0
    selective_bytes: int = 0
    alias_of: Optional[tuple[str, int]] = None
    self_saved_outputs: tuple[int, ...] = ()
    kernel_outputs: tuple[tuple[str, int], ...] = ()


def saved_status(captured: CapturedGraph) -> Optional[str]:
    """"ok" after a successful analysis, the reason it failed, or None before any was attempted."""
    return captured.gm.meta.get(_STATUS)


def saved_info(captured: CapturedGraph) -> Optional[dict[str, SavedInfo]]:
    """Node name -> ``SavedInfo`` for every placeholder and call_function node; computed once and
    cached in ``node.meta[SAVED]``. None when the program cannot run on the meta device."""
    status = saved_status(captured)
    if status is None:
        try:
            found = _analyze(captured)
        except Exception as e:  # an op the meta device cannot run: fall back, say why
            captured.gm.meta[_STATUS] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            return None
        for node in captured.gm.graph.nodes:
            if node.name in found:
                node.meta[SAVED] = found[node.name]
        captured.gm.meta[_STATUS] = "ok"
    elif status != "ok":
        return None
    return {n.name: n.meta[SAVED] for n in captured.gm.graph.nodes if SAVED in n.meta}


# ---------------------------------------------------------------------------------------------


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _tensors(value) -> list[Optional[torch.Tensor]]:
    """A node's value as the list of its tensor outputs (None where an output is not a tensor),
    in the order ``passes.graph.outputs`` lists its metas."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v if isinstance(v, torch.Tensor) else None for v in value]
    return []


class _KernelOutputs(TorchDispatchMode):
    """Records the storages of the outputs of selective-save kernels dispatched while it is on."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, int] = {}
        self.calls: list[tuple[str, list[int]]] = []  # (op name, output storage keys) in dispatch order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if is_selective_save_op(func):
            keys = []
            for t in _tensors(out):
                if t is not None:
                    self.storages[_storage_key(t)] = t.untyped_storage().nbytes()
                    keys.append(_storage_key(t))
            self.calls.append((func.overloadpacket.__name__, keys))
        return out


def fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                     enable_gqa=False):
    """Scaled-dot-product attention as the fused CPU kernel runs it (see the module docstring)."""
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.where(attn_mask.logical_not(), float("-inf"), 0.0).to(query.dtype)
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
    return out[0]


_SDPA = torch.ops.aten.scaled_dot_product_attention.default


def attention_call(args, kwargs):
    """The arguments of an ``aten.scaled_dot_product_attention`` call by name."""
    names = [a.name for a in _SDPA._schema.arguments]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    return bound


def fused_attention_call(args, kwargs):
    """``aten.scaled_dot_product_attention(*args, **kwargs)`` as the fused kernel runs it, or None where
    that kernel is not the one that runs (grouped-query heads, dropout): the attention rule's
    ``OpFacts.saved_as``."""
    bound = attention_call(args, kwargs)
    if bound.get("enable_gqa") or bound.get("dropout_p"):
        return None
    return fused_attention(**bound)


def run_as_saved(target, args, kwargs):
    """Run an op as the saved-tensor analysis does: as its ``OpFacts.saved_as`` where that applies, else
    the op itself."""
    run_as = op_facts(target).saved_as
    out = run_as(args, kwargs) if run_as is not None else None
    return target(*args, **kwargs) if out is None else out


class _Recorder(fx.Interpreter):
    """Runs the program node by node and attributes every packed tensor (see ``_analyze``)."""

    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=False)  # keep storages alive: keys stay unique
        self.owner: dict[int, tuple[str, int]] = {}  # storage key -> (owner node, tensor slot)
        self.packed: list[torch.Tensor] = []  # packed while the current node runs
        self.kernels = _KernelOutputs()
        self.records: dict[str, tuple[list[torch.Tensor], dict[int, int]]] = {}
        self.calls: dict[str, list[tuple[str, list[int]]]] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.packed.append(t)
        return t

    def call_function(self, target, args, kwargs):
        return run_as_saved(target, args, kwargs)

    def run_node(self, n: fx.Node):
        self.packed = []
        self.kernels.storages, self.kernels.calls = {}, []
        if n.op == "call_function":
            with self.kernels:
                value = super().run_node(n)
        else:
            value = super().run_node(n)
        if n.op in ("placeholder", "call_function"):
            for slot, t in enumerate(x for x in _tensors(value) if x is not None):
                self.owner.setdefault(_storage_key(t), (n.name, slot))
            self.records[n.name] = (self.packed, dict(self.kernels.storages))
            self.calls[n.name] = list(self.kernels.calls)
        return value


def _placeholder_values(captured: CapturedGraph) -> list[torch.Tensor]:
    values = []
    for node in captured.gm.graph.nodes:
        if node.op != "placeholder":
            continue
        meta = node.meta.get(META)
        t = torch.empty(meta.shape, dtype=meta.dtype, device="meta")
        if node.name in captured.params and meta.dtype.is_floating_point:
            t.requires_grad_(True)
        values.append(t)
    return values


def _analyze(captured: CapturedGraph) -> dict[str, SavedInfo]:
    gm = set_graph_device(captured.gm, "meta")
    rec = _Recorder(gm)
    with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t), torch.enable_grad():
        rec.run(*_placeholder_values(captured))
    nodes = [n for n in gm.graph.nodes if n.op in ("placeholder", "call_function")]
    env = rec.env
    saved_storages: set[int] = set()
    saved_ops: dict[str, set[int]] = {}
    self_saved: dict[str, set[int]] = {}
    internal: dict[str, int] = {}
    alias: dict[str, tuple[str, int]] = {}
    for n in nodes:
        packed, _ = rec.records[n.name]
        outs = [t for t in _tensors(env[n]) if t is not None]
        own = {_storage_key(t) for slot, t in enumerate(outs) if rec.owner[_storage_key(t)] == (n.name, slot)}
        if outs and not own and n.op == "call_function":
            alias[n.name] = rec.owner[_storage_key(outs[0])]
        keys_of_operands = [_storage_key(env[op.node]) if op.index is None else
                            _storage_key(env[op.node][op.index]) for op in operands(n)] if n.op == "call_function" else []
        mine: set[int] = set()
        seen_internal: set[int] = set()
        own_slots = {_storage_key(t): slot for slot, t in enumerate(outs)
                     if rec.owner[_storage_key(t)] == (n.name, slot)}
        for t in packed:
            key = _storage_key(t)
            saved_storages.add(key)
            if key in own_slots:
                self_saved.setdefault(n.name, set()).add(own_slots[key])
            hits = [i for i, k in enumerate(keys_of_operands) if k == key]
            mine.update(hits)
            if not hits and key not in own and rec.owner.get(key, (n.name,))[0] == n.name and key not in seen_internal:
                seen_internal.add(key)  # created inside this node, not one of its outputs
                internal[n.name] = internal.get(n.name, 0) + t.untyped_storage().nbytes()
        saved_ops[n.name] = mine
    # an aliasing node saves its operand when anything saves (through further aliases) its output
    users: dict[str, list[fx.Node]] = {n.name: list(n.users) for n in nodes}
    for n in reversed(nodes):
        if n.name not in alias:
            continue
        passes_on = any(u.op == "call_function" and any(op.node is n and i in saved_ops.get(u.name, ())
                                                        for i, op in enumerate(operands(u)))
                        for u in users[n.name])
        if passes_on:
            base = alias[n.name]
            for i, op in enumerate(operands(n)):
                t = env[op.node] if op.index is None else env[op.node][op.index]
                if rec.owner.get(_storage_key(t)) == base or op.node.name == base[0]:
                    saved_ops[n.name].add(i)
    found: dict[str, SavedInfo] = {}
    for n in nodes:
        outs = [t for t in _tensors(env[n]) if t is not None]
        slots = tuple(slot for slot, t in enumerate(outs)
                      if rec.owner[_storage_key(t)] == (n.name, slot) and _storage_key(t) in saved_storages)
        _, kernels = rec.records[n.name]
        selective = sum(b for k, b in kernels.items() if rec.owner.get(k, (n.name,))[0] == n.name)
        calls = tuple((op, sum(kernels[k] for k in keys if rec.owner.get(k, (n.name,))[0] == n.name))
                      for op, keys in rec.calls.get(n.name, ()))
        found[n.name] = SavedInfo(bool(slots), tuple(sorted(saved_ops[n.name])), slots, internal.get(n.name, 0),
                                  selective, alias.get(n.name), tuple(sorted(self_saved.get(n.name, ()))), calls)
    return found
