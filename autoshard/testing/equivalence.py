"""The runtime's oracle: train a distributed program next to a single-device copy and list every difference.

One harness for every program kind that trains: ``RankProgram``, ``PipelineProgram``, ``CompiledModel``
and ``PipelinedModel`` (anything with ``step(*inputs, target=)``, ``parameters()`` and
``full_state_dict()``). Each rank runs it on its own program and returns the failure strings; the
test gathers them with ``run_ranks`` and asserts there are none::

    def worker(rank, world):
        ...
        ref = copy.deepcopy(model)
        cm = CompiledModel(model, plan, env)
        return train_against_one_device("mlp dp", cm, ref, (inputs, target), loss_fn=loss_fn,
                                        check_gradients=lambda p, r: compiled_gradient_mismatches("mlp dp", p, r))

    failures = failures_of(run_ranks(worker, 4))
    assert not failures, "\\n".join(failures)

Every step: the program's loss (``program.step(*inputs, target=target)``, ``**inputs`` for a dict)
must equal the reference's (``|got - want| <= atol + rtol |want|``); the first step that differs is
reported and ends the training. After the first backward and before any optimizer step,
``check_gradients(program, reference)`` may compare gradients (an optimizer like Adam would hide a
uniform scale error). After the last step, the program's ``full_state_dict()`` must hold exactly the
reference's state-dict names, each with the same shape and values within tolerance (compared in float32).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional

import torch

from autoshard.runtime.layout import shard_tensor

__all__ = ["Tolerance", "adamw", "train_against_one_device", "tensor_mismatches", "compiled_gradient_mismatches",
           "pipeline_gradient_mismatches", "failures_of"]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``close`` means ``|got - want| <= atol + rtol |want|`` elementwise; gradients use ``grad_atol``."""
    rtol: float = 1e-4
    atol: float = 2e-5
    grad_atol: float = 1e-6

    def loss_close(self, got: float, want: float) -> bool:
        return abs(got - want) <= self.atol + self.rtol * abs(want)  # False on NaN

    def tensor_close(self, got: torch.Tensor, want: torch.Tensor, atol: Optional[float] = None) -> bool:
        return got.shape == want.shape and torch.allclose(got.float(), want.detach().float(), rtol=self.rtol,
                                                          atol=self.atol if atol is None else atol)


def adamw(lr: float = 1e-3, eps: float = 1e-6) -> Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]:
    """An optimizer factory for both sides. The small ``eps`` damps the amplification of rounding noise
    in (near-)zero gradient entries."""
    return lambda params: torch.optim.AdamW(params, lr=lr, eps=eps)


def _call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def _as_inputs(inputs):
    return (inputs,) if isinstance(inputs, torch.Tensor) else inputs


def train_against_one_device(label: str, program, reference: torch.nn.Module, batches, *,
                             loss_fn: Optional[Callable] = None, reference_loss: Optional[Callable] = None,
                             steps: int = 3, optimizer: Callable = adamw(), tol: Tolerance = Tolerance(),
                             check_gradients: Optional[Callable[[Any, torch.nn.Module], list]] = None) -> list[str]:
    """Train ``program`` and ``reference`` (a single-device copy of the same model) side by side for
    ``steps`` steps; return what differed, each string starting with ``label``.

    ``batches``: ``(inputs, target)`` used at every step, or a function ``step -> (inputs, target)``;
    ``inputs`` is a tuple, a dict of keyword inputs or one tensor. The reference's loss is
    ``reference_loss(reference, inputs, target)``, by default ``loss_fn(output, target)`` (``output`` exactly
    what the model returns, as autoshard's loss receives it). ``optimizer(params)`` builds each side's optimizer."""
    if reference_loss is None:
        if loss_fn is None:
            raise TypeError("train_against_one_device needs loss_fn or reference_loss")

        def reference_loss(model, inputs, target):
            return loss_fn(_call(model, inputs), target)

    batch_at = batches if callable(batches) else (lambda step: batches)
    opt, ref_opt = optimizer(program.parameters()), optimizer(reference.parameters())
    failures = []
    for step in range(steps):
        inputs, target = batch_at(step)
        inputs = _as_inputs(inputs)
        if isinstance(inputs, dict):
            got = program.step(target=target, **inputs)
        else:
            got = program.step(*inputs, target=target)
        want = reference_loss(reference, inputs, target)
        want.backward()
        if step == 0 and check_gradients is not None:
            failures += check_gradients(program, reference)
        ref_opt.step()
        ref_opt.zero_grad()
        opt.step()
        opt.zero_grad()
        if not tol.loss_close(got, want.item()):
            failures.append(f"{label}: loss at step {step} is {got:.7f}, one device gives {want.item():.7f}")
            break
    return failures + tensor_mismatches(f"{label}, full_state_dict after {steps} steps vs one device",
                                        program.full_state_dict(), reference.state_dict(), tol)


def tensor_mismatches(label: str, got: dict, want: dict, tol: Tolerance = Tolerance()) -> list[str]:
    """Two dicts of tensors (state dicts, gradients, outputs) compared: names missing from or extra in
    ``got``, and tensors whose shape or values differ from ``want``'s."""
    out = [f"{label}: {key} is missing" for key in want if key not in got]
    out += [f"{label}: {key} is extra" for key in got if key not in want]
    for key, value in want.items():
        if key in got and not tol.tensor_close(got[key], value):
            g = got[key]
            err = (g.float() - value.float()).abs().max().item() if g.shape == value.shape else \
                f"shape {tuple(g.shape)} vs {tuple(value.shape)}"
            out.append(f"{label}: {key} differs (max err {err})")
    return out


def compiled_gradient_mismatches(label: str, cm, reference: torch.nn.Module, tol: Tolerance = Tolerance()) -> list[str]:
    """Each rank's local gradient of a ``CompiledModel`` equals its shard of the single-device gradient."""
    env = cm.env
    full = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)}
    out = []
    for name, local in cm.named_parameters():
        want = full.get(name)
        if want is None or local.grad is None:
            if (want is None) != (local.grad is None):
                out.append(f"{label}: {name} has a gradient on one side only")
            continue
        want = shard_tensor(want, cm.plan.param_placements[name], env.mesh.shape, env.coordinate)
        if not tol.tensor_close(local.grad, want, atol=tol.grad_atol):
            out.append(f"{label}: gradient of {name} differs (max err {(local.grad - want).abs().max().item():.3g})")
    return out


def pipeline_gradient_mismatches(label: str, prog, reference: torch.nn.Module,
                                 tol: Tolerance = Tolerance()) -> list[str]:
    """Every local gradient of a ``PipelineProgram`` (each copy of a tied weight included) equals its piece
    of the single-device full-batch gradient."""
    full = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)}
    out = []
    for s, stage in prog.stages.items():
        for ph, p in zip(stage.param_names, stage.params):
            name = stage.graph.captured.params[ph]
            want = shard_tensor(full[name], stage.grad_layout(ph), stage.env.mesh.shape, stage.env.coordinate)
            if p.grad is None or not tol.tensor_close(p.grad, want, atol=tol.grad_atol):
                err = "none" if p.grad is None else f"{(p.grad - want).abs().max().item():.3g}"
                out.append(f"{label}: stage {s} gradient of {name} differs from one device (max err {err})")
    return out


def failures_of(per_rank: list[list[str]]) -> list[str]:
    """Every rank's failure strings, sorted, each once."""
    return sorted(set(f for failures in per_rank for f in failures))
