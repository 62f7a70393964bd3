"""What a parameter's storage form costs (``passes.sharding.storage_forms``): its bytes per rank and
its gradient reductions, for the forms other than the plain ones (``CostModel.price_node`` prices
those).

For a parameter of ``B`` bytes in its own (master) dtype, ``G`` bytes of gradient in the reduce dtype
(``CostModel.reduce_scale``), stored with shard factor ``f`` (its ``S`` axes) and ZeRO axes of
product ``z``, one of ``m`` microsteps per step (``MicrobatchCostModel.microbatches``; 1 otherwise):

- memory: the parameter ``B / f`` (whole over the ZeRO axes: it is computed with), optimizer state
  ``numel * state bytes / (f z)``, reduced gradient ``B / (f z)``; ``zero1`` also holds the unreduced
  gradient ``B / f`` over the microsteps (gradients in ``CostModel.grad_dtype``: ``B`` counted in the
  reduce dtype where gradients accumulate in it) (``held_grads``), and ``once`` the gradients of its gathered
  copies, ``G`` (gathered over every sharded axis, FSDP's case: an upper bound);
- time: the optimizer step over the local slice (``param_step_seconds`` of the ``1/(f z)`` piece, as a
  plain parameter's price includes its whole update) and, under accumulation, each microstep's add into
  the gradient as held between microsteps: whole (``B / f``) for a form reduced once per step (``zero1``,
  ``once``), the ``1/(f z)`` slice for ``zero2`` (as ``stage_zero.zero_step_costs`` prices it);
- ``zero1`` / ``zero2``: a reduce-scatter of ``G / f`` over the ZeRO axes flattened (``zero1`` once
  per step: ``1/m`` of it per microstep; ``zero2`` every microstep), an all-reduce of the reduced
  slice ``G / (f z)`` over the other ``R`` axes (once per step, as ``grad_sync`` prices it), and an
  all-gather of ``B / f`` over the ZeRO axes after the optimizer step (once per step, exposed: the
  runtime gathers before the next step's forward; ``phase="step"``). The reductions are bucketed, so
  each pays its share of a collective's fixed cost (``CostModel.bucketed_seconds``); ``runtime.zero``
  runs them and ``passes.solve.storage_buckets`` prices its exact buckets for the plan's estimate;
- ``once``: the gathered copies' gradient reduce-scatters are priced by the edges from the
  parameter, every microstep, here as in the ILP (which never chooses ``once`` itself: which copies a
  plan gathers is the edges' choice, so ``passes.solve.held_reductions`` adds it to a finished plan);
  ``solution.evaluate`` prices those reductions once per step.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

from autoshard.passes.cost.collectives import Collective
from autoshard.passes.sharding.storage_forms import form_of
from autoshard.passes.spec import Shard, Strategy, TensorMeta

if TYPE_CHECKING:  # pragma: no cover
    from autoshard.passes.cost.facts import GraphFacts

__all__ = ["storage_price"]


def storage_price(cm: "CostModel", name: str, strategy: Strategy, facts: "GraphFacts") -> dict:
    """``NodePrice`` fields (all but ``compute``) of parameter ``name`` under ``strategy`` (module docstring)."""
    meta: TensorMeta = facts.tensor_outputs(name)[0]
    master = facts.master_dtype(name)
    own = meta.nbytes if master is None else TensorMeta(meta.shape, master).nbytes
    held_grad = cm.grad_bytes(meta, master)  # its gradient as held between microsteps (``grad_dtype``)
    storage = strategy.outputs[0]
    mesh = cm.mesh.shape
    form = form_of(strategy, meta.shape, mesh)
    f = cm.shard_factor(storage)
    z = math.prod(mesh[a] for a in form.zero_axes)
    m = getattr(cm, "microbatches", 1)
    grad_bytes = meta.nbytes * cm.reduce_scale(meta) / f
    total = facts.param_bytes
    syncs: list[Collective] = []
    collectives: tuple = ()
    held = 0.0
    if form.zero:
        axes = form.zero_axes
        launch = cm.hardware.op_overhead_s
        scatter = cm.bucketed_seconds("reduce_scatter", axes, grad_bytes, total * cm.reduce_scale(meta)) + launch
        syncs.append(Collective("reduce_scatter", _axis(axes), int(grad_bytes), scatter / m if form.zero_reduced_once else scatter,
                                "bwd"))
        sliced = tuple(Shard(form.zero_dim) if a in axes else p for a, p in enumerate(storage))
        syncs.extend(cm.grad_sync(meta, sliced, total))  # the other R axes: the slice, once per step
        gather = cm.bucketed_seconds("all_gather", axes, own / f, total) + launch
        collectives = (Collective("all_gather", _axis(axes), int(own / f), gather / m, "step"),)
        grads = held_grad / (f * z)
        held = held_grad / f if form.zero_once else 0.0
    else:
        sliced = storage
        grads = held_grad / f
        syncs.extend(cm.grad_sync(meta, storage, total))
    # the optimizer updates the local slice (as a plain parameter's price includes its whole update); a
    # gradient reduced once per step accumulates whole between microsteps, a zero2 one into its slice
    accumulated = storage if form.zero_reduced_once else sliced
    step = cm.param_step_seconds(meta, sliced, master, accumulated=accumulated) if cm.price_step else 0.0
    if form.held_copies:
        held += meta.nbytes * cm.reduce_scale(meta)
    return {"step_seconds": step, "grad_sync": tuple(syncs), "collectives": collectives, "params": own / f, "grads": grads,
            "optimizer": meta.numel * cm.opt_bytes / (f * z), "held_grads": held}


def _axis(axes: tuple[int, ...]):
    return axes[0] if len(axes) == 1 else tuple(axes)

