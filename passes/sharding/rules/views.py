"""Sharding rules for shape ops: view/reshape, transposes, (un)squeeze, expand, split, cat, slicing.

Every rule here maps a split input dim to the output dim it becomes, and refuses the dims the
op mixes across ranks. Views, transposes, splits and cats of a partial tensor stay partial
(they are linear and move elements without combining them).

view/reshape: input and output shapes are cut into *groups*, the smallest runs of dims with equal
products (size-1 dims ignored): ``(4, 6, 8) -> (24, 8)`` has groups ``[0, 1] -> [0]`` and
``[2] -> [1]``. A group's elements are contiguous in row-major order, so splitting its FIRST input
dim into n blocks splits the group's flat range into n contiguous blocks, which are exactly the
blocks of its FIRST output dim. Any other input dim of a group would interleave.

>>> # view (4, 6, 8) -> (24, 8):     S(0) -> S(0);  S(2) -> S(1);  S(1) not allowed
>>> # view (24, 8) -> (4, 6, 8):     S(0) -> S(0) (needs 4 % n == 0, checked later);  S(1) -> S(2)

The runtime rewrites view/reshape/_unsafe_view/expand sizes to the local sizes (the global output
shape with each split dim divided), so the local op reads ``view(local, local_sizes)``.
``unflatten`` sizes are not rewritten, so the unflattened dim may be split only when its first
size is ``-1``. ``squeeze()`` with no dims may drop a dim that becomes size 1 locally, so it only
takes ``P``; ``squeeze(d)`` never splits the named dims for the same reason.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch

from autoshard.passes.spec import Partial, Replicate, Shard, Strategy1D
from autoshard.passes.sharding.rules.common import broadcast_placement, norm_dim, norm_dims, split_dims
from autoshard.passes.sharding.rules.registry import OpCall, register_rule

aten = torch.ops.aten
R, P = Replicate(), Partial()

__all__ = [
    "view_groups", "reshape_rule", "view_as_rule", "permute_rule", "unsqueeze_rule", "squeeze_rule",
    "expand_rule", "split_rule", "cat_rule", "stack_rule", "slice_rule", "index_select_rule",
    "repeat_rule", "repeat_interleave_rule", "flip_roll_rule", "pad_rule",
]

_PARTIAL = Strategy1D((P,), (P,))


def view_groups(in_shape: Sequence[int], out_shape: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Groups of input dims and output dims with equal products, size-1 dims left out.

    >>> view_groups((4, 6, 8), (24, 8))
    [([0, 1], [0]), ([2], [1])]
    >>> view_groups((4, 16, 32), (4, 16, 4, 8))
    [([0], [0]), ([1], [1]), ([2], [2, 3])]
    """
    if math.prod(in_shape) != math.prod(out_shape) or math.prod(in_shape) == 0:
        return []
    ins = [d for d, s in enumerate(in_shape) if s != 1]
    outs = [d for d, s in enumerate(out_shape) if s != 1]
    groups: list[tuple[list[int], list[int]]] = []
    a = b = 0
    while a < len(ins) and b < len(outs):
        gi, go = [ins[a]], [outs[b]]
        pi, po = in_shape[ins[a]], out_shape[outs[b]]
        a, b = a + 1, b + 1
        while pi != po:
            if pi < po:
                gi.append(ins[a])
                pi *= in_shape[ins[a]]
                a += 1
            else:
                go.append(outs[b])
                po *= out_shape[outs[b]]
                b += 1
        groups.append((gi, go))
    return groups


def _view_pairs(in_shape, out_shape) -> list[tuple[int, int]]:
    """(input dim, output dim) pairs that may carry a split: the first dims of each group."""
    return [(gi[0], go[0]) for gi, go in view_groups(in_shape, out_shape)]


@register_rule(aten.view.default, aten.reshape.default, aten._unsafe_view.default, aten.flatten.using_ints,
               aten.unflatten.int, float_partials_only=True)
def reshape_rule(call: OpCall) -> list[Strategy1D]:
    x, out = call.inputs[0], call.outputs[0]
    pairs = _view_pairs(x.shape, out.shape)
    if call.target == aten.unflatten.int:
        args = call.bound_args
        dim = norm_dim(int(args["dim"]), len(x.shape))
        first = next((int(s) for s in args["sizes"] if int(s) != 1), None)
        if first != -1:
            pairs = [(i, o) for i, o in pairs if i != dim]
    return [Strategy1D((Shard(i),), (Shard(o),)) for i, o in pairs] + [_PARTIAL]


@register_rule(aten.view_as.default, aten.reshape_as.default, float_partials_only=True)
def view_as_rule(call: OpCall) -> list[Strategy1D]:
    """``view_as(self, other)``: ``other`` only lends its (local) shape, so it is split like the output."""
    x, out = call.inputs[0], call.outputs[0]
    found = [Strategy1D((Shard(i), Shard(o)), (Shard(o),)) for i, o in _view_pairs(x.shape, out.shape)]
    return found + [Strategy1D((P, R), (P,)), Strategy1D((P, P), (P,))]


