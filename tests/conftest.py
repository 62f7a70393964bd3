"""Every test starts from the same random state, whatever ran before it in the session, so a test's
inputs (and any random plan it draws without its own seed) are the same on every run and in any order."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch


@pytest.fixture(autouse=True)
def _same_random_state_every_test():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield
