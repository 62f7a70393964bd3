"""Build a ``peak_timeline.StepTrace`` from the prices ``solution.evaluate`` computes.

``TraceBuilder`` is fed every node price and every edge price of one assignment (the same
``LeverPricer`` figures the memory breakdown sums) and places them on the program's positions:

- a node's kept bytes at its own position, an edge's kept bytes (and gathered copies kept to the
  backward) at its reader's position;
- a node's outputs (local bytes, views excluded: they own no storage) as its forward transient;
- the gradient of each op output that carries one, from its producer to its last reader;
- each parameter's local gradient at its first reader; a gathered copy's gradient (the copy's
  size) at each reader of the copy;
- each recomputing block type's re-created bytes (one instance's: the per-item shares summed) at
  the positions of that type's nodes;
- the gradient buckets (``runtime.gradsync`` packs every replicated parameter's gradient into a
  flat bucket in the reduce dtype and keeps them to the end of the backward): the synced gradients'
  bytes;
- the gathered copies in flight beyond those kept: ``gathered_peak - kept gathered``.

Resident bytes: parameters, buffers, optimizer state, and for Adam / AdamW one 4-byte ``step``
tensor per parameter (``torch/optim/adam.py _init_group``: ``torch.tensor(0.0,
dtype=_get_scalar_dtype())``, float32 off ``capturable`` / ``fused``).
"""
from __future__ import annotations

from typing import Optional

from autoshard.passes.cost.facts import GraphFacts
from autoshard.passes.cost.model import CostModel, NodePrice
from autoshard.passes.graph import CapturedGraph
from autoshard.passes.solve.blocks import BlockMap
from autoshard.passes.solve.clustering import OUTPUT
from autoshard.passes.solve.lever_costs import LeverPrice
from autoshard.passes.solve.peak_timeline import StepTrace, optimizer_temporaries
from autoshard.passes.spec import Strategy

__all__ = ["TraceBuilder", "STEP_COUNTER_BYTES"]

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
        for key in ("kept", "outputs", "param_grads", "grad_transient", "recompute"):
            setattr(self.trace, key, [0.0] * len(nodes))
        self._last_reader: dict[tuple[str, int], int] = {}
        self._first_reader: dict[str, int] = {}
        self._recompute_by_type: dict[Optional[str], float] = {}
        self._param_grad: dict[str, float] = {}
        self._param_bytes: list[float] = []
        self._synced_grads = 0.0
        self._kept_gathered = 0.0

    def node(self, name: str, base: NodePrice, price: LeverPrice) -> None:
        """Node ``name``'s cost-model price and its price under its policy."""
        i = self.position[name]
        t = self.trace
        t.resident += base.params + base.optimizer
        t.grads += base.grads
        t.kept[i] += price.kept
        if self.facts.kind[name] == "param":
            self._param_grad[name] = base.grads
            self._param_bytes.append(base.params)
            if base.grad_sync:
                self._synced_grads += base.grads * self._reduce_scale(name)
        elif self.facts.kind[name] == "op" and name not in self.facts.views:
            metas = self.facts.tensor_outputs(name)
            t.outputs[i] += self.cm.activation_bytes(metas, self.strategies[name].outputs[:len(metas)])
        self._add_recompute(name, price.recompute)

    def edge(self, u: str, slot: int, v: str, price: LeverPrice) -> None:
        """Operand read of output ``slot`` of ``u`` by ``v`` (or the program's output)."""
        j = self.last if v == OUTPUT else self.position[v]
        self.trace.kept[j] += price.kept + price.gathered
        self._kept_gathered += price.gathered
        kind = self.facts.kind.get(u)
        if kind == "param":
            self._first_reader[u] = min(self._first_reader.get(u, j), j)
            self.trace.grad_transient[j] += price.gather_copy if self.facts.value_needs_grad(u, slot) else 0.0
        elif kind == "op" and v != OUTPUT and self.facts.value_needs_grad(u, slot):
            key = (u, slot)
            self._last_reader[key] = max(self._last_reader.get(key, j), j)
        if v != OUTPUT:
            self._add_recompute(v, price.recompute)

    def finish(self, optimizer, foreach: bool, grads_held: bool, gathered_peak: float) -> StepTrace:
        """The trace, with the step-wide terms. ``foreach``: the optimizer runs torch's foreach
        implementation; ``grads_held``: gradient accumulation (the last microstep holds the others'
        gradients); ``gathered_peak``: ``gather_timeline.gathered_peak`` of the assignment."""
        t = self.trace
        for (u, slot), last in self._last_reader.items():
            if u in self.facts.views:
                continue
            meta = self.facts.tensor_outputs(u)[slot]
            nbytes = self.cm.activation_bytes([meta], [self.strategies[u].outputs[slot]])
            t.value_grads.append((self.position[u], last, nbytes))
        for ph, nbytes in self._param_grad.items():
            t.param_grads[self._first_reader.get(ph, 0)] += nbytes
        adam = str(optimizer).lower() in ("adam", "adamw")
        if adam and t.grads > 0:
            t.resident += STEP_COUNTER_BYTES * len(self._param_bytes)
        t.optimizer_temporaries = optimizer_temporaries(self._param_bytes, optimizer, foreach) if t.grads > 0 else 0.0
        t.grads_held = grads_held
        t.comm_buffer = self._synced_grads
        t.gathered_in_flight = max(0.0, gathered_peak - self._kept_gathered)
        by_type = self._recompute_by_type
        for name, i in self.position.items():
            btype = self.blocks.type_of(name) if name in self.blocks.instance else None
            if btype is not None:
                t.recompute[i] += by_type.get(btype, 0.0)
        return t

    def _add_recompute(self, name: str, nbytes: float) -> None:
        if nbytes:
            btype = self.blocks.type_of(name)
            self._recompute_by_type[btype] = self._recompute_by_type.get(btype, 0.0) + nbytes

    def _reduce_scale(self, name: str) -> float:
        metas = self.facts.tensor_outputs(name)
        return self.cm.reduce_scale(metas[0]) if metas else 1.0
