"""The runtime's oracle: train a distributed program next to a single-device copy and list every difference.

One harness for everything that trains: a ``RankProgram`` or a ``CompiledModel``, with or without a
pipeline (anything with ``step(*inputs, target=)``, ``parameters()`` and ``full_state_dict()``). Each rank runs it on its own program and returns the failure strings; the
test gathers them with ``run_ranks`` and asserts there are none::

    def worker(rank, world):
        ...
        ref = copy.deepcopy(model)
        cm = CompiledModel(model, plan, env)
        return train_against_one_device("mlp dp", cm, ref, (inputs, target), loss_fn=loss_fn,
                                        check_gradients=lambda p, r: compiled_gradient_mismatches("mlp dp", p, r))

    failures = failures_of(run_ranks(worker, 4))
    assert not failures, "\\n".join(failures)

``tol`` is a fixed ``Tolerance`` or a ``NoiseFloor``: then a float64 twin of the reference trains
alongside, and each quantity may be ``factor`` times as far from the float64 result as the float32
reference is (``autoshard/testing/noise_floor.py``; a model with an op that has no float64 kernel
falls back, with a warning, to ``NoiseFloor.fallback``); gradients are then checked by ``gradients=``
(``compiled_gradient_mismatches`` or ``pipeline_gradient_mismatches``) with the measured tolerances.

Every step: the program's loss (``program.step(*inputs, target=target)``, ``**inputs`` for a dict)
must equal the reference's (``|got - want| <= atol + rtol |want|``); the first step that differs is
reported and ends the training. After the first backward and before any optimizer step,
``check_gradients(program, reference)`` may compare gradients (an optimizer like Adam would hide a
uniform scale error). After the last step, the program's ``full_state_dict()`` must hold exactly the
reference's state-dict names, each with the same shape and values within tolerance (compared in float32,
or in float64 where either side is float64).
"""
from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any, Callable, Iterable, Mapping, Optional, Union

import torch

from autoshard.runtime.layout import shard_tensor
from autoshard.testing.noise_floor import NoiseFloor, UNIT_ROUNDOFF, allowed_distances, measured_distance

__all__ = ["Tolerance", "NoiseFloor", "adamw", "train_against_one_device", "OneDeviceRun", "tensor_mismatches", "compiled_gradient_mismatches",
           "pipeline_gradient_mismatches", "failures_of"]


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """``close`` means ``|got - want| <= atol + rtol |want|`` elementwise; gradients use ``grad_atol``.
    ``per_name`` (measured by ``NoiseFloor``) replaces both for the tensors it names: there ``close``
    means ``max |got - want| <= per_name[name]``."""
    rtol: float = 1e-4
    atol: float = 2e-5
    grad_atol: float = 1e-6
    per_name: Optional[Mapping[str, float]] = dataclasses.field(default=None, compare=False, hash=False)
    factor: float = 1.0  # per_name bounds are this factor times a measured floor (for ``ratios``)
    ratios: Optional[list] = dataclasses.field(default=None, compare=False, hash=False)

    def named_close(self, name: str, got: torch.Tensor, want: torch.Tensor, atol: Optional[float] = None) -> bool:
        """``tensor_close``, or the measured bound where ``per_name`` has ``name``."""
        if self.per_name is not None and name in self.per_name:
            distance, bound = measured_distance(got, want), self.per_name[name]
            if self.ratios is not None and bound > 0:
                self.ratios.append((name, distance * self.factor / bound))
            return distance <= bound
        return self.tensor_close(got, want, atol=atol)

    def loss_close(self, got: float, want: float) -> bool:
        return abs(got - want) <= self.atol + self.rtol * abs(want)  # False on NaN

    def tensor_close(self, got: torch.Tensor, want: torch.Tensor, atol: Optional[float] = None) -> bool:
        if got.shape != want.shape:
            return False
        wide = torch.promote_types(torch.promote_types(got.dtype, want.dtype), torch.float32)  # float64 stays
        return torch.allclose(got.detach().to(wide), want.detach().to(wide), rtol=self.rtol,
                              atol=self.atol if atol is None else atol)


def adamw(lr: float = 1e-3, eps: float = 1e-6) -> Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]:
    """An optimizer factory for both sides. The small ``eps`` damps the amplification of rounding noise
    in (near-)zero gradient entries."""
    return lambda params: torch.optim.AdamW(params, lr=lr, eps=eps)


