"""A torch.optim optimizer's state over a compiled program, keyed by parameter name, for checkpoints.

The layout follows ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` with
``StateDictOptions(flatten_optimizer_state_dict=True)``, the form that reshards across pipeline
stages and meshes because every entry is keyed by the parameter's FQN (as in
``model.named_parameters()``), never by its index in this rank's optimizer::

    "state.<fqn>.<key>":          a DTensor with the parameter's placements for a state tensor of the
                                  parameter's shape (Adam's exp_avg, exp_avg_sq); a plain tensor or value
                                  for a scalar (step)
    "param_groups.<fqn>.<name>":  the hyperparameters of the group holding it (lr, betas, ...)

A parameter stored ``P`` has its full gradient on every rank, so its state is ``R`` there. A parameter in
a ZeRO form (``runtime.zero``) is stepped as its slice: its state is the slice's, placed ``S(zero_dim)``
on the ZeRO axes (``storage_forms.optimizer_placements``), so it reshards to and from any other form. A fresh
optimizer has no state yet: ``optimizer_state_dict`` first takes one step with zero gradients and
learning rate 0 (as torch's own helper does), so the structure exists for ``dcp.load`` to fill.
Copies of a weight shared by pipeline stages are saved from the owner and set from it on load.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from autoshard.passes.errors import CheckpointError

from .layout import shard_tensor
from .state_dict import ModelState, as_dtensor

__all__ = ["init_optimizer_state", "optimizer_state_dict", "load_optimizer_state_dict"]


def init_optimizer_state(opt: torch.optim.Optimizer) -> None:
    """Give a fresh optimizer its state: one step with zero gradients at learning rate 0 (nothing
    changes but step counters). A no-op when it has state or any parameter has a gradient."""
    if opt.state or any(p.grad is not None for g in opt.param_groups for p in g["params"]):
        return
    for g in opt.param_groups:
        for p in g["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    lrs = []
    for g in opt.param_groups:
        if "lr" in g:
            lrs.append(g["lr"])
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    opt.step()
    for g in opt.param_groups:
        if "lr" in g:
            g["lr"] = lrs.pop(0)
    opt.zero_grad(set_to_none=True)


def _grad_placements(h) -> tuple:
    return h.optimized_placements


def _holdings_in(state: ModelState, opt: torch.optim.Optimizer) -> list[list]:
    """Per param group, the ``Holding`` of each of its parameters; an error for a foreign tensor."""
    by_id = {id(h.optimized): h for h in state.held if h.is_param}
    out = []
    for g in opt.param_groups:
        row = []
        for p in g["params"]:
            if id(p) not in by_id:
                raise CheckpointError(f"the optimizer holds a tensor of shape {tuple(p.shape)} that is not one of this "
                                      "compiled model's parameters; build it from cm.parameters()")
            row.append(by_id[id(p)])
        out.append(row)
    return out


def optimizer_state_dict(state: ModelState, opt: torch.optim.Optimizer) -> dict:
    """The optimizer's state of this rank's owned parameters, flat and keyed by FQN (module docstring)."""
    init_optimizer_state(opt)
    out: dict[str, Any] = {}
    for g, row in zip(opt.param_groups, _holdings_in(state, opt)):
        hyper = {k: v for k, v in g.items() if k != "params"}
        for h in row:
            if not h.owner:
                continue
            for key, value in opt.state.get(h.optimized, {}).items():
                out[f"state.{h.name}.{key}"] = _placed(state, h, key, value)
            for key, value in hyper.items():
                out[f"param_groups.{h.name}.{key}"] = value
    return out


def _placed(state: ModelState, h, key: str, value: Any) -> Any:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        return value
    if tuple(value.shape) != tuple(h.optimized.shape):
        raise CheckpointError(f"optimizer state {key!r} of {h.name!r} has shape {tuple(value.shape)}, neither the "
                              f"parameter's local shape {tuple(h.optimized.shape)} nor a scalar; autoshard cannot place it "
                              "on the mesh")
    return as_dtensor(value, state.mesh, _grad_placements(h), h.global_shape)


def _local(state: ModelState, h, key: str, value: Any) -> Any:
    """A loaded value as this rank's piece of it."""
    if isinstance(value, DTensor):
        if value.dim() == 0:
            return value.full_tensor()
        return value.redistribute(state.mesh, _grad_placements(h)).to_local()
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        if tuple(value.shape) != tuple(h.global_shape):
            raise CheckpointError(f"optimizer state {key!r} of {h.name!r} has shape {tuple(value.shape)}; the "
                                  f"parameter's is {h.global_shape}")
        return shard_tensor(value, _grad_placements(h), h.env.mesh.shape, h.env.coordinate).to(h.optimized.device)
    return value


def _native(state: ModelState, opt, rows: list, sd: dict, strict: bool) -> tuple[dict, list, list]:
    """(torch's index-keyed state, param groups, what is missing) for ``opt`` from the FQN-keyed ``sd``."""
    native_state: dict[int, dict] = {}
    groups, index, missing = [], 0, []
    for g, row in zip(opt.param_groups, rows):
        group = {k: v for k, v in g.items() if k != "params"}
        group["params"] = []
        for h in row:
            current = opt.state.get(h.optimized, {})
            if h.owner:
                prefix = f"state.{h.name}."
                given = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix) and "." not in k[len(prefix):]}
                if strict and set(given) != set(current):
                    missing.append(f"{h.name} (has {sorted(given)}, the optimizer keeps {sorted(current)})")
                native_state[index] = {k: _local(state, h, k, v) for k, v in given.items()} or dict(current)
                for key in [k for k in group if f"param_groups.{h.name}.{k}" in sd]:
                    group[key] = sd[f"param_groups.{h.name}.{key}"]
            else:
                native_state[index] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in current.items()}
            group["params"].append(index)
            index += 1
        groups.append(group)
    return native_state, groups, missing


def load_optimizer_state_dict(state: ModelState, opt: torch.optim.Optimizer, sd: dict, strict: bool = True) -> None:
    """Load a flat FQN-keyed optimizer state (as ``optimizer_state_dict`` gives, after ``dcp.load``) into
    ``opt``. ``strict``: every owned parameter must have its state and hyperparameters in ``sd``."""
    init_optimizer_state(opt)
    rows = _holdings_in(state, opt)
    try:
        native_state, groups, missing = _native(state, opt, rows, sd, strict)
        problem = (f"the optimizer state dict does not match: {missing[:5]}; pass strict=False to load what is there"
                   if missing else None)
    except CheckpointError as e:
        problem = str(e)
    state.agree(problem)
    opt.load_state_dict({"state": native_state, "param_groups": groups})
    keys = sorted({k for h in state.held if h.is_param and h.optimized in opt.state for k in opt.state[h.optimized]
                   if isinstance(opt.state[h.optimized][k], torch.Tensor)})
    for key in keys:
        state.sync_copies(lambda h, key=key: opt.state[h.optimized][key], gradient_layout=True)
