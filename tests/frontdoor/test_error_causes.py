"""Errors that name their cause: the loss arguments, and untraceable control flow at its file and line.

``loss_fn`` without ``example_target`` used to fail deep inside the loss function and be reported as
"a construct the tracers do not support at an unknown location"; now the message names the missing
argument and the model's output shape. Under ``compile`` every rank raises the same message (each
rank traces; nothing waits on rank 0).
"""
from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.testing.ranks import run_ranks


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x):
        return self.fc(x)


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return x


def test_loss_fn_without_example_target_names_the_argument_and_the_output_shape():
    with pytest.raises(TypeError) as info:
        autoshard.plan(MLP(), 2, example_inputs=(torch.randn(8, 4),), loss_fn=F.mse_loss, hardware="cpu")
    message = str(info.value)
    assert "loss_fn=mse_loss was given without example_target" in message
    assert "output has shape (8, 6)" in message and "(8,)" in message


def test_example_target_without_loss_fn_names_the_argument():
    with pytest.raises(TypeError, match=r"example_target \(a tensor of shape \(8, 6\)\) was given without loss_fn"):
        autoshard.plan(MLP(), 2, example_inputs=(torch.randn(8, 4),), example_target=torch.randn(8, 6),
                       hardware="cpu")


def test_data_dependent_branch_points_at_its_file_and_line():
    lines, first = inspect.getsourcelines(Branchy.forward)
    line = first + next(i for i, text in enumerate(lines) if "if x.sum() > 0" in text)
    with pytest.raises(autoshard.TraceError) as info:
        autoshard.plan(Branchy(), 2, example_inputs=(torch.randn(8, 4),), hardware="cpu")
    assert f"{__file__}:{line} in forward: `if x.sum() > 0:`" in str(info.value)


def missing_target_worker(rank: int, world: int) -> str:
    try:
        autoshard.compile(MLP(), (2,), example_inputs=(torch.randn(8, 4),), loss_fn=F.mse_loss, hardware="cpu")
    except TypeError as e:
        return str(e)
    return "compiled"


def test_every_rank_hears_the_missing_argument():
    messages = run_ranks(missing_target_worker, 2, init="env", timeout=60)
    assert len(set(messages)) == 1 and "without example_target" in messages[0]


class BadHeads(nn.Module):
    """A width of 10 viewed as 3 heads: the model itself fails, whatever traces it."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 10)

    def forward(self, x):
        return self.fc(x).view(x.shape[0], 3, -1)


def test_an_error_of_the_model_itself_is_not_blamed_on_the_tracers():
    lines, first = inspect.getsourcelines(BadHeads.forward)
    line = first + next(i for i, text in enumerate(lines) if ".view(" in text)
    with pytest.raises(autoshard.TraceError) as info:
        autoshard.plan(BadHeads(), 2, example_inputs=(torch.randn(8, 4),), hardware="cpu")
    message = str(info.value)
    assert "an error the model's forward raises on these example inputs (RuntimeError: shape" in message
    assert f"{__file__}:{line}" in message and "tracers do not support" not in message
