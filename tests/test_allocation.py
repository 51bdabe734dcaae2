"""Allocation strategies give back exactly the target z through Eq. (1)."""

import math

import pytest

from dpcore import allocation
from dpcore.queries import effective_noise_multiplier

SIZES = {"conv.weight": 250, "conv.bias": 10, "fc.weight": 5000, "fc.bias": 50}


@pytest.mark.parametrize("clip_split", allocation.CLIP_SPLITS)
@pytest.mark.parametrize("noise_split", allocation.NOISE_SPLITS)
@pytest.mark.parametrize("z", [0.3, 1.1, 7.0])
def test_per_layer_allocations_give_back_the_target_z(clip_split, noise_split, z):
    m = allocation.per_layer(SIZES, total_clip=2.0, noise_multiplier=z, clip_split=clip_split,
                             noise_split=noise_split)
    assert m.noise_multiplier == pytest.approx(z, rel=1e-12)
    # the whole record stays within the total bound
    assert math.sqrt(sum(g.clip ** 2 for g in m.groups)) == pytest.approx(2.0, rel=1e-12)


def test_clip_splits():
    assert allocation.split_clip(2.0, [1, 1, 1, 1]) == [1.0] * 4
    dim = allocation.split_clip(3.0, [1, 8], "dimension")
    assert dim == pytest.approx([1.0, math.sqrt(8)])


def test_noise_splits_follow_the_paper():
    clips = [1.0, 2.0]
    assert allocation.allocate_noise(clips, [10, 30], 0.5, "proportional") == pytest.approx(
        [0.5 * math.sqrt(2) * 1.0, 0.5 * math.sqrt(2) * 2.0])
    assert allocation.allocate_noise(clips, [10, 30], 0.5, "dimension") == pytest.approx(
        [0.5 * math.sqrt(4) * 1.0, 0.5 * math.sqrt(40 / 30) * 2.0])
    for how in allocation.NOISE_SPLITS:
        noise = allocation.allocate_noise(clips, [10, 30], 0.5, how)
        assert effective_noise_multiplier(zip(clips, noise)) == pytest.approx(0.5, rel=1e-12)


def test_flat_and_grouped():
    m = allocation.flat(list(SIZES), clip=1.5, noise_multiplier=1.1)
    assert len(m.groups) == 1 and m.groups[0].noise_std == pytest.approx(1.65)
    g = allocation.grouped({"conv": ["conv.weight", "conv.bias"], "fc": ["fc.weight", "fc.bias"]},
                           SIZES, total_clip=1.0, noise_multiplier=2.0, clip_split="dimension",
                           noise_split="dimension")
    assert [grp.name for grp in g.groups] == ["conv", "fc"]
    assert g.groups[0].clip == pytest.approx(math.sqrt(260 / 5310))
    assert g.noise_multiplier == pytest.approx(2.0, rel=1e-12)
    one = allocation.grouped({"w": "fc.weight", "rest": ["conv.weight", "conv.bias", "fc.bias"]},
                             SIZES, total_clip=1.0, noise_multiplier=2.0)  # a name: one leaf
    assert one.groups[0].leaves == ("fc.weight",) and one.leaves[0] == "fc.weight"


def test_bad_allocation_arguments():
    with pytest.raises(ValueError, match="clip split must be one of"):
        allocation.split_clip(1.0, [1], "layer")
    with pytest.raises(ValueError, match="noise split must be one of"):
        allocation.allocate_noise([1.0], [1], 1.0, "equal")
    with pytest.raises(ValueError, match="noise_multiplier must be finite and >= 0, got -1"):
        allocation.flat(["w"], 1.0, -1.0)
    with pytest.raises(ValueError, match="total_clip must be finite and > 0, got 0"):
        allocation.per_layer(SIZES, 0.0, 1.0)
    with pytest.raises(ValueError, match="group dimension must be an integer >= 1, got 0"):
        allocation.split_clip(1.0, [0])
    with pytest.raises(ValueError, match=r"lacks the size of leaves \['x'\]"):
        allocation.grouped({"a": ["x"]}, SIZES, 1.0, 1.0)


def test_a_leaf_named_alone_is_one_leaf_and_leaf_sizes_are_counts():
    """flat("fc.bias", ...) clipped the leaves 'f', 'c', '.', ...; a size of -3 shrank its
    group's dimension and with it the dimension split's clips."""
    assert allocation.flat("fc.bias", 1.0, 1.0).leaves == ("fc.bias",)
    with pytest.raises(ValueError, match=r"the size of leaf 'b' must be an integer >= 0, got -3"):
        allocation.per_layer({"a": 5, "b": -3, "c": 2}, 1.0, 1.0, clip_split="dimension")
    with pytest.raises(TypeError, match=r"the size of leaf 'a' must be an integer, got 2.5"):
        allocation.grouped({"g": ["a"]}, {"a": 2.5}, 1.0, 1.0)


def test_sizes_add_up_as_python_ints_and_an_empty_group_is_named():
    """uint8 sizes 200 + 200 wrapped to 144 (int32 ones went negative) and split the clip
    wrongly; a leaf of size 0 alone in its group was refused naming neither."""
    import numpy as np

    sizes = {"a": np.uint8(200), "b": np.uint8(200), "c": np.uint8(1)}
    mechanism = allocation.grouped({"x": ("a", "b"), "y": ("c",)}, sizes, 1.0, 1.0,
                                   clip_split="dimension")
    assert [g.clip for g in mechanism.groups] == pytest.approx(
        [(400 / 401) ** 0.5, (1 / 401) ** 0.5])
    with pytest.raises(ValueError, match=r"groups \['empty'\] hold no values \(leaves of size "
                                         r"0: \['empty'\]\)"):
        allocation.per_layer({"w": 100, "empty": 0, "b": 10}, 1.0, 1.0)
