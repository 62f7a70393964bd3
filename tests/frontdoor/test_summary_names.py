"""Names in the summary: repeated blocks fold only where alike, no folded name appears twice, and a
1-D mesh's axis is not called ``dp``.

A ResNet stage's first block carries a downsample (a ``Sequential(conv, BatchNorm)``) the next block
lacks: folding them, or the conv and BatchNorm weights under ``downsample.#.weight``, mixed
different parameters under one name (issue 17, item 8)."""
from __future__ import annotations

from autoshard.passes.spec import Replicate, Shard
from autoshard.summary import placement_lines
from autoshard.summary import fold_names

R, S0 = (Replicate(), Replicate()), (Replicate(), Shard(0))


def test_only_alike_numbered_siblings_fold():
    names = ["layer1.0.conv1.weight", "layer1.1.conv1.weight", "layer3.0.conv1.weight",
             "layer3.0.downsample.0.weight", "layer3.0.downsample.1.weight", "layer3.0.downsample.1.bias",
             "layer3.1.conv1.weight", "blocks.0.experts.0.w", "blocks.0.experts.1.w", "blocks.1.experts.0.w",
             "blocks.1.experts.1.w"]
    folded = fold_names(names)
    assert folded["layer1.1.conv1.weight"] == "layer1.#.conv1.weight"
    assert folded["layer3.0.downsample.0.weight"] == "layer3.0.downsample.0.weight"  # conv stays apart from BN
    assert folded["layer3.0.downsample.1.weight"] == "layer3.0.downsample.1.weight"
    assert folded["layer3.1.conv1.weight"] == "layer3.1.conv1.weight"  # unlike its downsampling sibling
    assert set(folded[n] for n in names if n.startswith("blocks")) == {"blocks.#.experts.#.w"}


def test_a_folded_name_never_appears_twice():
    named = {"blocks.0.fc.weight": R, "blocks.1.fc.weight": S0, "blocks.0.fc.bias": R, "blocks.1.fc.bias": R}
    out: list[str] = []
    placement_lines(named, out)
    first = [line.split()[0] for line in out]
    assert len(first) == len(set(first))
    assert "blocks.0.fc.weight" in first and "blocks.1.fc.weight" in first  # placements differ: listed apart
    assert any(line.split()[0] == "blocks.#.fc.bias" and line.endswith("x2") for line in out)


def test_a_one_axis_mesh_is_not_called_data_parallel():
    """On (4,) the one axis may be tensor parallel: its default name must not say ``dp``."""
    from autoshard.passes.mesh import Mesh
    assert Mesh.of(4).axis_names == ("axis0",) and Mesh.of((4,)).axis_names == ("axis0",)
    assert Mesh.of((2, 2)).axis_names == ("dp", "tp")
