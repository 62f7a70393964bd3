"""Sharding rules: one registry keyed by op, one module per op family.

- ``registry``: the table (``RULES``), the one decorator (``register_rule``), the ``OpCall`` a rule
  receives (its arguments by schema name: ``call.bound_args``) and ``rule_strategies``, which asks
  the table for a node's 1-D strategies.
- ``common``: helpers every family shares (``norm_dim``, ``norm_dims``, ``split_dims``,
  ``broadcast_placement``). A family imports only ``registry``, ``common`` and ``passes`` vocabulary,
  never another family.
- the families: ``elementwise``, ``reductions``, ``views``, ``indexing``, ``factory``, ``matmul``,
  ``embedding``, ``norms``, ``attention``, ``losses``, ``conv``, ``pooling``, ``getitem``,
  ``view_scatters``, ``complex_views``, ``grouped_mm``, ``moe``, ``upsampling``.

Importing this package imports every family, whose decorators fill ``RULES``. Adding a rule for an
op touches one file, its family module::

    @register_rule(aten.cumsum.default, float_partials_only=True)   # P never on integer tensors
    def cumsum_rule(call: OpCall) -> list[Strategy1D]:
        x = call.inputs[0]                                      # TensorMeta of each tensor operand
        dim = norm_dim(call.bound_args["dim"], len(x.shape))    # arguments by schema name, defaults filled
        return [Strategy1D((Shard(d),), (Shard(d),)) for d in split_dims(x.shape) if d != dim]

A rule's ``facts=`` (``passes/op_facts.py``: FLOPs of a compute-bound op, its GEMM shape, what autograd
keeps of it) go in the same call; ``register_facts`` records them for an op without a rule of its own.

A new family is a new module here, named in the import and in ``FAMILIES`` below.

May import: torch and the ``passes`` vocabulary (``spec``, ``graph``, ``passes.schema``).
"""
from autoshard.passes.op_facts import OpFacts, register_facts
from autoshard.passes.sharding.rules.registry import (
    LOCAL_CHECKS, RULES, OpCall, local_check, lookup, op_call, register_rule, rule_strategies,
)
from autoshard.passes.sharding.rules import (
    attention, complex_views, conv, elementwise, embedding, factory, getitem, grouped_mm, indexing, losses, matmul,
    moe, norms, pooling, reductions, upsampling, view_scatters, views,
)

FAMILIES = (attention, complex_views, conv, elementwise, embedding, factory, getitem, grouped_mm, indexing, losses,
            matmul, moe, norms, pooling, reductions, upsampling, view_scatters, views)
"""Every family module; importing them registered their rules."""

__all__ = ["FAMILIES", "LOCAL_CHECKS", "OpCall", "OpFacts", "RULES", "local_check", "lookup", "op_call",
           "register_facts", "register_rule", "rule_strategies"]
