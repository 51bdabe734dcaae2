"""Mechanism specs: validation of every field, and Eq. (1)."""

import math
import pickle

import pytest

from dpcore.queries import Group, Mechanism, effective_noise_multiplier, noise_multiplier_left


def test_eq1_combines_privacy_tuples():
    tuples = [(1.0, 2.0), (3.0, 1.5), (0.5, 0.25)]
    expected = 1 / math.sqrt(sum((s / sigma) ** 2 for s, sigma in tuples))
    assert effective_noise_multiplier(tuples) == pytest.approx(expected, rel=1e-15)
    assert effective_noise_multiplier([(2.0, 3.0)]) == pytest.approx(1.5)
    assert effective_noise_multiplier([]) == math.inf
    assert effective_noise_multiplier([(1.0, 1.0), (1.0, 0.0)]) == 0.0


def test_the_multiplier_left_completes_the_step_by_eq1():
    for total, others in [(1.0, [5.0]), (0.7, [2.0, 3.0, 40.0]), (2.0, [])]:
        left = noise_multiplier_left(total, others, "they", "advice")
        tuples = [(1.0, z) for z in (left, *others)]
        assert effective_noise_multiplier(tuples) == pytest.approx(total, rel=1e-12)
    assert noise_multiplier_left(0.0, [1.0], "they", "advice") == 0.0  # non-private run
    with pytest.raises(ValueError, match=r"^the counts spend all of the step's noise "
                                         r"multiplier 1 \(1/z\^2 = 1 against 1\.04 .*: more"):
        noise_multiplier_left(1.0, [5.0, 1.0], "the counts", "more")
    with pytest.raises(ValueError, match="spend all"):
        noise_multiplier_left(1.0, [0.0], "a noiseless query", "add noise")
    with pytest.raises(ValueError, match="noise_multiplier must be finite and >= 0, got -1"):
        noise_multiplier_left(-1.0, [], "they", "advice")


def test_mechanism_noise_multiplier_and_leaves():
    m = Mechanism((Group("a", ("w", "b"), 1.0, 2.0), Group("c", "x", 2.0, 2.0, scales=(3.0,))))
    assert m.leaves == ("w", "b", "x")
    assert m.noise_multiplier == pytest.approx((0.25 + 1.0) ** -0.5)
    assert m.group_of("x").leaf_noise_std("x") == 6.0
    assert m.group_of("w").leaf_noise_std("w") == 2.0
    assert m.with_noise({"a": 4.0, "c": 4.0}).noise_multiplier == pytest.approx(
        (1 / 16 + 1 / 4) ** -0.5)


@pytest.mark.parametrize("kwargs, message", [
    (dict(clip=0.0), r"clip must be finite and > 0, got 0\.0"),
    (dict(clip=-1.0), r"clip must be finite and > 0, got -1\.0"),
    (dict(clip=math.inf), r"clip must be finite and > 0, got inf"),
    (dict(clip=math.nan), r"clip must be a number, got NaN"),
    (dict(noise_std=-0.1), r"noise_std must be finite and >= 0, got -0\.1"),
    (dict(noise_std="1"), r"noise_std must be a real number, got '1'"),
    (dict(scales=(1.0, 0.0)), r"scale of 'b' must be finite and > 0, got 0\.0"),
    (dict(scales=(1.0, -2.0)), r"scale of 'b' must be finite and > 0, got -2\.0"),
    (dict(scales=(1.0,)), r"1 scales for 2 leaves"),
    # a set's order is its hash's: the scales went to other leaves from run to run
    (dict(leaves={"a", "b"}, scales=(1.0, 100.0)), r"leaves must be ordered .* got a set"),
    (dict(scales=(s for s in (1.0, 2.0))), r"scales must be a list or tuple"),  # was "0 scales"
    (dict(scales=2.0), r"scales must be a list or tuple of one scale per leaf, got 2\.0"),
    # 1/alpha^2 of 1e24 is 0 in float32: leaf b escaped its group's clip (10x the clip)
    (dict(scales=(1.0, 1e24)), r"scale of 'b' must lie in \[1e-12, 1e\+12\], got 1e\+24"),
    (dict(scales=(1e-160, 1.0)), r"scale of 'a' must lie in"),
    (dict(leaves=()), r"leaves must be non-empty"),
    (dict(leaves=("a", "a")), r"leaves \['a'\] appear more than once"),
    (dict(name=""), r"group name must be a non-empty string"),
])
def test_group_rejects_bad_values(kwargs, message):
    args = dict(name="g", leaves=("a", "b"), clip=1.0, noise_std=1.0) | kwargs
    with pytest.raises((ValueError, TypeError), match=message):
        Group(**args)