def _permutation(call: OpCall) -> list[int]:
    """``perm`` with output dim ``i`` = input dim ``perm[i]``."""
    args = call.bound_args
    n = len(call.inputs[0].shape)
    perm = list(range(n))
    name = call.op_name
    if name in ("transpose", "swapaxes", "swapdims"):
        k0, k1 = ("axis0", "axis1") if name == "swapaxes" else ("dim0", "dim1")
        a, b = norm_dim(int(args[k0]), n), norm_dim(int(args[k1]), n)
        perm[a], perm[b] = perm[b], perm[a]
    elif name == "t" and n == 2:
        perm = [1, 0]
    elif name == "mT":
        perm[-2], perm[-1] = perm[-1], perm[-2]
    elif name == "numpy_T":  # ``x.T``: every dim reversed (Falcon's attention writes it)
        perm = perm[::-1]
    elif name == "permute":
        perm = [norm_dim(int(d), n) for d in args["dims"]]
    elif name == "movedim":
        src, dst = args["source"], args["destination"]
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        perm = [-1] * n
        for s, d in zip(src, dst):
            perm[norm_dim(int(d), n)] = norm_dim(int(s), n)
        moved = {norm_dim(int(s), n) for s in src}
        rest = iter(d for d in range(n) if d not in moved)
        perm = [p if p != -1 else next(rest) for p in perm]
    return perm


@register_rule(aten.transpose.int, aten.t.default, aten.permute.default, aten.movedim, aten.mT.default,
               aten.numpy_T.default, aten.swapaxes.default, aten.swapdims.default, float_partials_only=True)
def permute_rule(call: OpCall) -> list[Strategy1D]:
    x = call.inputs[0]
    perm = _permutation(call)
    found = [Strategy1D((Shard(p),), (Shard(i),)) for i, p in enumerate(perm) if x.shape[p] > 1]
    return found + [_PARTIAL]


@register_rule(aten.unsqueeze.default, float_partials_only=True)
def unsqueeze_rule(call: OpCall) -> list[Strategy1D]:
    x = call.inputs[0]
    dim = norm_dim(int(call.bound_args["dim"]), len(x.shape) + 1)
    found = [Strategy1D((Shard(d),), (Shard(d if d < dim else d + 1),)) for d in split_dims(x.shape)]
    return found + [_PARTIAL]


@register_rule(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, float_partials_only=True)
def squeeze_rule(call: OpCall) -> list[Strategy1D]:
    if call.target == aten.squeeze.default:
        return [_PARTIAL]
    x = call.inputs[0]
    named = set(norm_dims(call.bound_args["dim"], len(x.shape)))
    removed = [d for d in named if x.shape[d] == 1]
    found = []
    for d in split_dims(x.shape):
        if d not in named:
            found.append(Strategy1D((Shard(d),), (Shard(d - sum(1 for r in removed if r < d)),)))
    return found + [_PARTIAL]


@register_rule(aten.expand.default, aten.expand_as.default, float_partials_only=True)
def expand_rule(call: OpCall) -> list[Strategy1D]:
    """A split output dim splits the input there if it has that size, else the input stays whole
    (a size-1 input dim expands to the local size). ``expand_as``'s ``other`` follows the output."""
    x, out = call.inputs[0], call.outputs[0]
    has_other = len(call.inputs) == 2
    found = []
    for d in split_dims(out.shape):
        ins = (broadcast_placement(x, d, len(out.shape)),) + ((Shard(d),) if has_other else ())
        found.append(Strategy1D(ins, (Shard(d),)))
    return found + [Strategy1D((P, R) if has_other else (P,), (P,))]


@register_rule(aten.split.Tensor, aten.split.sizes, aten.split_with_sizes.default, aten.chunk.default,
               aten.unbind.int, aten.tensor_split.sections, aten.tensor_split.indices, float_partials_only=True)
def split_rule(call: OpCall) -> list[Strategy1D]:
    """Dims other than the split dim stay split in every piece (``unbind`` drops its dim)."""
    x = call.inputs[0]
    dim = norm_dim(int(call.bound_args["dim"]), len(x.shape))
    drops = call.target == aten.unbind.int
    n_out = len(call.outputs)
    found = []
    for d in split_dims(x.shape):
        if d != dim:
            od = d - 1 if drops and d > dim else d
            found.append(Strategy1D((Shard(d),), (Shard(od),) * n_out))
    return found + [Strategy1D((P,), (P,) * n_out)]


@register_rule(aten.cat.default, float_partials_only=True)
def cat_rule(call: OpCall) -> list[Strategy1D]:
    ranks = {len(m.shape) for m in call.inputs}
    if len(ranks) != 1:  # legacy cat skipping 1-d empty tensors: keep it simple and replicated
        return []
    out = call.outputs[0]
    dim = norm_dim(int(call.bound_args["dim"]), len(out.shape))
    n_in = len(call.inputs)
    found = [Strategy1D((Shard(d),) * n_in, (Shard(d),)) for d in split_dims(out.shape) if d != dim]
    return found + [Strategy1D((P,) * n_in, (P,))]


