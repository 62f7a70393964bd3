"""Memory levers: the decisions besides placements that decide whether a training step fits.

A plan chooses, next to one strategy per op:

- ``accumulation``: the global batch runs as ``k`` sequential microsteps (each ``batch / k``); gradients
  are synchronized once per step, overlapped with the last microstep's backward.
- per repeated-block type (``"model.layers.#"``, the block path with its index folded), a ``BlockPolicy``:
  ``checkpoint`` ("none" keeps what autograd saves; "selective" keeps only matmul and attention
  outputs and recomputes the ops between them; "selective_op" is torchtitan's op-level policy, which
  keeps attention outputs and every other matmul output (the 1st, 3rd, ... of the block) and recomputes
  the rest, the matmuls between included; "full" keeps only the block's inputs and re-runs the
  block before its backward) and ``reshard_after_forward`` (a sharded parameter's gathered copy is
  freed after its forward use and gathered again for backward, ZeRO-3; otherwise it is kept).
- ``mixed_precision``: FSDP2-style ``MixedPrecision(param_dtype, reduce_dtype)``: parameters are kept
  (and updated by the optimizer) in their own dtype, computed with in ``param_dtype``, and gradients are
  reduced in ``reduce_dtype``.

Plain data; JSON through ``to_json``/``from_json`` (dtypes by name), never pickle.

``LEVERS`` is the one table of the levers: each row (``Lever``) names its ``plan``/``compile`` keyword,
its JSON key, whether it is chosen per block type, what values it takes, their check, its default
(the value when it is not pulled) and whether the planner chooses it, and its hooks: the values the
planner tries (``choices``), what the block's other levers force on it (``forced_by``), its price
(``price``) and the modules that give it its effect. The front door takes its lever keywords from the
table, every value check (keyword, ``LeverPins``, ``BlockPolicy``, ``Levers``) is the table's
``check_lever``, ``BlockPolicy`` / ``Levers`` hold and write its values, and the block policy space
(``block_policies``), the pins (``passes.solve.lever_pins``) and the summary are generated from it.

>>> Levers(accumulation=2, blocks={"blocks.#": BlockPolicy("full")}).to_json()["blocks"]
{'blocks.#': {'checkpoint': 'full', 'reshard_after_forward': False}}
"""
from __future__ import annotations

import re
from dataclasses import FrozenInstanceError, dataclass, field
from typing import Any, Callable, Optional

from autoshard.passes.errors import AutoshardError, OptionError, PlanFormatError

__all__ = ["row_values", "CHECKPOINT_POLICIES", "PINNED_ONLY_CHECKPOINTS", "BlockPolicy", "MixedPrecision", "Levers", "block_type", "Lever", "LEVERS",
           "LEVER_KEYWORDS", "lever", "block_levers", "block_policies", "check_lever", "chosen_keywords", "lever_rows",
           "lever_keywords"]

CHECKPOINT_POLICIES = ("none", "selective", "full", "selective_op")
#: checkpoint values in the block policy space that the planner takes only where they are pinned (a
#: layout names torchtitan's op-level policy; the planner's own choice stays keep / reshard / selective / full)
PINNED_ONLY_CHECKPOINTS = ("selective_op",)
_DTYPES = ("float32", "bfloat16", "float16", "float64")


def block_type(block_instance: str) -> str:
    """``"model.layers.11"`` -> ``"model.layers.#"``: the key block policies are stored under."""
    return re.sub(r"\.\d+(?=\.|$)", ".#", block_instance)


