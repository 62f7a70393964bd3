"""Ready-made pins for the classic layouts, so a user (or a test) can ask for one by name.

Each function returns keyword pins for ``autoshard.plan`` / ``autoshard.compile``; the solver still
decides every op the pins leave open.

>>> data_parallel(Mesh.of((2, 2)))
{'inputs': {0: ('S(0)', 'S(0)')}, 'params': {'*': ('R', 'R')}}
"""
from __future__ import annotations

from typing import Iterable

from autoshard.passes.mesh import Mesh  # noqa: F401  (re-exported for the doctest)


def data_parallel(mesh, batch_inputs: Iterable[int] = (0,)) -> dict:
    """DDP: every parameter replicated, the batch (dim 0 of each listed input) split over every axis."""
    m = Mesh.of(mesh)
    shard = tuple("S(0)" for _ in m.shape)
    return {"inputs": {i: shard for i in batch_inputs}, "params": {"*": tuple("R" for _ in m.shape)}}


def fully_sharded(model, mesh, batch_inputs: Iterable[int] = (0,)) -> dict:
    """FSDP / ZeRO-3: the batch split over every axis; each parameter stored sharded over every axis
    on its first dim that divides by the mesh size (a parameter with no such dim stays replicated)."""
    m = Mesh.of(mesh)
    shard = tuple("S(0)" for _ in m.shape)
    params: dict = {}
    for name, p in model.named_parameters():
        dim = next((d for d, size in enumerate(p.shape) if size % m.size == 0), None)
        params[name] = tuple(f"S({dim})" for _ in m.shape) if dim is not None else tuple("R" for _ in m.shape)
    return {"inputs": {i: shard for i in batch_inputs}, "params": params}


def megatron_mlp(model, column: Iterable[str], row: Iterable[str], mesh, tp_axis: int = -1,
                 batch_inputs: Iterable[int] = (0,)) -> dict:
    """Megatron tensor parallel on ``tp_axis``: weights of ``column`` Linears split by output features
    (``S(0)``, bias ``S(0)``), of ``row`` Linears by input features (``S(1)``, bias replicated); other
    axes run data parallel (batch split, weights replicated). ``model`` tells which Linears have a bias."""
    m = Mesh.of(mesh)
    existing = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    tp = tp_axis % m.ndim

    def on_tp(tp_pl: str) -> tuple:
        return tuple(tp_pl if a == tp else "R" for a in range(m.ndim))

    params: dict = {}
    for name in column:
        params[f"{name}.weight"] = on_tp("S(0)")
        params[f"{name}.bias"] = on_tp("S(0)")
    for name in row:
        params[f"{name}.weight"] = on_tp("S(1)")
        params[f"{name}.bias"] = on_tp("R")
    missing = sorted(k for k in params if k.endswith(".weight") and k not in existing)
    if missing:
        raise KeyError(f"megatron_mlp: the model has no parameter(s) {missing}")
    params = {k: v for k, v in params.items() if k in existing}
    batch = tuple("R" if a == tp else "S(0)" for a in range(m.ndim))
    return {"inputs": {i: batch for i in batch_inputs}, "params": params}
