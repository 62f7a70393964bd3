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
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Optional, Union

from autoshard.passes.errors import AutoshardError
from autoshard.passes.levers import LEVERS, MixedPrecision, check_lever
from autoshard.passes.solve.lever_costs import PINNED_ONLY, POLICIES

__all__ = ["LeverPins"]


@dataclass
class LeverPins:
    """See the module docstring. None everywhere: the planner chooses every lever. One field per row of
    ``passes.levers.LEVERS``, named by its keyword."""
    accumulation: Optional[int] = None
    checkpoint: Union[None, str, dict] = None
    reshard_after_forward: Union[None, bool, dict] = None
    mixed_precision: Optional[MixedPrecision] = None

    def __post_init__(self):
        for row in LEVERS:  # one check per lever, the table's (``passes.levers.check_lever``)
            check_lever(row.keyword, getattr(self, row.keyword))

    @classmethod
    def off(cls, mixed_precision: Optional[MixedPrecision] = None) -> "LeverPins":
        """Every lever fixed at "not pulled" (mixed precision as given)."""
        return cls(1, "none", False, mixed_precision)

    @property
    def chooses_nothing(self) -> bool:
        """No lever is left to the planner and none is pulled."""
        return self.accumulation == 1 and self.checkpoint == "none" and self.reshard_after_forward is False

    def policies(self, block_types: list[str]) -> dict[str, list[int]]:
        """Block type -> the allowed indices into ``lever_costs.POLICIES`` (fastest first). Raises
        ``AutoshardError`` for a key matching no block type or pins that exclude every policy."""
        checkpoint = _per_type(self.checkpoint, block_types, "checkpoint")
        reshard = _per_type(self.reshard_after_forward, block_types, "reshard_after_forward")
        if not isinstance(self.reshard_after_forward, dict):
            # one value for every type: where the checkpoint is pinned to recompute, gathering again is implied
            reshard = {t: v for t, v in reshard.items() if checkpoint.get(t) in (None, "none")}
        found = {}
        for t in block_types:
            allowed = [i for i, p in enumerate(POLICIES)
                       if (i not in PINNED_ONLY or t in checkpoint)
                       and checkpoint.get(t, p.checkpoint) == p.checkpoint
                       and reshard.get(t, p.reshard_after_forward) == p.reshard_after_forward]
            if not allowed:
                raise AutoshardError(
                    f"block type {t!r}: checkpoint={checkpoint[t]!r} with reshard_after_forward=False cannot hold: a "
                    "recomputing block gathers its sharded parameters again for the backward; leave "
                    "reshard_after_forward out for it (or pass True)")
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
