"""Build a ``peak_timeline.StepTrace`` from the prices ``solution.evaluate`` computes.

``TraceBuilder`` is fed every node price and every edge price of one assignment (the same
``LeverPricer`` figures the memory breakdown sums) and places them on the program's positions:

- a node's kept bytes at its own position, an edge's kept bytes (and gathered copies kept to the
  backward) at its reader's position;
- a node's outputs (local bytes, views excluded: they own no storage) as its forward transient;
- the gradient of each op output that carries one, from its producer to its last reader (an
  ``add``'s operands share its output's gradient: one storage, ``_merge_pass_through``);
- each parameter's local gradient from its last reader on (autograd sums a parameter's gradient
  over its readers before accumulating it: a tied weight's gradient exists from the later
  reader's backward); a gathered copy's gradient (the copy's size) from its last reader to its
  group's first reader, where the gather's backward reduces it, with the group's flat
  reduce-scatter buffer there (``gather_segments``);
- a redistributed activation's gradient moved back to the producer's layout (the collectives'
  adjoints make a new tensor) at the reader's backward;
- a value read by several ops: at each reader's backward but the last, its new gradient
  contribution and autograd's out-of-place sum (``_accumulations``);
- what a node's backward allocates beyond its operands' gradients, at its backward
  (``passes.capture.backward_workspace``: the intermediate gradients of the ops it is made of, e.g.
  cross entropy's log-probability gradient, the size of the logits), split as its largest operand;
- the bytes a recomputing block instance re-creates, summed over its nodes up to each position
  (the recomputation runs before the instance's backward; walking the backward, each node's
  recreated tensors are freed after its own backward). ``LeverPrice.recompute`` is one node's
  share ``1 / n`` of its type's instances, so one node's bytes are ``n`` times it;
- the gradient buckets (``runtime.gradsync`` packs every replicated parameter's gradient into a
  flat bucket in the reduce dtype; the buckets are allocated once and kept, so they are alive the
  whole step): the synced gradients' bytes, and those of them that end the step as views into a
  bucket (same dtype);
- the gathered copies in flight beyond those kept: ``gathered_peak - kept gathered``; in the
  backward, per position, the copies gathered again and the backward prefetch in flight
  (``gather_segments``).

Resident bytes: parameters, buffers, optimizer state, the global batch (``step`` takes the whole
global batch, inputs and target, on every rank: k microbatches; with ``local_batch`` a rank holds
only its slice, and this over-estimates), and for Adam / AdamW one 4-byte ``step`` tensor per
parameter (``torch/optim/adam.py _init_group``: ``torch.tensor(0.0,
dtype=_get_scalar_dtype())``, float32 off ``capturable`` / ``fused``).
"""
from __future__ import annotations

import math

from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.cost.model import CostModel, NodePrice
from autoshard.passes.capture.backward_workspace import backward_workspace
from autoshard.passes.graph import CapturedGraph, operand_meta, operands
from autoshard.passes.layout.gathers import gather_groups
from autoshard.passes.solve.blocks import BlockMap
from autoshard.passes.solve.clustering import OUTPUT, output_slot
from autoshard.passes.solve.lever_costs import LeverPrice
from autoshard.passes.sharding.storage_forms import form_of
from autoshard.passes.solve.peak_timeline import StepTrace, optimizer_temporaries
from autoshard.passes.solve.storage_trace import StorageTrace
from autoshard.passes.spec import Strategy

__all__ = ["TraceBuilder", "STEP_COUNTER_BYTES"]


