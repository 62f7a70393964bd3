"""Random ops under pipelines and accumulation draw what one device draws (issue 31, item 4).

One device running a step's microbatches in order draws, from one generator, stage 0's numbers for
microbatch 0, then stage 1's, ..., then microbatch 1's. ``runtime.rng_streams`` gives every pipelined
forward that position of the stream. The model is DiT-like (diffusers' ``DiTTransformer2DModel``
draws the same way): every block drops class labels with ``torch.rand(batch) < p``, so every stage
draws. On 4 gloo ranks, ``pp=2`` under 1F1B and interleaved 1F1B, and accumulation without a pipeline,
match one device running the same microbatches (losses, parameters, and where the generator ends).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import autoshard
from autoshard.passes.capture.export import capture
from autoshard.runtime.rng_streams import MicrobatchStreams
from autoshard.testing.equivalence import Tolerance, failures_of, train_against_one_device
from autoshard.testing.ranks import run_ranks

MICROBATCHES = 4


class LabelDropoutBlock(nn.Module):
    """A DiT block: adaLN modulation from (class label, timestep), attention and an MLP; in training the
    class label is dropped (replaced by the extra "no label" class) with probability ``p``."""

    def __init__(self, d: int, classes: int, p: float):
        super().__init__()
        self.classes, self.p = classes, p
        self.label = nn.Embedding(classes + 1, d)
        self.time = nn.Linear(d, d)
        self.modulation = nn.Linear(d, 2 * d)
        self.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, t_emb, labels):
        if self.training:
            dropped = torch.rand(labels.shape[0], device=labels.device) < self.p
            labels = torch.where(dropped, self.classes, labels)
        shift, scale = self.modulation(F.silu(self.label(labels) + self.time(t_emb))).chunk(2, -1)
        h = self.norm(x) * (1 + scale[:, None]) + shift[:, None]
        q, k, v = self.qkv(h).chunk(3, -1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v))
        return x + self.mlp(self.norm(x))


class TinyDiT(nn.Module):
    """Patch tokens (B, N, c) conditioned on an integer timestep and a class label, through label-dropping blocks."""

    def __init__(self, channels: int = 4, d: int = 16, blocks: int = 4, classes: int = 5, p: float = 0.5):
        super().__init__()
        self.d = d
        self.embed = nn.Linear(channels, d)
        self.blocks = nn.ModuleList(LabelDropoutBlock(d, classes, p) for _ in range(blocks))
        self.out = nn.Linear(d, channels)

    def forward(self, x, timestep, class_labels):
        half = self.d // 2
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=x.device) / half)
        angles = timestep.float()[:, None] * freqs[None]
        t_emb = torch.cat([angles.cos(), angles.sin()], -1)
        h = self.embed(x)
        for block in self.blocks:
            h = block(h, t_emb, class_labels)
        return self.out(h)


def _dit():
    torch.manual_seed(0)
    model = TinyDiT()
    inputs = (torch.randn(8, 4, 4), torch.randint(0, 1000, (8,)), torch.randint(0, 5, (8,)))
    return model, inputs, torch.randn(8, 4, 4), F.mse_loss


class _SameStream:
    """The program, with the generator's state before each step kept so the reference starts there."""

    def __init__(self, program):
        self.program, self.before, self.after = program, None, None

    def step(self, *inputs, target=None):
        self.before = torch.get_rng_state()
        loss = self.program.step(*inputs, target=target)
        self.after = torch.get_rng_state()
        return loss

    def parameters(self):
        return self.program.parameters()

    def full_state_dict(self):
        return self.program.full_state_dict()


def _microbatched(stream: _SameStream, microbatches: int, ends: list):
    """One device running the microbatches in order from the state the program started at."""
    def reference_loss(model, inputs, target):
        torch.set_rng_state(stream.before)
        parts = list(zip(*[t.chunk(microbatches) for t in inputs]))
        loss = sum(F.mse_loss(model(*p), y) for p, y in zip(parts, target.chunk(microbatches))) / microbatches
        ends.append(torch.equal(torch.get_rng_state(), stream.after))
        return loss
    return reference_loss


def random_ops_worker(rank: int, world: int) -> list:
    torch.set_num_threads(1)
    failures = []
    cases = [("pp=2 1f1b", dict(pp=2, microbatches=MICROBATCHES, schedule="1f1b"), MICROBATCHES),
             ("pp=2 interleaved-1f1b", dict(pp=2, microbatches=MICROBATCHES, schedule="interleaved-1f1b"),
              MICROBATCHES),
             ("accumulation=2", dict(accumulation=2), 2)]
    for label, options, k in cases:
        model, inputs, target, loss_fn = _dit()
        cm = autoshard.compile(model, (world,), example_inputs=inputs, loss_fn=loss_fn, example_target=target,
                               hardware="cpu", time_limit_s=5, **options)
        torch.manual_seed(7)  # the same stream on every rank, as one device has one
        stream, ends = _SameStream(cm), []
        failures += train_against_one_device(f"label dropout {label}", stream, copy.deepcopy(model), (inputs, target),
                                             reference_loss=_microbatched(stream, k, ends), steps=2,
                                             tol=Tolerance(rtol=1e-4, atol=2e-5),
                                             optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
        if not all(ends):
            failures.append(f"label dropout {label}: the generator ends elsewhere than one device's")
    return failures


def test_label_dropout_under_pipelines_and_accumulation_matches_one_device():
    failures = failures_of(run_ranks(random_ops_worker, 4, timeout=500))
    assert not failures, "\n".join(failures)


class _Draws(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.n = n

    def forward(self, x):
        return x + torch.rand(self.n, device=x.device)


def test_each_forward_starts_where_one_device_stream_is():
    """Two stages drawing 3 and 5 numbers per microbatch: stage 1's forward of microbatch k starts after
    k rounds of both stages and stage 0's draws of round k, exactly as one device runs them."""
    x = torch.zeros(2, 3)
    stages = [capture(_Draws(3), (x,)), capture(_Draws(3), (x,))]
    stages[1] = capture(_Draws(5), (torch.zeros(2, 5),))
    streams = MicrobatchStreams(stages, local=[1], microbatches=3, device=torch.device("cpu"))
    torch.manual_seed(3)
    streams.begin()
    for k in range(3):
        torch.manual_seed(3)
        for _ in range(k):
            torch.rand(3), torch.rand(5)
        torch.rand(3)
        want = torch.rand(5)
        streams.enter(1, k)
        assert torch.equal(torch.rand(5), want)
    torch.manual_seed(3)
    for _ in range(3):
        torch.rand(3), torch.rand(5)
    want = torch.get_rng_state()
    streams.end()
    assert torch.equal(torch.get_rng_state(), want)
