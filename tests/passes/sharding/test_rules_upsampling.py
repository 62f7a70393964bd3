"""Vision and audio ops a diffusion UNet or a super-resolution net meets at once: interpolation in
every mode and dimensionality, pixel (un)shuffle, transposed convolution, group norm and the pooling
variants. Every strategy the rules claim reproduces the unsharded op, forward and backward (rule
numerics), and none of them runs replicated only."""
import pytest
import torch
import torch.nn.functional as F

from autoshard.testing.rule_numerics import check_rule_numerics

D = torch.float64  # gradients of R operands are sums of random summands: float32 rounding is not the rule's
x2 = lambda: torch.randn(4, 6, 8, 8, dtype=D)  # noqa: E731
x1 = lambda: torch.randn(4, 6, 8, dtype=D)  # noqa: E731
x3 = lambda: torch.randn(4, 6, 4, 4, 4, dtype=D)  # noqa: E731

INTERPOLATIONS = {
    "nearest2d scale": (lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), x2),
    "nearest2d size": (lambda x: F.interpolate(x, size=(12, 10), mode="nearest"), x2),
    "nearest-exact2d": (lambda x: F.interpolate(x, scale_factor=2, mode="nearest-exact"), x2),
    "bilinear2d": (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False), x2),
    "bilinear2d aligned": (lambda x: F.interpolate(x, size=(11, 13), mode="bilinear", align_corners=True), x2),
    "bilinear2d antialias": (lambda x: F.interpolate(x, size=(5, 5), mode="bilinear", antialias=True), x2),
    "bicubic2d": (lambda x: F.interpolate(x, scale_factor=2, mode="bicubic", align_corners=False), x2),
    "nearest1d": (lambda x: F.interpolate(x, scale_factor=3), x1),
    "linear1d": (lambda x: F.interpolate(x, scale_factor=2, mode="linear"), x1),
    "nearest3d": (lambda x: F.interpolate(x, scale_factor=2), x3),
    "trilinear3d": (lambda x: F.interpolate(x, scale_factor=2, mode="trilinear"), x3),
}


@pytest.mark.parametrize("name", sorted(INTERPOLATIONS))
def test_interpolation_shards_batch_and_channels_and_passes_partials(name):
    fn, make = INTERPOLATIONS[name]
    result = check_rule_numerics(fn, (make(),))
    assert not result.skipped
    assert result.all_str == {"(R)->(R)", "(S(0))->(S(0))", "(S(1))->(S(1))", "(P)->(P)"}
    assert result.checked_str == result.all_str


@pytest.mark.parametrize("op", ["pixel_shuffle", "pixel_unshuffle"])
def test_pixel_shuffle_shards_every_dim(op):
    fn = (lambda x: F.pixel_shuffle(x, 2)) if op == "pixel_shuffle" else (lambda x: F.pixel_unshuffle(x, 2))
    x = torch.randn(4, 8, 6, 6, dtype=D) if op == "pixel_shuffle" else torch.randn(4, 2, 12, 12, dtype=D)
    result = check_rule_numerics(fn, (x,))
    assert not result.skipped
    assert {"(S(0))->(S(0))", "(S(1))->(S(1))", "(S(2))->(S(2))", "(S(3))->(S(3))", "(P)->(P)"} <= result.all_str
    assert result.checked_str == result.all_str


def test_conv_transpose_splits_batch_and_both_channel_dims():
    w, b = torch.randn(6, 4, 2, 2, dtype=D), torch.randn(4, dtype=D)
    result = check_rule_numerics(lambda x, w, b: F.conv_transpose2d(x, w, b, stride=2), (x2(), w, b))
    assert {"(S(0), R, R)->(S(0))", "(R, S(1), S(0))->(S(1))", "(S(1), S(0), P)->(P)"} <= result.checked_str
    assert not result.skipped and result.checked_str == result.all_str


def test_group_norm_shards_the_batch():
    w, b = torch.randn(6, dtype=D), torch.randn(6, dtype=D)
    result = check_rule_numerics(lambda x, w, b: F.group_norm(x, 3, w, b), (x2(), w, b))
    assert any(s.startswith("(S(0), R, R)->(S(0)") for s in result.checked_str)


POOLS = {
    "max_pool1d": (lambda x: F.max_pool1d(x, 2), x1, False),
    "avg_pool1d": (lambda x: F.avg_pool1d(x, 2), x1, True),
    "adaptive_avg_pool1d": (lambda x: F.adaptive_avg_pool1d(x, 3), x1, True),
    "adaptive_max_pool1d": (lambda x: F.adaptive_max_pool1d(x, 3), x1, False),
    "adaptive_max_pool2d": (lambda x: F.adaptive_max_pool2d(x, 3), x2, False),
    "max_pool3d": (lambda x: F.max_pool3d(x, 2), x3, False),
    "avg_pool3d": (lambda x: F.avg_pool3d(x, 2), x3, True),
    "adaptive_avg_pool3d": (lambda x: F.adaptive_avg_pool3d(x, 2), x3, True),
}


@pytest.mark.parametrize("name", sorted(POOLS))
def test_pooling_variants_shard_batch_and_channels(name):
    fn, make, linear = POOLS[name]
    result = check_rule_numerics(fn, (make(),))
    assert not result.skipped
    assert {"(S(0))->(S(0))", "(S(1))->(S(1))"} <= {s.replace(", S(0)", "").replace(", S(1)", "")
                                                     for s in result.all_str}
    assert ("(P)->(P)" in result.all_str) == linear
    assert result.checked_str == result.all_str


def test_a_small_diffusion_style_unet_plans_with_no_replicated_op():
    import torch.nn as nn

    import autoshard

    class TinyUNet(nn.Module):
        def __init__(self, c: int = 8):
            super().__init__()
            self.inc, self.gn = nn.Conv2d(3, c, 3, padding=1), nn.GroupNorm(2, c)
            self.down, self.pool = nn.Conv2d(c, 2 * c, 3, padding=1), nn.AvgPool2d(2)
            self.up = nn.Upsample(scale_factor=2, mode="nearest")
            self.up_t = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
            self.shuffle = nn.Sequential(nn.Conv2d(2 * c, 4 * 3, 3, padding=1), nn.PixelShuffle(2))
            self.out = nn.Conv2d(2 * c, 3 * 2 * 2, 1)

        def forward(self, x):
            h = F.silu(self.gn(self.inc(x)))
            d = self.pool(F.silu(self.down(h)))
            u = torch.cat([F.silu(self.up_t(d)), F.interpolate(d, scale_factor=2, mode="bilinear")[:, :8]], dim=1)
            return self.shuffle(self.up(u)) + F.pixel_shuffle(self.out(u), 2)[..., :16, :16].repeat(1, 1, 2, 2)

    with torch.device("meta"):
        model = TinyUNet()
    x = torch.empty(8, 3, 8, 8, device="meta")
    target = torch.empty(8, 3, 32, 32, device="meta")
    plan = autoshard.plan(model, (4,), example_inputs=(x,), loss_fn=F.mse_loss, example_target=target,
                          hardware="h100", time_limit_s=20)
    assert not plan.replicated_ops, plan.replicated_ops