def _op_name(target) -> str:
    """``aten.view.default`` -> ``view``; ``operator.getitem`` -> ``getitem`` (moved here from
    ``cost/facts.py``, whose pricing no longer reads names; these tables are still by name)."""
    packet = getattr(target, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(target, "__name__", str(target))


#: ops whose backward passes the output's gradient to their first N operands as it is
_PASS_THROUGH = {"add": 2, "add_": 2, "sub": 1, "sub_": 1}

#: views whose backward is a view of the incoming gradient when they cover their operand whole
_WHOLE_VIEWS = {"view", "_unsafe_view", "reshape", "_reshape_alias", "transpose", "t", "permute", "squeeze",
                "unsqueeze", "flatten", "unflatten", "movedim", "view_as", "alias", "view_as_real",
                "view_as_complex"}

#: node.meta key caching ``backward_workspace`` (global bytes)
WORKSPACE = "autoshard.backward_workspace"

#: AdamW / Adam keep a float32 ``step`` tensor per parameter (see the module docstring)
STEP_COUNTER_BYTES = 4


class TraceBuilder:
    """Collects one assignment's prices on program positions (module docstring)."""

    def __init__(self, captured: CapturedGraph, facts: GraphFacts, cm: CostModel, blocks: BlockMap,
                 strategies: dict[str, Strategy]):
        self.facts, self.cm, self.blocks, self.strategies = facts, cm, blocks, strategies
        nodes = list(captured.gm.graph.nodes)
        self.position = {n.name: i for i, n in enumerate(nodes)}
        self.last = len(nodes) - 1
        self.trace = StepTrace(names=[n.name for n in nodes])
        for key in ("kept", "outputs", "param_grads", "grad_transient", "recompute", "reduce_after", "accumulate_after",
                    "reduce_frees", "reduce_prefetch", "reduce_output", "gathered_backward"):
            setattr(self.trace, key, [0.0] * len(nodes))
        self._last_reader: dict[tuple[str, int], int] = {}
        self._readers: dict[tuple[str, int], set[int]] = {}  # value -> positions of the ops differentiating it
        self._recompute_at: dict[str, dict[int, float]] = {}  # block instance -> position -> bytes
        self._gather_readers: dict[str, list[int]] = {}  # gathered parameter -> [first, last, copy bytes]
        self._param_grad: dict[str, float] = {}
        self._instance_span: dict[str, tuple[int, int]] = {}  # block instance -> (first, last position)
        for name, instance in blocks.instance.items():
            if name in self.position:
                lo, hi = self._instance_span.get(instance, (self.position[name], self.position[name]))
                self._instance_span[instance] = (min(lo, self.position[name]), max(hi, self.position[name]))
        self._param_bytes: list[float] = []
        self._synced_grads = 0.0
        self._grads_in_buckets = 0.0
        # parameters in ZeRO-1/2 and reduce-once forms (``storage_trace``)
        self.storage = StorageTrace(cm.grad_bucket_bytes, staged=cm.hardware.name.lower() == "cpu")
        self._kept_gathered = 0.0
        self._input_bytes = 0.0  # one microstep's inputs and target, full size

    def node(self, name: str, base: NodePrice, price: LeverPrice) -> None:
        """Node ``name``'s cost-model price and its price under its policy."""
        i = self.position[name]
        t = self.trace
        t.resident += base.params + base.optimizer
        t.kept[i] += price.kept
        if self.facts.kind[name] != "param":
            t.grads += base.grads
        if self.facts.kind[name] == "param":
            form = self._form(name)
            made = base.grads  # the gradient a backward makes and the step holds
            in_bucket = base.grad_sync and (form is None or not form.zero) and self.cm.accumulate_in_reduce_dtype
            if in_bucket:  # the held gradient is its bucket (below); a backward makes it in the compute dtype
                meta = self.facts.tensor_outputs(name)[0]
                made = base.grads * meta.dtype.itemsize / self.cm.grad_dtype(meta).itemsize
            t.grads += made
            self._param_grad[name] = made
            if form is not None:
                z = math.prod(self.cm.mesh.shape[a] for a in form.zero_axes)
                meta = self.facts.tensor_outputs(name)[0]
                reduced = meta.nbytes * self._reduce_scale(name) / self.cm.shard_factor(self.strategies[name].outputs[0])
                copies = meta.nbytes * self._reduce_scale(name) if form.held_copies else 0.0
                kind = (form.zero_axes, form.zero_reduced_once, self.strategies[name].outputs[0], str(meta.dtype),
                        self._reduce_scale(name))
                self.storage.parameter(name, base, z, reduced, copies, kind)
                self._param_bytes.append(self.storage.optimizer_sizes(name, base.params))
            else:
                self._param_bytes.append(base.params)
            if base.grad_sync and (form is None or not form.zero):  # a ZeRO slice's all-reduce: runtime.zero's
                if in_bucket:  # Megatron-LM's main-gradient buffer: each backward's gradient is added into its
                    # bucket (held in the reduce dtype all step, reduced in place) and freed
                    self._synced_grads += base.grads
                    self._grads_in_buckets += made
                else:
                    scale = self._reduce_scale(name)
                    self._synced_grads += base.grads * scale
                    if scale == 1.0:  # the reduced bucket slice becomes the gradient (no cast back)
                        self._grads_in_buckets += base.grads
        elif self.facts.kind[name] == "input":
            self._input_bytes += sum(m.nbytes for m in self.facts.tensor_outputs(name))
        elif self.facts.kind[name] == "op" and name not in self.facts.views:
            metas = self.facts.tensor_outputs(name)
            t.outputs[i] += self.cm.activation_bytes(metas, self.strategies[name].outputs[:len(metas)])
            t.grad_transient[i] += self._backward_workspace(name)
        self._add_recompute(name, i, price.recompute)

    def edge(self, u: str, slot: int, v: str, price: LeverPrice, src: tuple = (), moved: bool = False) -> None:
        """Operand read of output ``slot`` of ``u`` (in placement ``src``) by ``v`` (or the
        program's output); ``moved``: collectives redistribute it, so the backward runs their
        adjoints on its gradient, making a new tensor of ``u``'s own layout at ``v``."""
        j = self.last if v == OUTPUT else self.position[v]
        if moved and v != OUTPUT and self.facts.kind.get(u) == "op" and self.facts.value_needs_grad(u, slot):
            meta = self.facts.tensor_outputs(u)[slot]
            self.trace.grad_transient[j] += self.cm.activation_bytes([meta], [src])
        self.trace.kept[j] += price.kept + price.gathered
        self._kept_gathered += price.gathered
        kind = self.facts.kind.get(u)
        if v != OUTPUT and v in self.facts.requires_grad and not price.gather_copy and (
                kind == "param" or (kind == "op" and self.facts.value_needs_grad(u, slot))):
            self._readers.setdefault((u, slot), set()).add(j)
        if kind == "param":
            self._last_reader[(u, slot)] = max(self._last_reader.get((u, slot), j), j)
            if price.gather_copy and self.facts.value_needs_grad(u, slot):
                entry = self._gather_readers.setdefault(u, [j, j, 0.0])
                entry[0], entry[1], entry[2] = min(entry[0], j), max(entry[1], j), max(entry[2], price.gather_copy)
        elif kind == "op" and v != OUTPUT and self.facts.value_needs_grad(u, slot):
            key = (u, slot)
            self._last_reader[key] = max(self._last_reader.get(key, j), j)
        if v != OUTPUT:
            self._add_recompute(v, j, price.recompute)

    def gather_segments(self, gathers: dict, staged_reduce_scatter: bool = False) -> None:
        """The gathered copies' groups: ``gathers`` maps (parameter, placement) to ``solution``'s
        record ``[first reader position, gather segment, copy bytes, kept, regathered, fused]``; one
        group per segment (``passes.layout.gathers.gather_groups``), gathered by one call
        (``runtime.param_gather``). The group's backward runs once every member's gradient has
        arrived: each member's copy gradient lives down to the group's first reader, after whose
        backward the reduce-scatter concatenates the group's gradients into one flat buffer (the group's copy
        bytes again). ``staged_reduce_scatter``: the backend's reduce-scatter copies its whole
        input once more (gloo's ``reduce_scatter_tensor``; measured: a 1 MiB input on 2 ranks
        peaks at input + output + 1 MiB, where ``all_gather_into_tensor`` and ``all_reduce``
        allocate nothing beyond their tensors).

        The copies gathered again in the backward (``gathered_backward``), measured with
        ``MemTracker`` on GPT-NeoX (selective), HF Llama on (2, 2) (full + reshard) and GPT:

        - a group gathered again (reshard, or a recomputing block) is gathered at its last reader's
          backward, or before its block instance's backward when the instance recomputes; each copy
          is freed once its own first reader's backward has run (the last saved use);
        - that regather starts the flat gather of the latest earlier group gathered again with
          fused members (``ParamGatherer.backward_next``): its output (those members' copy bytes)
          and its input (their shards, concatenated) stay alive until that group is gathered
          again, across the reductions of every group in between (``reduce_prefetch``);
        - with accumulation, a reduction's output (the group's shard gradients) is alive next to
          the held gradients before it is added in (``reduce_output``)."""
        factor = 2.0 if staged_reduce_scatter else 1.0
        # per group: [first position, copy bytes with gradients, copies gathered again, prefetched bytes,
        #             last position its copies are alive at, shard bytes of the gradients reduced,
        #             [(first reader, bytes) of each copy gathered again]]
        groups: list[list] = []
        for members in gather_groups((rec[0], rec[1], (param, placement, rec))
                                     for (param, placement), rec in gathers.items()):
            first, key = members[0][2][0], members[0][2][1]
            end = max(self._instance_span.get(key, (first, first))[1], first) if isinstance(key, str) else first
            group = [first, 0.0, 0.0, 0.0, end, 0.0, []]
            for param, placement, (reader, _key, size, kept, regathered, fused, *_r) in members:
                entry = self._gather_readers.get(param)
                if entry is not None:
                    entry[0] = min(entry[0], group[0])
                    group[1] += size
                    group[4] = max(group[4], entry[1])
                    group[5] += size * self._shard_fraction(param, placement)
                if regathered and not kept:
                    group[2] += size
                    group[6].append((reader, size))
                    if fused:
                        group[3] += size * (1.0 + self._shard_fraction(param, placement))
            groups.append(group)
        alive = [0.0] * (len(self.trace.names) + 1)  # difference array over positions
        started: set[int] = set()
        for g in range(len(groups) - 1, -1, -1):  # the backward's order
            start, total, again, _, end, shard_grads, members = groups[g]
            self._reduce(start, total, factor)
            self.trace.reduce_output[start] += shard_grads
            if not again:
                continue
            for first, size in members:  # a copy is freed once its first reader's backward has run
                alive[first] += size
                alive[end + 1] -= size
            earlier = [j for j in range(g) if groups[j][2] and groups[j][3]]
            if earlier and earlier[-1] not in started:  # this group's regather starts that group's gather,
                j = earlier[-1]                           # used at its own regather
                started.add(j)
                alive[groups[j][4] + 1] += groups[j][3]
                alive[end + 1] -= groups[j][3]
                for k in range(j + 1, g + 1):
                    if groups[k][1]:
                        self.trace.reduce_prefetch[groups[k][0]] += groups[j][3]
        running = 0.0
        for i in range(len(self.trace.names)):
            running += alive[i]
            self.trace.gathered_backward[i] = running

    def _reduce(self, start: int, total: float, factor: float) -> None:
        if total:
            self.trace.reduce_after[start] += factor * total
            self.trace.reduce_frees[start] += total

    def _shard_fraction(self, param: str, placement: tuple) -> float:
        """Local shard bytes over gathered copy bytes of ``param`` moved from its storage to ``placement``."""
        storage = self.strategies[param].outputs[0]
        fraction = 1.0
        for axis, (s, d) in enumerate(zip(storage, placement)):
            if s != d:
                fraction /= self.cm.mesh.shape[axis]
        return fraction

    def finish(self, optimizer, foreach: bool, microsteps: int, gathered_peak: float) -> StepTrace:
        """The trace, with the step-wide terms. ``foreach``: the optimizer runs torch's foreach
        implementation; ``microsteps``: gradient accumulation's k (the last microstep holds the
        others' gradients); ``gathered_peak``: ``gather_timeline.gathered_peak`` of the assignment."""
        t = self.trace
        t.resident += self._input_bytes * microsteps
        self._extend_through_identity_views()
        spans: dict[tuple[str, int], list] = {}
        for (u, slot), last in self._last_reader.items():
            if u in self.facts.views or self.facts.kind.get(u) != "op":
                continue
            meta = self.facts.tensor_outputs(u)[slot]
            nbytes = self.cm.activation_bytes([meta], [self.strategies[u].outputs[slot]])
            spans[(u, slot)] = [self.position[u], last, nbytes]
        self._merge_pass_through(spans)
        t.value_grads.extend(tuple(span) for span in spans.values())
        self._accumulations()
        for ph, nbytes in self._param_grad.items():
            t.param_grads[self._last_reader.get((ph, 0), self.last)] += nbytes
        for first, last, nbytes in self._gather_readers.values():
            t.value_grads.append((first, last, nbytes))
        adam = str(optimizer).lower() in ("adam", "adamw")
        if adam and t.grads > 0:
            t.resident += STEP_COUNTER_BYTES * len(self._param_bytes)
        t.optimizer_temporaries = optimizer_temporaries(self._param_bytes, optimizer, foreach) if t.grads > 0 else 0.0
        t.grads_held = microsteps > 1
        t.comm_buffer = self._synced_grads
        t.grads_in_buckets = self._grads_in_buckets
        self.storage.apply(t, {u: j for (u, _), j in self._last_reader.items()}, microsteps,
                           {u: e[2] * self._reduce_scale(u) for u, e in self._gather_readers.items()})
        t.gathered_in_flight = max(0.0, gathered_peak - self._kept_gathered)
        members: dict[str, list[int]] = {}
        for name, instance in self.blocks.instance.items():
            if name in self.position:
                members.setdefault(instance, []).append(self.position[name])
        for instance, at in self._recompute_at.items():
            running = 0.0
            for i in sorted(set(members.get(instance, [])) | set(at)):
                running += at.get(i, 0.0)
                t.recompute[i] += running
        return t

    def _accumulations(self) -> None:
        """A value read by several ops gets one gradient contribution per reader. The last reader's
        backward makes the gradient's storage (its span, or the parameter's gradient); each earlier
        reader's backward makes a new contribution and autograd's ``InputBuffer`` adds it, out of
        place unless it holds the only reference to a dense old sum (``input_buffer.cpp``,
        ``can_accumulate_inplace``): the contribution and the sum, two more of the gradient's bytes,
        at that reader's backward. Measured (issue 27): the tied embedding of OPT and Gemma, whose head
        contribution is a transposed view (never summed in place), peaks at the embedding's backward
        with three of them alive. A whole view of a value (a reshape) reads its gradient, not a
        contribution of its own. The engine adds a contribution once the reader's backward has
        returned (``peak_timeline``'s ``accumulate_after``)."""
        merged: dict[tuple[str, int], set[int]] = {}
        for key, readers in self._readers.items():
            whole = {j for j in readers if self._identity_operand(self.trace.names[j]) == key}
            owner = self._owner(key) if self.facts.kind.get(key[0]) == "op" else key
            merged.setdefault(owner, set()).update(readers - whole)
        for (u, slot), readers in merged.items():
            if len(readers) < 2:
                continue
            if self.facts.kind.get(u) == "param":
                nbytes = self._param_grad.get(u, 0.0)
            else:
                nbytes = self.cm.activation_bytes([self.facts.tensor_outputs(u)[slot]],
                                                  [self.strategies[u].outputs[slot]])
            for j in sorted(readers)[:-1]:
                self.trace.accumulate_after[j] += 2.0 * nbytes

    def _extend_through_identity_views(self) -> None:
        """A view of its operand's whole storage (``x.to(x.dtype)``, ``dropout(x, p=0)``, an alias,
        and any reshape, transpose or permute of all of it: their backward is a view of the incoming
        gradient) has its operand's gradient, one storage, so the operand's gradient lives from the
        view's last reader on (views have no span of their own). Measured (issue 27): the logits'
        ``reshape(-1, vocab)`` before the cross entropy; the logits' gradient is made by the loss's
        backward, not the reshape's. Reverse program order resolves chains of them."""
        for v in sorted(self.facts.views, key=lambda n: -self.position.get(n, -1)):
            last = self._last_reader.get((v, 0))
            key = self._identity_operand(v)
            if last is None or key is None or key not in self._last_reader:
                continue
            self._last_reader[key] = max(self._last_reader[key], last)

    def _identity_operand(self, v: str):
        """(operand, slot) that view ``v`` is whole, or None: the same shape, or the same bytes
        rearranged (``_WHOLE_VIEWS``)."""
        node = self.facts.nodes.get(v)
        ops = operands(node) if node is not None and v in self.facts.views else []
        if not ops or self.facts.kind.get(ops[0].node.name) != "op":
            return None
        key = (ops[0].node.name, output_slot(ops[0].node, ops[0].index))
        metas = self.facts.tensor_outputs(key[0])
        mine = self.facts.tensor_outputs(v)
        if key[1] >= len(metas) or not mine:
            return None
        if metas[key[1]].shape == mine[0].shape:
            return key
        if _op_name(node.target) in _WHOLE_VIEWS and metas[key[1]].nbytes == mine[0].nbytes:
            return key
        return None

    def _owner(self, key: tuple[str, int]) -> tuple[str, int]:
        """The value that owns ``key``'s storage through identity views (``_identity_operand``)."""
        while key[1] == 0 and (up := self._identity_operand(key[0])) is not None:
            key = up
        return key

    def _merge_pass_through(self, spans: dict) -> None:
        """An ``add`` hands its output's gradient to both operands unchanged (``sub`` to the first):
        an operand whose gradient comes only from it shares that storage, so its span is merged
        into the output's (one storage, alive to the earliest such operand's producer). Residual
        streams chain: adds are merged in program order."""
        adds = sorted((self.position[n], n) for n in self.facts.kind
                      if self.facts.kind[n] == "op" and _op_name(self.facts.nodes[n].target) in _PASS_THROUGH)
        for at, name in adds:
            out = spans.get((name, 0))
            if out is None:
                continue
            node = self.facts.nodes[name]
            shape = self.facts.tensor_outputs(name)[0].shape
            for k, op in enumerate(operands(node)[:_PASS_THROUGH[_op_name(node.target)]]):
                key = self._owner((op.node.name, output_slot(op.node, op.index)))
                span = spans.get(key)
                if span is None or span[1] != at or self.facts.tensor_outputs(key[0])[key[1]].shape != shape:
                    continue
                out[0] = min(out[0], span[0])
                del spans[key]

    def _add_recompute(self, name: str, i: int, share: float) -> None:
        instance = self.blocks.instance.get(name)
        if share and instance is not None:
            n = self.blocks.num_instances(self.blocks.type_of(name))
            at = self._recompute_at.setdefault(instance, {})
            at[i] = at.get(i, 0.0) + share * n

    def _backward_workspace(self, name: str) -> float:
        """Local bytes the backward of ``name`` holds beyond its operands' gradients
        (``passes.capture.backward_workspace``, global shapes), scaled by how its largest operand is
        split under its strategy."""
        if not self.facts.training or name not in self.facts.requires_grad:
            return 0.0
        node = self.facts.nodes[name]
        workspace = node.meta.get(WORKSPACE)
        if workspace is None:
            workspace = node.meta[WORKSPACE] = backward_workspace(node, lambda a: a.name in self.facts.requires_grad)
        if not workspace:
            return 0.0
        placements = self.strategies[name].inputs
        sized = [(operand_meta(op).nbytes, k) for k, op in enumerate(operands(node)) if k < len(placements)]
        if not sized:
            return float(workspace)
        nbytes, k = max(sized)
        return float(workspace) / self.cm.shard_factor(placements[k])

    def _form(self, name: str):
        """The storage form of parameter ``name`` when it is not plain (``storage_forms``), else None."""
        st = self.strategies[name]
        if not any(st.lowerings):
            return None
        return form_of(st, self.facts.tensor_outputs(name)[0].shape, self.cm.mesh.shape)

    def _reduce_scale(self, name: str) -> float:
        metas = self.facts.tensor_outputs(name)
        return self.cm.reduce_scale(metas[0]) if metas else 1.0
