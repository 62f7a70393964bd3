"""Memory levers: the decisions besides placements that decide whether a training step fits.

A plan chooses, next to one strategy per op:

- ``accumulation``: the global batch runs as ``k`` sequential microsteps (each ``batch / k``); gradients
  are synchronized once per step, overlapped with the last microstep's backward.
- per repeated-block type (``"model.layers.#"``, the block path with its index folded), a ``BlockPolicy``:
  ``checkpoint`` ("none" keeps what autograd saves; "selective" keeps only matmul and attention
  outputs and recomputes the ops between them; "full" keeps only the block's inputs and re-runs the
  block before its backward) and ``reshard_after_forward`` (a sharded parameter's gathered copy is
  freed after its forward use and gathered again for backward, ZeRO-3; otherwise it is kept).
- ``mixed_precision``: FSDP2-style ``MixedPrecision(param_dtype, reduce_dtype)``: parameters are kept
  (and updated by the optimizer) in their own dtype, computed with in ``param_dtype``, and gradients are
  reduced in ``reduce_dtype``.

Plain data; JSON through ``to_json``/``from_json`` (dtypes by name), never pickle.

>>> Levers(accumulation=2, blocks={"blocks.#": BlockPolicy("full")}).to_json()["blocks"]
{'blocks.#': {'checkpoint': 'full', 'reshard_after_forward': False}}
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from autoshard.passes.errors import AutoshardError, PlanFormatError

__all__ = ["CHECKPOINT_POLICIES", "BlockPolicy", "MixedPrecision", "Levers", "block_type"]

CHECKPOINT_POLICIES = ("none", "selective", "full")
_DTYPES = ("float32", "bfloat16", "float16", "float64")


def block_type(block_instance: str) -> str:
    """``"model.layers.11"`` -> ``"model.layers.#"``: the key block policies are stored under."""
    return re.sub(r"\.\d+(?=\.|$)", ".#", block_instance)


@dataclass(frozen=True)
class BlockPolicy:
    """What one repeated-block type keeps for backward. See the module docstring."""
    checkpoint: str = "none"
    reshard_after_forward: bool = False

    def __post_init__(self):
        if self.checkpoint not in CHECKPOINT_POLICIES:
            raise AutoshardError(f"checkpoint={self.checkpoint!r}: choose one of {list(CHECKPOINT_POLICIES)}")

    def to_json(self) -> dict:
        return {"checkpoint": self.checkpoint, "reshard_after_forward": bool(self.reshard_after_forward)}

    @classmethod
    def from_json(cls, d: dict) -> "BlockPolicy":
        return cls(str(d.get("checkpoint", "none")), bool(d.get("reshard_after_forward", False)))


def _dtype_name(dtype) -> Optional[str]:
    """A dtype given as ``torch.bfloat16`` or ``"bfloat16"`` -> its name; refuses what is not supported."""
    if dtype is None:
        return None
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPES:
        raise AutoshardError(f"mixed precision dtype {dtype!r} is not supported: use one of "
                             f"{['torch.' + d for d in _DTYPES]} (or None to keep the parameters' own dtype)")
    return name


@dataclass(frozen=True, init=False)
class MixedPrecision:
    """``MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``, as FSDP2's
    ``MixedPrecisionPolicy``: compute copies of floating parameters in ``param_dtype`` (None: the
    parameter's own dtype), gradients reduced across ranks in ``reduce_dtype`` (None: the compute
    dtype). The parameters themselves (the optimizer's master weights) keep their dtype. Dtypes are
    stored by name (``param_dtype_name``); ``param_dtype`` gives the torch dtype."""
    param_dtype_name: Optional[str]
    reduce_dtype_name: Optional[str]

    def __init__(self, param_dtype=None, reduce_dtype=None):
        object.__setattr__(self, "param_dtype_name", _dtype_name(param_dtype))
        object.__setattr__(self, "reduce_dtype_name", _dtype_name(reduce_dtype))

    @property
    def param_dtype(self):
        import torch
        return None if self.param_dtype_name is None else getattr(torch, self.param_dtype_name)

    @property
    def reduce_dtype(self):
        import torch
        return None if self.reduce_dtype_name is None else getattr(torch, self.reduce_dtype_name)

    def to_json(self) -> dict:
        return {"param_dtype": self.param_dtype_name, "reduce_dtype": self.reduce_dtype_name}

    @classmethod
    def from_json(cls, d: dict) -> "MixedPrecision":
        return cls(d.get("param_dtype"), d.get("reduce_dtype"))

    def __repr__(self) -> str:
        return f"MixedPrecision(param_dtype={self.param_dtype_name}, reduce_dtype={self.reduce_dtype_name})"


@dataclass
class Levers:
    """The plan's memory levers (defaults: none pulled). ``blocks`` maps a block type (see
    ``block_type``) to its policy; a block type not listed keeps everything (``BlockPolicy()``)."""
    accumulation: int = 1
    blocks: dict[str, BlockPolicy] = field(default_factory=dict)
    mixed_precision: Optional[MixedPrecision] = None

    def __post_init__(self):
        if isinstance(self.accumulation, bool) or not isinstance(self.accumulation, int) or self.accumulation < 1:
            raise AutoshardError(f"accumulation={self.accumulation!r}: pass an int >= 1 (the number of "
                                 "sequential microsteps the global batch is cut into)")

    def policy(self, block_instance: Optional[str]) -> BlockPolicy:
        """The policy of one block instance (``"blocks.3"``), or of ops outside blocks (None)."""
        if block_instance is None:
            return BlockPolicy()
        return self.blocks.get(block_type(block_instance), BlockPolicy())

    @property
    def any_pulled(self) -> bool:
        return (self.accumulation > 1 or self.mixed_precision is not None
                or any(p != BlockPolicy() for p in self.blocks.values()))

    def to_json(self) -> dict:
        return {"accumulation": self.accumulation,
                "blocks": {k: p.to_json() for k, p in sorted(self.blocks.items())},
                "mixed_precision": None if self.mixed_precision is None else self.mixed_precision.to_json()}

    @classmethod
    def from_json(cls, d: Optional[dict]) -> "Levers":
        if not d:
            return cls()
        try:
            mp = d.get("mixed_precision")
            return cls(int(d.get("accumulation", 1)),
                       {str(k): BlockPolicy.from_json(v) for k, v in (d.get("blocks") or {}).items()},
                       None if mp is None else MixedPrecision.from_json(mp))
        except (TypeError, ValueError, AttributeError, AutoshardError) as e:
            raise PlanFormatError(f"malformed levers JSON ({type(e).__name__}: {e})") from e
