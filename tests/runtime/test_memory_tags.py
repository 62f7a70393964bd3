"""``testing.memory_tags.PeakTags``: what is alive at the measured peak, tagged by the op that made it."""
from __future__ import annotations

import torch

from autoshard.testing.memory_tags import PeakTags


def test_the_tags_at_the_peak_add_up_to_it_and_name_their_ops():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(512, 32)  # activations outweigh the parameters: the peak is in the backward
    model(x).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    tracker = PeakTags()
    tracker.track_external(model, optimizer)
    with tracker:
        model(x).square().mean().backward()
        optimizer.step()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"]
    at, rows = tracker.peak_tags()
    assert sum(b for b, _, _ in rows) == peak
    assert at[0] and at[1] and tracker.peak_phases.split("|")[0] == "backward"
    assert rows == sorted(rows, key=lambda r: (-r[0], r[1], str(r[2])))
    tagged = {(cat, tag) for _, cat, tag in rows if tag is not None}
    # ReLU's output, saved by its backward, made in the forward; its input's gradient, made by its backward
    assert ("Activation", ("relu.default", False, False, None, (512, 64))) in tagged
    assert any(tag.op == "threshold_backward.default" and tag.backward and tag.node == "ReluBackward0"
               for _, tag in tagged)
    # parameters and optimizer state were made before the tracker: untagged
    assert any(tag is None and cat == "Parameter" for _, cat, tag in rows)