class BlockPolicy:
    """What one repeated-block type keeps for backward: one value per per-block row of ``LEVERS``
    (``checkpoint``, ``reshard_after_forward``, ...), given in the table's order or by keyword; a row
    not given takes its default. Frozen, compared and hashed by its values; a row's value is its
    attribute (``policy.checkpoint``). See the module docstring."""
    __slots__ = ("_values",)

    def __init__(self, *args, **kwargs):
        rows = block_levers()
        values = row_values("BlockPolicy", "its levers are", rows, args, kwargs)
        for row in rows:
            check_lever(row.keyword, values.setdefault(row.keyword, row.default), per_block=False)
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name: str):
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        for row in block_levers():  # a row added after this policy was made: not pulled here
            if row.keyword == name:
                return row.default
        raise AttributeError(f"BlockPolicy has no lever {name!r}")

    def __setattr__(self, name, value):
        raise FrozenInstanceError(f"BlockPolicy is frozen: use .replace({name}=...)")

    def __reduce__(self):  # copies and pickles through the constructor, which checks the values
        return (_block_policy, (tuple(object.__getattribute__(self, "_values").items()),))

    def replace(self, **changes) -> "BlockPolicy":
        """A copy with the levers in ``changes`` set."""
        return BlockPolicy(**{**{r.keyword: getattr(self, r.keyword) for r in block_levers()}, **changes})

    def _key(self) -> tuple:
        return tuple(getattr(self, r.keyword) for r in block_levers())

    def __eq__(self, other) -> bool:
        return isinstance(other, BlockPolicy) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        return "BlockPolicy(" + ", ".join(f"{r.keyword}={getattr(self, r.keyword)!r}" for r in block_levers()) + ")"

    def describe(self) -> str:
        """The policy as the summary and the planner's messages say it: ``"checkpoint full, reshard after
        forward True"`` (every per-block row by its label)."""
        return ", ".join(f"{r.label} {getattr(self, r.keyword)}" for r in block_levers())

    def as_keywords(self) -> str:
        """The policy as ``plan`` keywords would give it: ``"checkpoint=full, reshard_after_forward=True"``."""
        return ", ".join(f"{r.keyword}={getattr(self, r.keyword)}" for r in block_levers())

    def to_json(self) -> dict:
        return {row.json_key: row.to_json(getattr(self, row.keyword)) for row in block_levers()}

    @classmethod
    def from_json(cls, d: dict) -> "BlockPolicy":
        return cls(**{row.keyword: row.from_json(d.get(row.json_key, row.default)) for row in block_levers()})