def _call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(*inputs)


def _as_inputs(inputs):
    return (inputs,) if isinstance(inputs, torch.Tensor) else inputs


class _OneDevice:
    """The single-device side of ``train_against_one_device``, run a step at a time: the reference (and, under a
    ``NoiseFloor``, its float64 twin) trained on the same batches with its own optimizer."""

    def __init__(self, label: str, reference: torch.nn.Module, batch_at: Callable, reference_loss: Callable,
                 optimizer: Callable, tol: Union[Tolerance, NoiseFloor]):
        self.label, self.reference, self.batch_at, self.reference_loss = label, reference, batch_at, reference_loss
        self.tol = tol  # a NoiseFloor becomes its fallback where the float64 twin cannot run
        noise = isinstance(tol, NoiseFloor)
        self.twin = copy.deepcopy(reference).double() if noise else None
        self.optimizers = [optimizer(reference.parameters())] + ([optimizer(self.twin.parameters())] if noise else [])

    def backward(self, step: int) -> tuple[float, Optional[float]]:
        """Step ``step``'s loss (and the float64 twin's, or None), gradients left on the parameters."""
        inputs, target = self.batch_at(step)
        inputs = _as_inputs(inputs)
        want = self.reference_loss(self.reference, inputs, target)
        want.backward()
        if self.twin is None:
            return want.item(), None
        try:
            want64 = self.reference_loss(self.twin, _to_float64(inputs), _to_float64(target))
            want64.backward()
        except RuntimeError as e:  # an op with no float64 kernel (torch._grouped_mm): nothing to measure
            if step:
                raise
            noise = self.tol
            warnings.warn(f"{self.label}: the float64 twin cannot run ({str(e).splitlines()[0][:200]}); "
                          f"comparing with the fixed tolerance {noise.fallback or Tolerance()} instead of a "
                          "measured one")
            self.twin, self.optimizers, self.tol = None, self.optimizers[:1], noise.fallback or Tolerance()
            return want.item(), None
        return want.item(), want64.item()

    def first_gradients(self) -> tuple[torch.nn.Module, Optional[torch.nn.Module]]:
        """The reference and the twin (or None) holding the first step's gradients."""
        return self.reference, self.twin

    def optimizer_step(self) -> None:
        for o in self.optimizers:
            o.step()
            o.zero_grad()

    def final(self) -> tuple[dict, Optional[dict]]:
        return self.reference.state_dict(), None if self.twin is None else self.twin.state_dict()


class OneDeviceRun:
    """A single-device run recorded once (``one_device_run``) and replayed by ``train_against_one_device`` in
    place of its ``reference`` module: the same losses, first-step gradients and final state that training the
    reference beside the program would give, for many programs (every case, every rank forked from the process
    that recorded it) at the cost of one run. Its ``batches``, ``steps``, optimizer and loss are the recording's;
    a replay must pass the same ``batches`` and at most ``steps``."""

    def __init__(self, reference: torch.nn.Module, batches, *, loss_fn: Optional[Callable] = None,
                 reference_loss: Optional[Callable] = None, steps: int = 3, optimizer: Callable = adamw(),
                 tol: Union[Tolerance, NoiseFloor] = Tolerance(), label: str = "one-device run"):
        live = _OneDevice(label, reference, _batch_at(batches), _reference_loss(loss_fn, reference_loss), optimizer,
                          tol)
        self.steps, self.losses, self.gradients = steps, [], None
        for step in range(steps):
            self.losses.append(live.backward(step))
            if step == 0:
                self.gradients = tuple(None if m is None else _with_gradients(m) for m in live.first_gradients())
            live.optimizer_step()
        self.tol, self.states = live.tol, tuple(None if s is None else {k: v.clone() for k, v in s.items()}
                                                for s in live.final())
        self.float64 = live.twin is not None

    def replay(self, tol: Union[Tolerance, NoiseFloor]) -> "_Replay":
        return _Replay(self, tol)