@register_rule(aten.stack.default, float_partials_only=True)
def stack_rule(call: OpCall) -> list[Strategy1D]:
    x = call.inputs[0]
    dim = norm_dim(int(call.bound_args["dim"]), len(x.shape) + 1)
    n_in = len(call.inputs)
    found = [Strategy1D((Shard(d),) * n_in, (Shard(d if d < dim else d + 1),)) for d in split_dims(x.shape)]
    return found + [Strategy1D((P,) * n_in, (P,))]


@register_rule(aten.slice.Tensor, aten.select.int, aten.narrow.default, aten.narrow_copy.default,
               float_partials_only=True)
def slice_rule(call: OpCall) -> list[Strategy1D]:
    """Dims other than the sliced one shard (``select`` drops its dim). A full ``slice``
    (start 0, step 1, nothing cut) is the identity on local pieces too, so its dim may stay split."""
    x, out = call.inputs[0], call.outputs[0]
    args = call.bound_args
    dim = norm_dim(int(args["dim"]), len(x.shape))
    drops = call.target == aten.select.int
    whole = (call.target == aten.slice.Tensor and args.get("start") in (None, 0)
             and args.get("step") in (None, 1) and out.shape[dim] == x.shape[dim])
    found = []
    for d in split_dims(x.shape):
        if d != dim or whole:
            found.append(Strategy1D((Shard(d),), (Shard(d - 1 if drops and d > dim else d),)))
    return found + [_PARTIAL]


@register_rule(aten.index_select.default, float_partials_only=True)
def index_select_rule(call: OpCall) -> list[Strategy1D]:
    """``self`` shards on dims other than ``dim`` (index whole); or the index shards and the output
    follows it on ``dim`` (``self`` whole). Linear in ``self``: ``(P, R) -> P``."""
    x, idx = call.inputs
    dim = norm_dim(int(call.bound_args["dim"]), len(x.shape))
    found = [Strategy1D((Shard(d), R), (Shard(d),)) for d in split_dims(x.shape) if d != dim]
    if len(idx.shape) == 1 and idx.shape[0] > 1:
        found.append(Strategy1D((R, Shard(0)), (Shard(dim),)))
    return found + [Strategy1D((P, R), (P,))]


@register_rule(aten.repeat.default, float_partials_only=True)
def repeat_rule(call: OpCall) -> list[Strategy1D]:
    """Only dims repeated once shard (``repeats`` is not rewritten to local counts)."""
    x = call.inputs[0]
    repeats = [int(r) for r in call.bound_args["repeats"]]
    off = len(repeats) - len(x.shape)
    found = [Strategy1D((Shard(d),), (Shard(d + off),)) for d in split_dims(x.shape) if repeats[d + off] == 1]
    return found + [_PARTIAL]


@register_rule(aten.repeat_interleave.self_int, float_partials_only=True)
def repeat_interleave_rule(call: OpCall) -> list[Strategy1D]:
    """``repeat_interleave(x, k, dim)`` with an int ``k``: every dim shards, ``dim`` included (rows
    ``[a, b)`` become rows ``[k a, k b)``: contiguous blocks again) unless ``output_size`` is given
    (a global size). Without ``dim`` it flattens: only ``P``."""
    x = call.inputs[0]
    args = call.bound_args
    if args.get("dim") is None:
        return [_PARTIAL]
    dim = norm_dim(int(args["dim"]), len(x.shape))
    dims = [d for d in split_dims(x.shape) if d != dim or args.get("output_size") is None]
    return [Strategy1D((Shard(d),), (Shard(d),)) for d in dims] + [_PARTIAL]


@register_rule(aten.flip.default, aten.roll.default, float_partials_only=True)
def flip_roll_rule(call: OpCall) -> list[Strategy1D]:
    """Dims not flipped/rolled shard; ``roll`` with no dims rolls the flattened tensor (none shard)."""
    x = call.inputs[0]
    dims = list(call.bound_args["dims"])
    if not dims and call.target == aten.roll.default:
        return [_PARTIAL]
    moved = set(norm_dims(dims, len(x.shape))) if dims else set()
    return [Strategy1D((Shard(d),), (Shard(d),)) for d in split_dims(x.shape) if d not in moved] + [_PARTIAL]


@register_rule(aten.pad.default, aten.constant_pad_nd.default, float_partials_only=True)
def pad_rule(call: OpCall) -> list[Strategy1D]:
    """Dims not padded shard. Padding copies elements (or adds a constant), so ``P -> P`` unless the
    constant is nonzero (it would be added once per rank)."""
    x = call.inputs[0]
    args = call.bound_args
    pad = [int(p) for p in args["pad"]]
    padded = {len(x.shape) - 1 - i for i in range(len(pad) // 2) if pad[2 * i] or pad[2 * i + 1]}
    found = [Strategy1D((Shard(d),), (Shard(d),)) for d in split_dims(x.shape) if d not in padded]
    if args.get("mode", "constant") != "constant" or not args.get("value"):
        found.append(_PARTIAL)
    return found
