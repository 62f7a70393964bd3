"""A loss that fails on the model's output is named as the cause, not the model's forward at "an
unknown location" (issue 17, item 8); a forward that fails is still the forward's error."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autoshard.passes.capture.export import capture
from autoshard.passes.errors import TraceError


def test_a_wrong_target_shape_names_the_loss():
    with pytest.raises(TraceError, match=r"loss_fn failed on the model's output \(shapes \[\(8, 4\)\]\) and "
                                         r"example_target \(shape \(8, 3\)\)") as info:
        capture(nn.Linear(4, 4), (torch.randn(8, 4),), loss_fn=F.mse_loss, target=torch.randn(8, 3))
    assert "unknown location" not in str(info.value) and "forward raises" not in str(info.value)


class _BadForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) + torch.ones(3)  # fails whatever the loss


def test_a_failing_forward_is_not_blamed_on_the_loss():
    with pytest.raises(TraceError) as info:
        capture(_BadForward(), (torch.randn(8, 4),), loss_fn=F.mse_loss, target=torch.randn(8, 4))
    assert "loss_fn failed" not in str(info.value)
