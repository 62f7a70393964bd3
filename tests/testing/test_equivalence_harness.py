"""autoshard/testing/equivalence.py, the one-device oracle the runtime tests share: it passes a program
that trains exactly like the reference, and reports each kind of difference it exists to catch."""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from autoshard.testing.equivalence import Tolerance, failures_of, tensor_mismatches, train_against_one_device
from autoshard.testing.models import MLP


class EagerProgram:
    """A stand-in for a distributed program: trains its own copy of the model eagerly."""

    def __init__(self, model: torch.nn.Module, loss_scale: float = 1.0, extra_state: bool = False):
        self.model, self.loss_scale, self.extra_state = model, loss_scale, extra_state

    def parameters(self):
        return self.model.parameters()

    def step(self, *inputs, target=None) -> float:
        loss = F.mse_loss(self.model(*inputs), target) * self.loss_scale
        loss.backward()
        return loss.item()

    def full_state_dict(self) -> dict:
        state = dict(self.model.state_dict())
        if self.extra_state:
            state["stray"] = torch.zeros(1)
        return state


def _model_and_batches():
    torch.manual_seed(0)
    model = MLP(8, 16)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 8, generator=gen), torch.randn(4, 8, generator=gen)) for _ in range(3)]
    return model, lambda step: data[step]


def test_identical_training_passes():
    model, batches = _model_and_batches()
    program = EagerProgram(copy.deepcopy(model))
    assert train_against_one_device("same", program, model, batches, loss_fn=F.mse_loss) == []


def test_a_wrong_loss_stops_training_and_parameters_then_differ():
    model, batches = _model_and_batches()
    failures = train_against_one_device("scaled", EagerProgram(copy.deepcopy(model), loss_scale=2.0), model, batches,
                                        loss_fn=F.mse_loss, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    assert failures[0].startswith("scaled: loss at step 0 is ")
    assert len([f for f in failures if "loss at step" in f]) == 1
    assert any("fc1.weight differs" in f for f in failures[1:])  # (Adam would hide a uniform loss scale)


def test_gradients_are_checked_after_the_first_backward_only():
    model, batches = _model_and_batches()
    seen = []

    def check(program, reference):
        seen.append(all(p.grad is not None for p in reference.parameters()))
        return ["grads differ"]

    failures = train_against_one_device("g", EagerProgram(copy.deepcopy(model)), model, batches, loss_fn=F.mse_loss,
                                        check_gradients=check)
    assert seen == [True] and failures == ["grads differ"]


def test_missing_extra_and_differing_tensors_are_named():
    model, batches = _model_and_batches()
    failures = train_against_one_device("x", EagerProgram(copy.deepcopy(model), extra_state=True), model, batches,
                                        loss_fn=F.mse_loss)
    assert failures == ["x, full_state_dict after 3 steps vs one device: stray is extra"]
    tol = Tolerance(rtol=1e-4, atol=1e-5)
    a, b = torch.ones(3), torch.ones(3)
    assert tensor_mismatches("t", {"a": a, "b": b}, {"a": a + 1e-6, "b": b}, tol) == []
    missing, differs = tensor_mismatches("t", {"a": a}, {"a": a + 1e-3, "c": b}, tol)
    assert missing == "t: c is missing" and differs.startswith("t: a differs (max err 0.00")
    assert tensor_mismatches("t", {"a": a}, {"a": torch.ones(4)}, tol) == ["t: a differs (max err shape (3,) vs (4,))"]
    assert failures_of([["b", "a"], ["a"]]) == ["a", "b"]


class SplitSumProgram(EagerProgram):
    """A correct program that rounds differently: ``fc2``'s contraction is split in halves and added, as a
    row-parallel matmul on two ranks would; with ``error`` it also adds a bias that one device does not."""

    def __init__(self, model: torch.nn.Module, error: float = 0.0):
        super().__init__(model)
        self.error = error

    def step(self, *inputs, target=None) -> float:
        fc1, fc2 = self.model.fc1, self.model.fc2
        h = F.gelu(fc1(inputs[0]))
        k = h.shape[-1] // 2
        out = h[:, :k] @ fc2.weight[:, :k].T + h[:, k:] @ fc2.weight[:, k:].T + fc2.bias + self.error
        loss = F.mse_loss(out, target)
        loss.backward()
        return loss.item()


def _wide_model_and_batches():
    torch.manual_seed(0)
    model = MLP(64, 512)
    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 64, generator=gen), torch.randn(32, 64, generator=gen)) for _ in range(3)]
    return model, lambda step: data[step]