class _Replay:
    """``OneDeviceRun`` read a step at a time, as ``_OneDevice`` computes it; ``tol`` the replay's own (its
    ``ratios`` list and ``factor``), turned into its fallback where the recording's twin could not run."""

    def __init__(self, run: OneDeviceRun, tol: Union[Tolerance, NoiseFloor]):
        self.run = run
        self.tol = tol.fallback or Tolerance() if isinstance(tol, NoiseFloor) and not run.float64 else tol

    def backward(self, step: int) -> tuple[float, Optional[float]]:
        if step >= self.run.steps:
            raise ValueError(f"the one-device run recorded {self.run.steps} steps; step {step} asked")
        return self.run.losses[step]

    def first_gradients(self):
        return self.run.gradients

    def optimizer_step(self) -> None:
        pass

    def final(self):
        return self.run.states


def _with_gradients(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters hold copies of its gradients (``deepcopy`` drops ``.grad``)."""
    twin = copy.deepcopy(model)
    copies = dict(twin.named_parameters(remove_duplicate=False))
    for name, p in model.named_parameters(remove_duplicate=False):
        copies[name].grad = None if p.grad is None else p.grad.detach().clone()
    return twin


def _reference_loss(loss_fn: Optional[Callable], reference_loss: Optional[Callable]) -> Callable:
    if reference_loss is not None:
        return reference_loss
    if loss_fn is None:
        raise TypeError("train_against_one_device needs loss_fn or reference_loss")
    return lambda model, inputs, target: loss_fn(_call(model, inputs), target)


def _batch_at(batches) -> Callable:
    return batches if callable(batches) else (lambda step: batches)


def train_against_one_device(label: str, program, reference: Union[torch.nn.Module, OneDeviceRun], batches, *,
                             loss_fn: Optional[Callable] = None, reference_loss: Optional[Callable] = None,
                             steps: int = 3, optimizer: Callable = adamw(),
                             tol: Union[Tolerance, NoiseFloor] = Tolerance(),
                             check_gradients: Optional[Callable[[Any, torch.nn.Module], list]] = None,
                             gradients: Optional[Callable[[str, Any, torch.nn.Module, Tolerance], list]] = None
                             ) -> list[str]:
    """Train ``program`` and ``reference`` (a single-device copy of the same model) side by side for
    ``steps`` steps; return what differed, each string starting with ``label``.

    ``batches``: ``(inputs, target)`` used at every step, or a function ``step -> (inputs, target)``;
    ``inputs`` is a tuple, a dict of keyword inputs or one tensor. The reference's loss is
    ``reference_loss(reference, inputs, target)``, by default ``loss_fn(output, target)`` (``output`` exactly
    what the model returns, as autoshard's loss receives it). ``optimizer(params)`` builds each side's optimizer, the program's first.
    ``reference`` may be a ``OneDeviceRun`` recorded once with the same batches, loss and optimizer: then it is
    replayed instead of trained (after a loss that differs, the state is compared with the recording's last)."""
    batch_at = _batch_at(batches)
    opt = optimizer(program.parameters())  # first, as callers that keep the optimizers they build expect
    if isinstance(reference, OneDeviceRun):
        one = reference.replay(tol)
    else:
        one = _OneDevice(label, reference, batch_at, _reference_loss(loss_fn, reference_loss), optimizer, tol)
    failures = []
    for step in range(steps):
        inputs, target = batch_at(step)
        inputs = _as_inputs(inputs)
        if isinstance(inputs, dict):
            got = program.step(target=target, **inputs)
        else:
            got = program.step(*inputs, target=target)
        want, exact = one.backward(step)
        tol = one.tol
        noise = tol if isinstance(tol, NoiseFloor) else None
        if step == 0:
            ref, twin = one.first_gradients()
            if check_gradients is not None:
                failures += check_gradients(program, ref)
            if gradients is not None:
                if noise:
                    measured = Tolerance(per_name=allowed_distances(_grads(ref), _grads(twin), noise.factor),
                                         factor=noise.factor, ratios=noise.ratios)
                    failures += gradients(label, program, twin, measured)
                else:
                    failures += gradients(label, program, ref, tol)
        one.optimizer_step()
        opt.step()
        opt.zero_grad()
        if noise:
            allowed = noise.factor * max(abs(want - exact), UNIT_ROUNDOFF * abs(exact))
            close, shown = abs(got - exact) <= allowed, f"{exact:.7f} (float64; allowed distance {allowed:.3g})"
            if noise.ratios is not None and allowed > 0:
                noise.ratios.append((f"loss at step {step}", abs(got - exact) * noise.factor / allowed))
        else:
            close, shown = tol.loss_close(got, want), f"{want:.7f}"
        if not close:
            failures.append(f"{label}: loss at step {step} is {got:.7f}, one device gives {shown}")
            break
    state, state64 = one.final()
    if isinstance(one.tol, NoiseFloor):
        noise = one.tol
        tol = Tolerance(per_name=allowed_distances(state, state64, noise.factor), factor=noise.factor,
                        ratios=noise.ratios)
        state = state64
    return failures + tensor_mismatches(f"{label}, full_state_dict after {steps} steps vs one device",
                                        program.full_state_dict(), state, tol)


def _to_float64(value):
    """``value`` (a tensor, or a tuple/list/dict of them) with its floating-point tensors in float64."""
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _to_float64(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to_float64(v) for v in value)
    return value


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters(remove_duplicate=False) if p.grad is not None}


def tensor_mismatches(label: str, got: dict, want: dict, tol: Tolerance = Tolerance()) -> list[str]:
    """Two dicts of tensors (state dicts, gradients, outputs) compared: names missing from or extra in
    ``got``, and tensors whose shape or values differ from ``want``'s."""
    out = [f"{label}: {key} is missing" for key in want if key not in got]
    out += [f"{label}: {key} is extra" for key in got if key not in want]
    for key, value in want.items():
        if key in got and not tol.named_close(key, got[key], value):
            g = got[key]
            err = (g.float() - value.float()).abs().max().item() if g.shape == value.shape else \
                f"shape {tuple(g.shape)} vs {tuple(value.shape)}"
            out.append(f"{label}: {key} differs (max err {err})")
    return out


def _zero_slice_of(value: torch.Tensor, whole: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """The part of ``value`` (laid out as ``whole``) that ``piece`` views: a ZeRO parameter's optimizer
    slice is ``whole`` narrowed along one dim (``runtime.zero``), found from its shape and storage offset."""
    dims = [d for d, (a, b) in enumerate(zip(whole.shape, piece.shape)) if a != b]
    if len(dims) != 1:
        return value
    d = dims[0]
    start = (piece.storage_offset() - whole.storage_offset()) // whole.stride(d)
    return value.narrow(d, start, piece.shape[d])


def compiled_gradient_mismatches(label: str, cm, reference: torch.nn.Module, tol: Tolerance = Tolerance()) -> list[str]:
    """Each rank's local gradient of a ``CompiledModel`` equals its shard of the single-device gradient."""
    env = cm.env
    full = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)}
    program = cm._program
    wholes = program.local_parameters() if hasattr(program, "local_parameters") else None
    named = list(cm.named_parameters())
    out = []
    for i, (name, local) in enumerate(named):
        want = full.get(name)
        if want is None or local.grad is None:
            if (want is None) != (local.grad is None):
                out.append(f"{label}: {name} has a gradient on one side only")
            continue
        want = shard_tensor(want, cm.plan.param_placements[name], env.mesh.shape, env.coordinate)
        if wholes is not None and len(wholes) == len(named) and wholes[i] is not local:
            want = _zero_slice_of(want, wholes[i], local)
        if not tol.named_close(name, local.grad, want, atol=tol.grad_atol):
            out.append(f"{label}: gradient of {name} differs (max err {measured_distance(local.grad, want):.3g})")
    return out


def pipeline_gradient_mismatches(label: str, prog, reference: torch.nn.Module,
                                 tol: Tolerance = Tolerance()) -> list[str]:
    """Every local gradient of a ``RankProgram`` or a ``CompiledModel`` (each stage's; each copy of a tied
    weight included) equals its piece of the single-device full-batch gradient."""
    prog = getattr(prog, "_program", prog)
    full = {n: p.grad for n, p in reference.named_parameters(remove_duplicate=False)}
    out = []
    for s, stage in prog.stages.items():
        for ph, p in zip(stage.param_names, stage.params):
            name = stage.graph.captured.params[ph]
            want = shard_tensor(full[name], stage.grad_layout(ph), stage.env.mesh.shape, stage.env.coordinate)
            if p.grad is None or not tol.named_close(name, p.grad, want, atol=tol.grad_atol):
                err = "none" if p.grad is None else f"{measured_distance(p.grad, want):.3g}"
                out.append(f"{label}: stage {s} gradient of {name} differs from one device (max err {err})")
    return out


def failures_of(per_rank: list[list[str]]) -> list[str]:
    """Every rank's failure strings, sorted, each once."""
    return sorted(set(f for failures in per_rank for f in failures))