def test_mechanism_rejects_overlap_and_duplicates():
    with pytest.raises(ValueError, match="leaf 'w' is in both group 'a' and group 'b'"):
        Mechanism((Group("a", ("w",), 1, 1), Group("b", ("w", "x"), 1, 1)))
    with pytest.raises(ValueError, match=r"repeated: \['a'\]"):
        Mechanism((Group("a", ("w",), 1, 1), Group("a", ("x",), 1, 1)))
    with pytest.raises(ValueError, match="at least one group"):
        Mechanism(())
    with pytest.raises(ValueError, match="record must be one of"):
        Mechanism(Group("a", "w", 1, 1), record="batch")
    with pytest.raises(ValueError, match="microbatch_size must be an integer >= 1, got 0"):
        Mechanism(Group("a", "w", 1, 1), record="microbatch", microbatch_size=0)
    with pytest.raises(TypeError, match="microbatch_size must be an integer"):
        Mechanism(Group("a", "w", 1, 1), record="microbatch")
    with pytest.raises(ValueError, match="only meaningful for record='microbatch'"):
        Mechanism(Group("a", "w", 1, 1), microbatch_size=4)


def test_check_leaves_names_missing_and_extra():
    m = Mechanism((Group("a", ("w", "b"), 1, 1),))
    m.check_leaves(["b", "w"])
    with pytest.raises(ValueError, match=r"in no group: \['x'\].*lacks: \['b'\]"):
        m.check_leaves(["w", "x"])


def test_derived_properties_are_read_only_and_survive_pickling():
    """``leaves`` and ``group_index`` are computed once per (immutable) mechanism; a pickled
    mechanism carries its fields only and equals the original, caches and all."""
    m = Mechanism((Group("a", ("w", "b"), 1.0, 2.0), Group("c", "x", 2.0, 2.0)))
    assert dict(m.group_index) == {"w": 0, "b": 0, "x": 1}
    assert m.leaves is m.leaves
    with pytest.raises(TypeError):
        m.group_index["w"] = 1
    m.check_leaves({"x", "w", "b"})  # the cached fast path
    with pytest.raises(ValueError, match=r"lacks: \['x'\]"):
        m.check_leaves(["w", "b"])
    copy = pickle.loads(pickle.dumps(m))
    assert copy == m and hash(copy) == hash(m)
    assert copy.leaves == m.leaves and dict(copy.group_index) == dict(m.group_index)
    other = Mechanism((Group("a", ("w", "b"), 1.0, 2.0), Group("c", "x", 2.0, 2.0)))
    assert {m: 1}[other] == 1  # equal mechanisms stay interchangeable as cache keys


def test_a_query_whose_clip_dwarfs_its_noise_is_noiseless_not_an_overflow():
    """(S / sigma)^2 past float64's range (S / sigma > 1.3e154) raised OverflowError; the
    query is as good as noiseless: z = 0, epsilon infinite."""
    assert effective_noise_multiplier([(1e160, 1.0)]) == 0.0
    assert effective_noise_multiplier([(1e160, 1.0), (1.0, 1.0)]) == 0.0