def _grads_match(label, program, reference, tol):
    return [f"{label}: {n}" for n, p in program.model.named_parameters()
            if not tol.named_close(n, p.grad, dict(reference.named_parameters())[n].grad)]


def test_the_noise_floor_passes_another_rounding_of_the_same_sums():
    from autoshard.testing.noise_floor import NoiseFloor
    model, batches = _wide_model_and_batches()
    floor = NoiseFloor(ratios=[])
    failures = train_against_one_device("split", SplitSumProgram(copy.deepcopy(model)), model, batches,
                                        loss_fn=F.mse_loss, tol=floor, gradients=_grads_match,
                                        optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    assert failures == []
    names = {name for name, _ in floor.ratios}
    assert {"loss at step 0", "fc1.weight", "fc2.bias"} <= names  # losses, gradients and the final state
    assert max(r for _, r in floor.ratios) > 0  # the sums really were rounded differently


def test_the_noise_floor_catches_an_error_far_smaller_than_the_fixed_tolerance():
    """A bias of 1e-6 on every output passes ``Tolerance()`` (atol 2e-5) but is ~100x the float32
    noise of this loss: the measured bound sees it."""
    from autoshard.testing.noise_floor import NoiseFloor
    model, batches = _wide_model_and_batches()
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    fixed = train_against_one_device("biased", SplitSumProgram(copy.deepcopy(model), error=1e-6), model, batches,
                                     loss_fn=F.mse_loss, optimizer=sgd)
    assert fixed == []
    measured = train_against_one_device("biased", SplitSumProgram(copy.deepcopy(model), error=1e-6), model,
                                        batches, loss_fn=F.mse_loss, tol=NoiseFloor(), gradients=_grads_match,
                                        optimizer=sgd)
    assert any("fc2.bias" in f for f in measured), measured


def test_a_recorded_one_device_run_judges_like_training_the_reference_beside_the_program():
    """``OneDeviceRun`` (recorded once, replayed for every case and rank of the zoo) gives the same verdicts
    and the same measured ratios as training the reference beside each program, and catches the same bugs."""
    from autoshard.testing.equivalence import OneDeviceRun
    from autoshard.testing.noise_floor import NoiseFloor
    model, batches = _wide_model_and_batches()
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    run = OneDeviceRun(copy.deepcopy(model), batches, loss_fn=F.mse_loss, steps=3, optimizer=sgd, tol=NoiseFloor())
    assert run.float64 and len(run.losses) == 3
    for error, passes in ((0.0, True), (1e-6, False)):
        live, replayed = NoiseFloor(ratios=[]), NoiseFloor(ratios=[])
        verdicts = [train_against_one_device("split", SplitSumProgram(copy.deepcopy(model), error=error), ref,
                                             batches, loss_fn=F.mse_loss, tol=floor, gradients=_grads_match,
                                             optimizer=sgd)
                    for ref, floor in ((copy.deepcopy(model), live), (run, replayed))]
        assert verdicts[0] == verdicts[1] and (verdicts[0] == []) == passes, verdicts
        assert live.ratios == replayed.ratios and live.ratios
    # a fixed tolerance, a wrong loss: the same failures, the step-0 gradients the reference's
    fixed = OneDeviceRun(copy.deepcopy(model), batches, loss_fn=F.mse_loss, steps=3, optimizer=sgd)
    seen = []
    failures = train_against_one_device("scaled", EagerProgram(copy.deepcopy(model), loss_scale=2.0), fixed, batches,
                                        optimizer=sgd, check_gradients=lambda p, r: seen.append(r) or [])
    assert failures[0].startswith("scaled: loss at step 0 is ") and any("fc1.weight differs" in f for f in failures)
    assert all(p.grad is not None for p in seen[0].parameters())
