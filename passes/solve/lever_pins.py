"""The user's say over the memory levers: which the planner chooses and which are fixed.

>>> LeverPins(checkpoint={"model.layers.#": "full"}).policies(["model.layers.#"])
{'model.layers.#': [3]}
>>> LeverPins(reshard_after_forward=True).policies(["blocks.#"])
{'blocks.#': [1, 2, 3]}

- ``accumulation``: an int k (the global batch runs as k microsteps), or None: the planner picks
  among the divisors of the batch.
- ``checkpoint``: "none" | "selective" | "full" | "selective_op" (torchtitan's op-level policy,
  never chosen unless pinned) for every block type, a dict from block type (or an
  fnmatch pattern over block types, ``"model.layers.*"``) to one of those, or None: chosen per type.
- ``reshard_after_forward``: True / False for every block type, a dict as above, or None: chosen.
  A recomputing block gathers its sharded parameters again whatever is kept: False given per block
  type where the checkpoint is "selective" or "full" is an error; one False for every type applies
  to the types whose checkpoint is not pinned to recompute.
- ``mixed_precision``: a ``passes.levers.MixedPrecision`` (given, never chosen) or None.

``LeverPins.off()`` fixes every lever at "not pulled" (the planner then plans as it did before levers
existed; the pipeline planner's stages use it).

Everything here is generated from the rows of ``passes.levers.LEVERS``: the pins' values (one per
row, by keyword), "off" (each chosen row's default), the block policy space and which of its
policies a pin allows (``passes.levers.block_policies``, a row's ``forced_by``).
"""
from __future__ import annotations

import fnmatch

from autoshard.passes.errors import AutoshardError
from autoshard.passes.levers import (PINNED_ONLY_CHECKPOINTS, block_levers, block_policies, check_lever, lever_rows,
                                     row_values)

__all__ = ["LeverPins"]


class LeverPins:
    """See the module docstring. One value per row of ``passes.levers.LEVERS``, given in the table's order
    or by its keyword, read as an attribute (``pins.checkpoint``); None (the default): the planner chooses
    that lever (or, for one it never chooses, it is off)."""

    def __init__(self, *args, **kwargs):
        rows = lever_rows()
        values = row_values("LeverPins", "the levers are", rows, args, kwargs)
        for row in rows:  # one check per lever, the table's (``passes.levers.check_lever``)
            check_lever(row.keyword, values.get(row.keyword))
        self._values = values

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if any(row.keyword == name for row in lever_rows()):
            return self._values.get(name)
        raise AttributeError(f"LeverPins has no lever {name!r}")

    def __eq__(self, other) -> bool:
        return isinstance(other, LeverPins) and all(getattr(self, r.keyword) == getattr(other, r.keyword)
                                                    for r in lever_rows())

    def __repr__(self) -> str:
        return "LeverPins(" + ", ".join(f"{r.keyword}={getattr(self, r.keyword)!r}" for r in lever_rows()) + ")"

    @classmethod
    def off(cls, **given) -> "LeverPins":
        """Every lever the planner chooses fixed at its default, "not pulled"; the others as ``given``
        (``LeverPins.off(mixed_precision=...)``)."""
        return cls(**{row.keyword: row.default for row in lever_rows() if row.chosen}, **given)

    @property
    def chooses_nothing(self) -> bool:
        """No lever is left to the planner and none is pulled."""
        return all(getattr(self, row.keyword) == row.default for row in lever_rows() if row.chosen)

    def policies(self, block_types: list[str]) -> dict[str, list[int]]:
        """Block type -> the allowed indices into the block policy space (``passes.levers.block_policies``,
        fastest first). Raises ``AutoshardError`` for a key matching no block type or pins that exclude
        every policy."""
        rows = block_levers()
        pinned = {row.keyword: _per_type(getattr(self, row.keyword), block_types, row.keyword) for row in rows}
        for row in rows:
            if row.forced_by is not None and not isinstance(getattr(self, row.keyword), dict):
                # one value for every type: where the other pins force this lever, the force wins
                pinned[row.keyword] = {t: v for t, v in pinned[row.keyword].items()
                                       if row.forced_by(_others(pinned, t, row.keyword)) is None}
        space = block_policies()
        found = {}
        for t in block_types:
            allowed = [i for i, p in enumerate(space)
                       if (p.checkpoint not in PINNED_ONLY_CHECKPOINTS or pinned["checkpoint"].get(t) == p.checkpoint)
                       and all(pinned[r.keyword].get(t, getattr(p, r.keyword)) == getattr(p, r.keyword) for r in rows)]
            if not allowed:
                raise AutoshardError(_excluded(t, pinned))
            found[t] = allowed
        return found

    def accumulations(self, divisors: list[int], batch: int) -> list[int]:
        """The microstep counts to try: the pinned one (which must divide ``batch``), else ``divisors``."""
        if self.accumulation is None:
            return list(divisors)
        if batch % self.accumulation:
            raise AutoshardError(f"accumulation={self.accumulation} does not divide the global batch of {batch}: "
                                 f"pass one of {divisors}")
        return [self.accumulation]


def _others(pinned: dict, t: str, keyword: str) -> dict:
    """The values pinned for block type ``t`` on every per-block lever but ``keyword``."""
    return {k: p[t] for k, p in pinned.items() if k != keyword and t in p}


def _excluded(t: str, pinned: dict) -> str:
    """Why the pins of block type ``t`` leave it no policy: the lever they force against its own pin."""
    for row in block_levers():
        others = _others(pinned, t, row.keyword)
        forced = row.forced_by(others) if row.forced_by is not None else None
        if forced is not None and t in pinned[row.keyword] and pinned[row.keyword][t] != forced:
            given = ", ".join(f"{k}={v!r}" for k, v in others.items())
            return f"block type {t!r}: {given} with {row.keyword}={pinned[row.keyword][t]!r} cannot hold: {row.forced_why}"
    return f"block type {t!r}: the pins {({k: p[t] for k, p in pinned.items() if t in p})} allow no block policy"


def _per_type(pin, block_types: list[str], what: str) -> dict:
    """A pin as block type -> value (types it leaves free are absent)."""
    if pin is None:
        return {}
    if not isinstance(pin, dict):
        return {t: pin for t in block_types}
    found: dict = {}
    for key, value in pin.items():
        hits = [t for t in block_types if t == key or fnmatch.fnmatchcase(t, str(key))]
        if not hits:
            raise AutoshardError(f"{what}={{{key!r}: ...}} matches no repeated-block type; this model's block "
                                 f"types are {block_types or 'none (no numbered blocks)'}")
        for t in hits:
            if found.get(t, value) != value:
                raise AutoshardError(f"{what}: two keys give block type {t!r} different values")
            found[t] = value
    return found