def _block_policy(items: tuple) -> BlockPolicy:
    return BlockPolicy(**dict(items))


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
    stored by name (``param_dtype_name``); ``param_dtype`` gives the torch dtype.

    ``accumulate_in_reduce_dtype``: gradients are also accumulated over microbatches and held until
    the optimizer step in ``reduce_dtype`` (Megatron-LM's fp32 main gradients,
    ``--accumulate-allreduce-grads-in-fp32``: each microbatch's gradient is added into a
    ``reduce_dtype`` buffer, which is what the all-reduce reduces), not in the parameters' dtype. The
    planner prices it (``passes.cost.model.CostModel.grad_dtype``); the runtime does not run it
    (``autoshard.compile`` refuses such a plan)."""
    param_dtype_name: Optional[str]
    reduce_dtype_name: Optional[str]
    accumulate_in_reduce_dtype: bool = False

    def __init__(self, param_dtype=None, reduce_dtype=None, accumulate_in_reduce_dtype: bool = False):
        object.__setattr__(self, "param_dtype_name", _dtype_name(param_dtype))
        object.__setattr__(self, "reduce_dtype_name", _dtype_name(reduce_dtype))
        if not isinstance(accumulate_in_reduce_dtype, bool):
            raise AutoshardError(f"accumulate_in_reduce_dtype takes True/False, got {accumulate_in_reduce_dtype!r}")
        if accumulate_in_reduce_dtype and self.reduce_dtype_name is None:
            raise AutoshardError("accumulate_in_reduce_dtype=True accumulates gradients in reduce_dtype: give "
                                 "reduce_dtype= (e.g. torch.float32, Megatron-LM's fp32 main gradients)")
        object.__setattr__(self, "accumulate_in_reduce_dtype", accumulate_in_reduce_dtype)

    @property
    def param_dtype(self):
        import torch
        return None if self.param_dtype_name is None else getattr(torch, self.param_dtype_name)

    @property
    def reduce_dtype(self):
        import torch
        return None if self.reduce_dtype_name is None else getattr(torch, self.reduce_dtype_name)

    def to_json(self) -> dict:
        out = {"param_dtype": self.param_dtype_name, "reduce_dtype": self.reduce_dtype_name}
        if self.accumulate_in_reduce_dtype:  # written only when set: plans made without it read as before
            out["accumulate_in_reduce_dtype"] = True
        return out

    @classmethod
    def from_json(cls, d: dict) -> "MixedPrecision":
        return cls(d.get("param_dtype"), d.get("reduce_dtype"), bool(d.get("accumulate_in_reduce_dtype", False)))

    def __repr__(self) -> str:
        extra = ", accumulate_in_reduce_dtype=True" if self.accumulate_in_reduce_dtype else ""
        return f"MixedPrecision(param_dtype={self.param_dtype_name}, reduce_dtype={self.reduce_dtype_name}{extra})"


@dataclass
class Levers:
    """The plan's memory levers (defaults: none pulled). ``blocks`` maps a block type (see
    ``block_type``) to its policy; a block type not listed keeps everything (``BlockPolicy()``)."""
    accumulation: int = 1
    blocks: dict[str, BlockPolicy] = field(default_factory=dict)
    mixed_precision: Optional[MixedPrecision] = None

    def __post_init__(self):
        check_lever("accumulation", self.accumulation)

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
        out = {row.json_key: row.to_json(getattr(self, row.keyword)) for row in LEVERS if not row.per_block}
        out["blocks"] = {k: p.to_json() for k, p in sorted(self.blocks.items())}
        return out

    @classmethod
    def from_json(cls, d: Optional[dict]) -> "Levers":
        if not d:
            return cls()
        try:
            step = {row.keyword: row.from_json(d.get(row.json_key, row.default)) for row in LEVERS if not row.per_block}
            return cls(blocks={str(k): BlockPolicy.from_json(v) for k, v in (d.get("blocks") or {}).items()}, **step)
        except (TypeError, ValueError, AttributeError, AutoshardError) as e:
            raise PlanFormatError(f"malformed levers JSON ({type(e).__name__}: {e})") from e


# ---- the lever table --------------------------------------------------------------------------------

def _same(value):
    return value


@dataclass(frozen=True)
class Lever:
    """One memory lever (a row of ``LEVERS``).

    ``keyword``: the ``plan``/``compile`` keyword, and the attribute of ``Levers`` (or ``BlockPolicy``
    when ``per_block``) and of ``passes.solve.lever_pins.LeverPins`` that holds it. ``json_key``: its key
    in the plan's JSON (inside each block policy when ``per_block``). ``per_block``: chosen per
    repeated-block type (the keyword also takes a dict by block type). ``allowed``: the values it takes,
    as errors say it. ``problem(value)``: None for a good single value, else what is wrong with it.
    ``default``: its value when not pulled (``LeverPins.off()`` pins it there). ``chosen``: the planner
    chooses it when the keyword is not given (False: given or off). ``to_json``/``from_json``: its value to
    and from JSON data.

    Its hooks, which generate the rest (as a ``Lowering`` descriptor's do): ``choices``, for a per-block
    lever, the values the planner tries, fastest first: the block policy space (``block_policies``) is
    their product in table order. ``forced_by(values) -> value | None``: the value the block's other
    levers (``{keyword: value}``, those known) force on this one, None where they leave it free; a
    forced value is never pinned and a pin against it is refused, saying ``forced_why``. ``label``: how
    the summary names it. ``price(value, item, hardware)``: for a per-block lever, its price beside its
    row: adjusts in place the ``LeverPrice`` (``seconds``; bytes per device ``kept``, ``gathered``,
    ``recompute``, ``gathered_transient``) of every op and operand read of a block whose policy pulls it
    (value not the default), after the block's other levers priced it (``passes/solve/lever_costs.py``
    calls it; it reaches the ILP, the exact memory walk and the plan's estimates alike); None: the
    lever is priced by the modules ``effects`` names. ``effects``: the modules that give it its price
    and its runtime effect (``tests/frontdoor/test_lever_table.py`` checks each names the keyword)."""
    keyword: str
    json_key: str
    per_block: bool
    allowed: str
    problem: Callable[[Any], Optional[str]]
    default: Any
    chosen: bool = True
    to_json: Callable[[Any], Any] = _same
    from_json: Callable[[Any], Any] = _same
    choices: tuple = ()
    forced_by: Optional[Callable[[dict], Any]] = None
    forced_why: str = ""
    label: str = ""
    price: Optional[Callable[[Any, Any, Any], None]] = None
    effects: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.label:
            object.__setattr__(self, "label", self.keyword.replace("_", " "))


def _accumulation_problem(k) -> Optional[str]:
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        return (f"accumulation={k!r}: pass an int >= 1 (the number of sequential microsteps the global batch is cut "
                "into), or leave it out to let the planner choose")
    return None


def _checkpoint_problem(policy) -> Optional[str]:
    if policy not in CHECKPOINT_POLICIES:
        return (f"checkpoint={policy!r}: choose one of {list(CHECKPOINT_POLICIES)} (for every block type, or each "
                "value of a dict by block type: checkpoint={'model.layers.#': 'full'})")
    return None


def _reshard_problem(flag) -> Optional[str]:
    if not isinstance(flag, bool):
        return (f"reshard_after_forward= takes True/False (or a dict of them by block type, e.g. "
                f"{{'model.layers.#': False}}), got {flag!r}")
    return None


def _mixed_precision_problem(mp) -> Optional[str]:
    if not isinstance(mp, MixedPrecision):
        return ("mixed_precision= takes autoshard.MixedPrecision(param_dtype=..., reduce_dtype=...), got "
                f"{type(mp).__name__}")
    return None


def _recompute_regathers(values: dict):
    """A recomputing block gathers its sharded parameters again for the backward: reshard forced True."""
    return True if values.get("checkpoint", "none") != "none" else None


def _mixed_precision_json(mp):
    return None if mp is None else mp.to_json()


def _mixed_precision_from_json(d):
    return None if d is None else MixedPrecision.from_json(d)


#: every memory lever, in the order the summary and the JSON list them
LEVERS: tuple[Lever, ...] = (
    Lever("accumulation", "accumulation", False, "an int k >= 1: the global batch runs as k sequential microsteps",
          _accumulation_problem, 1, from_json=int,
          effects=("passes/solve/lever_search.py", "runtime/executor.py")),
    Lever("checkpoint", "checkpoint", True, f"one of {list(CHECKPOINT_POLICIES)} per repeated-block type",
          _checkpoint_problem, "none", from_json=str, choices=CHECKPOINT_POLICIES,
          effects=("passes/solve/lever_costs.py", "runtime/lower.py")),
    Lever("reshard_after_forward", "reshard_after_forward", True,
          "True/False per repeated-block type: free gathered parameters after forward", _reshard_problem, False,
          from_json=bool, choices=(False, True), forced_by=_recompute_regathers,
          forced_why="a recomputing block gathers its sharded parameters again for the backward; leave "
                     "reshard_after_forward out for it (or pass True)",
          effects=("passes/solve/lever_costs.py", "runtime/lower.py")),
    Lever("mixed_precision", "mixed_precision", False, "autoshard.MixedPrecision(param_dtype, reduce_dtype)",
          _mixed_precision_problem, None, chosen=False, to_json=_mixed_precision_json,
          from_json=_mixed_precision_from_json, effects=("passes/solve/lever_search.py", "runtime/lower.py")),
)
LEVER_KEYWORDS: tuple[str, ...] = tuple(row.keyword for row in LEVERS)


def lever_rows() -> tuple[Lever, ...]:
    """``LEVERS`` as it stands when called: readers outside this module go through it (or
    ``block_levers``), so a row added to the table (a test's) reaches every one of them."""
    return LEVERS


def lever_keywords() -> tuple[str, ...]:
    """The keyword of every row of ``lever_rows()``."""
    return tuple(row.keyword for row in LEVERS)


def lever(keyword: str) -> Lever:
    """The row of ``LEVERS`` for ``keyword``."""
    for row in LEVERS:
        if row.keyword == keyword:
            return row
    raise KeyError(f"no memory lever {keyword!r}; levers are {list(lever_keywords())}")


def block_levers() -> tuple[Lever, ...]:
    """The levers chosen per repeated-block type (``BlockPolicy``'s fields)."""
    return tuple(row for row in LEVERS if row.per_block)


def chosen_keywords() -> tuple[str, ...]:
    """The keywords of the levers the planner chooses when they are not given."""
    return tuple(row.keyword for row in LEVERS if row.chosen)


def block_policies() -> tuple[BlockPolicy, ...]:
    """The policy space of a repeated-block type, fastest first: the product of the per-block rows'
    ``choices`` (in table order, the first row outermost) without the combinations a row's ``forced_by``
    rules out. With the built-in rows: keep, reshard, selective (re-gathering), full (re-gathering)."""
    rows = block_levers()
    found = [{}]
    for row in rows:
        found = [{**values, row.keyword: c} for values in found for c in (row.choices or (row.default,))]
    return tuple(BlockPolicy(**values) for values in found if all(
        row.forced_by is None or row.forced_by({k: v for k, v in values.items() if k != row.keyword})
        in (None, values[row.keyword]) for row in rows))


def check_lever(keyword: str, value, *, per_block: Optional[bool] = None) -> None:
    """Refuse a bad value of lever ``keyword`` (None, "not given", passes): ``OptionError`` (a
    ``TypeError`` and an ``AutoshardError``) saying what the lever takes. A per-block lever also takes a
    dict by block type (each value checked) unless ``per_block=False``; block-type keys are checked
    against a model where one is traced (``autoshard.lever_args``)."""
    row = lever(keyword)
    if value is None:
        return
    by_block = row.per_block if per_block is None else per_block
    values = list(value.values()) if by_block and isinstance(value, dict) else [value]
    for v in values:
        why = row.problem(v)
        if why:
            raise OptionError(why)


def row_values(owner: str, listed: str, rows, args: tuple, kwargs: dict) -> dict:
    """``owner(*args, **kwargs)``'s values by lever keyword, positional ones in ``rows``' order; TypeError
    for too many, unknown or repeated values (``listed`` introduces the keywords in the message)."""
    if len(args) > len(rows):
        raise TypeError(f"{owner}() takes at most {len(rows)} values ({[r.keyword for r in rows]})")
    values = {row.keyword: v for row, v in zip(rows, args)}
    for key, value in kwargs.items():
        if key in values or key not in {r.keyword for r in rows}:
            raise TypeError(f"{owner}() got an unexpected or repeated value {key!r}; {listed} "
                            f"{[r.keyword for r in rows]}")
        values[key] = value
    return values
