"""Materialize this rank's own shards of the parameters and buffers, and nothing more.

Each tensor's value comes from the first source that has it:

1. ``state_dict=``: full tensors under the original names (a tied weight's alias names work too);
2. ``model``'s own tensor when it is real (not on the meta device);
3. for a meta-device ``model``: replayed initialization. ``model.named_modules()`` is walked in
   order under ``torch.manual_seed(seed)`` (the caller's RNG state is restored afterwards); every
   module owning parameters or buffers directly is copied alone (no children), ``to_empty`` on
   the CPU, ``reset_parameters()`` is called, its tensors are sliced and dropped. Values equal a
   CPU model built with the same seed when modules are constructed in registration order and
   initialized by their ``reset_parameters`` (true for torch.nn layers); a module owning meta
   tensors without ``reset_parameters`` is an error naming it. A tied tensor takes the value of
   the first module (in that order) owning it.

The local piece of a full tensor follows its storage placement (``layout.shard_tensor``; a ``P``
storage puts the value on coordinate 0 and zeros elsewhere) and is a copy, never a view.
"""
from __future__ import annotations

import copy
from typing import Optional

import torch
import torch.nn as nn

from autoshard.passes.errors import PlanFormatError
from autoshard.passes.graph import META, CapturedGraph
from autoshard.passes.spec import Strategy

from .groups import MeshEnv
from .layout import shard_tensor

__all__ = ["materialize", "names_of", "full_tensors_by_replay"]


def names_of(captured: CapturedGraph, placeholder: str) -> list[str]:
    """The canonical FQN of a param/buffer placeholder followed by its alias names."""
    canonical = captured.params.get(placeholder) or captured.buffers[placeholder]
    return [canonical] + sorted(a for a, c in captured.aliases.items() if c == canonical)


def _alone(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` without its children (cheap on the meta device)."""
    shallow = copy.copy(module)
    shallow._modules = {}
    shallow._parameters = dict(module._parameters)
    shallow._buffers = dict(module._buffers)
    return copy.deepcopy(shallow)


def full_tensors_by_replay(model: nn.Module, wanted: set[int], seed: int) -> dict[int, torch.Tensor]:
    """Full CPU values, keyed by ``id`` of the model's tensor, for the meta tensors in ``wanted``."""
    found: dict[int, torch.Tensor] = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for path, module in model.named_modules():
            own = {n: t for n, t in list(module._parameters.items()) + list(module._buffers.items()) if t is not None}
            if not own:
                continue
            reset = getattr(module, "reset_parameters", None)
            meta_names = [n for n, t in own.items() if t.is_meta]
            if not callable(reset):
                if meta_names and any(id(own[n]) in wanted for n in meta_names):
                    raise PlanFormatError(
                        f"cannot initialize module {path or '<root>'!r} ({type(module).__name__}) from the meta "
                        f"device: it owns {meta_names} but has no reset_parameters(); pass state_dict= with full "
                        "tensors or build the model on a real device"
                    )
                continue
            alone = _alone(module).to_empty(device="cpu")
            try:
                alone.reset_parameters()
            except AttributeError as e:
                raise PlanFormatError(
                    f"reset_parameters() of module {path or '<root>'!r} ({type(module).__name__}) needs more than the "
                    f"module's own tensors ({e}); pass state_dict= with full tensors instead of a meta model"
                ) from e
            for n, t in own.items():
                if t.is_meta and id(t) in wanted and id(t) not in found:
                    found[id(t)] = getattr(alone, n).detach()
    return found


def _local_copy(full: torch.Tensor, placements, env: MeshEnv) -> torch.Tensor:
    piece = shard_tensor(full.detach(), placements, env.mesh.shape, env.coordinate, partial="first")
    out = torch.empty(piece.shape, dtype=piece.dtype, device=env.device)
    out.copy_(piece)
    return out


def materialize(captured: CapturedGraph, strategies: dict[str, Strategy], env: MeshEnv, *,
                model: Optional[nn.Module] = None, state_dict: Optional[dict] = None,
                seed: int = 0) -> dict[str, torch.Tensor]:
    """Local pieces (on ``env.device``) of every param and buffer placeholder, by placeholder name."""
    names = list(captured.params) + list(captured.buffers)
    by_name: dict[str, torch.Tensor] = {}
    if model is not None:
        by_name.update(dict(model.named_parameters(remove_duplicate=False)))
        by_name.update(dict(model.named_buffers(remove_duplicate=False)))
    sources: dict[str, torch.Tensor] = {}
    meta_needed: dict[str, torch.Tensor] = {}
    for ph in names:
        fqns = names_of(captured, ph)
        given = next((state_dict[f] for f in fqns if state_dict is not None and f in state_dict), None)
        own = next((by_name[f] for f in fqns if f in by_name), None)
        if given is not None:
            sources[ph] = given
        elif own is not None and not own.is_meta:
            sources[ph] = own
        elif own is not None:
            meta_needed[ph] = own
        else:
            where = "state_dict" if model is None else "state_dict or model"
            raise PlanFormatError(f"no value for {fqns[0]!r} (placeholder {ph!r}): the {where} given has no entry "
                                  f"under {fqns}; pass the full state_dict of the traced model")
    if meta_needed:
        replayed = full_tensors_by_replay(model, {id(t) for t in meta_needed.values()}, seed)
        for ph, t in meta_needed.items():
            sources[ph] = replayed[id(t)]
    out: dict[str, torch.Tensor] = {}
    for ph in names:
        full = sources[ph]
        traced = captured.node(ph).meta.get(META)
        if traced is not None and tuple(full.shape) != tuple(traced.shape):
            raise PlanFormatError(f"{names_of(captured, ph)[0]!r} has shape {tuple(full.shape)} but the traced model's "
                                  f"is {tuple(traced.shape)}; the state_dict belongs to a different model")
        out[ph] = _local_copy(full, strategies[ph].outputs[0], env)
    return out
