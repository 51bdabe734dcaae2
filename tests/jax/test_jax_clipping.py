"""The compiled clipping kernel: clipped sums against a float64 oracle for every model and
rule (ghost norms, book-keeping, vmap, chunks), groups and joint clipping, padding and
non-finite records."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dpcore
from dpcore_jax import ghost
from dpcore_jax.backend import one_example_loss
from dpcore_jax.clipping import clipped_sums
from dpcore_jax.names import leaf_names, leaf_sizes, named_leaves

import cancelling
import jax_models as models

# float32 against float64 on values of order 1 (see test_jax_backend.F32_TOL); sums over a
# few records and clip factors add a few roundings each.
TOL = 2000 * 2.0 ** -24


def mechanism_for(params, kind):
    """Per-layer groups with clips small enough to clip, plus one joint group."""
    sizes = leaf_sizes(params)
    names = list(sizes)
    joint, rest = names[:2], names[2:]
    groups = [dpcore.Group("joint", tuple(joint), clip=0.4, noise_std=0.0, scales=(1.0, 3.0))]
    if rest:
        groups.append(dpcore.Group("rest", tuple(rest), clip=0.3, noise_std=0.0))
    return dpcore.Mechanism(tuple(groups))


def oracle_sums(per_example, mechanism, mask):
    out = {}
    for group in mechanism.groups:
        sq = sum((per_example[leaf].reshape(len(mask), -1) ** 2).sum(1) / group.scale(leaf) ** 2
                 for leaf in group.leaves)
        factor = np.minimum(1.0, group.clip / np.sqrt(sq)) * mask
        for leaf in group.leaves:
            out[leaf] = np.tensordot(factor, per_example[leaf], axes=1)
    return out


def assert_close(actual, expected, what):
    for leaf, value in expected.items():
        np.testing.assert_allclose(actual[leaf], value, rtol=TOL,
                                   atol=TOL * max(np.abs(value).max(), 1e-6), err_msg=f"{what} {leaf}")


_ORACLES = {}


def oracle(kind):
    """Float64 per-example gradients of the batch of seed 2, computed once per model."""
    if kind not in _ORACLES:
        rng = np.random.default_rng(2)
        loss_fn, params = models.model(rng, kind)
        _ORACLES[kind] = models.float64_oracle(loss_fn, params, models.data(rng, kind, 8))
    return _ORACLES[kind]


CASES = ([(kind, "ghost", None) for kind in models.KINDS]
         + [("cnn", "vmap", None), ("transformer", "vmap", None), ("tied", "vmap", None),
            ("mlp", "ghost", 4), ("cnn", "ghost", 4), ("transformer", "ghost", 4)])


@pytest.mark.parametrize("kind,method,chunk", CASES)
def test_clipped_sums_match_the_float64_oracle(kind, method, chunk):
    rng = np.random.default_rng(2)
    loss_fn, params = models.model(rng, kind)
    batch = models.data(rng, kind, 8)
    mask = np.array([1, 1, 0, 1, 1, 1, 0, 1], bool)
    mechanism = mechanism_for(params, kind)
    sums, nonfinite = jax.jit(clipped_sums(loss_fn, mechanism, chunk_size=chunk, method=method))(
        params, batch, mask)
    assert int(nonfinite) == 0
    assert jax.tree_util.tree_structure(sums) == jax.tree_util.tree_structure(params)
    expected = oracle_sums(oracle(kind), mechanism, mask)
    assert_close(named_leaves(sums), expected, f"{kind}/{method}/{chunk}")


def test_ghost_plan_finds_one_site_per_leaf_and_falls_back_for_shared_weights():
    rng = np.random.default_rng(3)
    loss_fn, params = models.model(rng, "transformer")
    example = jax.tree_util.tree_map(lambda a: a[0], models.data(rng, "transformer", 1))
    plan = ghost.plan(loss_fn, params, example)
    rules = {s.leaf: s.eqn.primitive.name for s in plan.sites}
    assert rules == {"embed": "gather", "attn/qkv": "dot_general", "attn/out": "dot_general",
                     "head/w": "dot_general", "head/b": "broadcast_in_dim",
                     "norm/scale": "broadcast_in_dim", "norm/bias": "broadcast_in_dim"}
    assert plan.fallback == ()
    assert {s.leaf: ghost.rule(s) for s in plan.sites} == {
        "embed": "rows", "attn/qkv": "dense", "attn/out": "dense", "head/w": "dense",
        "head/b": "formed", "norm/scale": "formed", "norm/bias": "formed"}
    loss_fn, params = models.model(rng, "einsum")
    example = jax.tree_util.tree_map(lambda a: a[0], models.data(rng, "einsum", 1))
    assert {ghost.rule(s) for s in ghost.plan(loss_fn, params, example).sites} == {"dense"}
    loss_fn, params = models.model(rng, "tied")
    example = jax.tree_util.tree_map(lambda a: a[0], models.data(rng, "tied", 1))
    plan = ghost.plan(loss_fn, params, example)
    assert plan.fallback == ("w",) and [s.leaf for s in plan.sites] == ["v"]


def test_ghost_norms_of_dense_sequences_and_embeddings_match_per_example_gradients():
    """Both branches of the dense rule (Gram matrices and the formed product) and the
    embedding rule against materialised per-example gradients."""
    rng = np.random.default_rng(4)
    # P = 6 positions: "wide" has P (C + F) = 480 <= C F = 1600 (Gram matrices),
    # "narrow" P (C + F) = 246 > C F = 40 (the product a^T g is formed)
    params = {"embed": jnp.asarray(rng.normal(size=(7, 40)) / 6, jnp.float32),
              "wide": jnp.asarray(rng.normal(size=(40, 40)) / 6, jnp.float32),
              "narrow": jnp.asarray(rng.normal(size=(40, 1)) / 6, jnp.float32)}

    def loss(p, tokens):
        h = jnp.tanh(p["embed"][tokens] @ p["wide"])  # tokens repeat within a record
        return jnp.sum(h @ p["narrow"], axis=(1, 2))

    tokens = rng.integers(0, 4, size=(5, 6))
    plan = ghost.plan(loss, params, tokens[0])
    assert [ghost.rule(s) for s in plan.sites] == ["rows", "dense", "dense"]
    mechanism = dpcore.per_layer(leaf_sizes(params), 1.0, 0.0)
    compiled = jax.jit(clipped_sums(loss, mechanism)).lower(params, tokens).compile().as_text()
    assert "f32[5,7,40]" not in compiled  # no per-example embedding gradient is formed
    sums, _ = jax.jit(clipped_sums(loss, mechanism))(params, tokens)
    per_example = jax.vmap(jax.grad(one_example_loss(loss)), in_axes=(None, 0))(params, tokens)
    expected = oracle_sums({k: np.asarray(v, np.float64) for k, v in per_example.items()},
                           mechanism, np.ones(5))
    assert_close(sums, expected, "sequence")


def test_dense_products_and_ghost_norms_give_the_oracles_clipped_sums():
    """Dense sites on sequences by both routes: Gram-matrix norms with a book-keeping sum, or
    formed products a_i^T g_i giving norm and sum (laid out as W, also for a weight on the
    left of its product), against per-example gradients, with clips below every norm."""
    rng = np.random.default_rng(9)
    params = {"wide": jnp.asarray(rng.normal(size=(12, 10)) / 3, jnp.float32),
              "left": jnp.asarray(rng.normal(size=(3, 10)) / 3, jnp.float32)}

    def loss(p, x):  # x (B, 5, 12): P = 5 positions
        h = jnp.tanh(x @ p["wide"])                       # W (C, F) on the right
        return jnp.sum(jnp.tanh(jnp.einsum("fc,bpc->bfp", p["left"], h)) ** 2, axis=(1, 2))

    x = jnp.asarray(rng.normal(size=(6, 5, 12)), jnp.float32)
    plan = ghost.plan(loss, params, x[0])
    assert [ghost.rule(s) for s in plan.sites] == ["dense", "dense"]
    assert not ghost.forms_products(5, 12, 10)  # wide: C F = 120 > P (C + F) = 110: Gram
    assert ghost.forms_products(5, 10, 3)       # left: C F = 30 <= 65: formed
    mechanism = dpcore.per_layer(leaf_sizes(params), 1e-3, 0.0)
    sums, _ = jax.jit(clipped_sums(loss, mechanism))(params, x)
    per_example = jax.vmap(jax.grad(one_example_loss(loss)), in_axes=(None, 0))(params, x)
    expected = oracle_sums({k: np.asarray(v, np.float64) for k, v in per_example.items()},
                           mechanism, np.ones(6))
    assert_close(sums, expected, "dense")


@pytest.mark.parametrize("limit", [64, 0])
def test_embedding_norms_by_both_routes_match_per_example_gradients(monkeypatch, limit):
    """The row-gather rule's norms by the ghost identity (few positions) and from the rows a
    record touches (many positions; forced here by a limit of 0) against per-example
    gradients, read off the clip factors (the clip is below every norm)."""
    monkeypatch.setattr(ghost, "ROWS_GHOST_POSITIONS", limit)
    rng = np.random.default_rng(8)
    params = {"embed": jnp.asarray(rng.normal(size=(9, 6)), jnp.float32),
              "out": jnp.asarray(rng.normal(size=(6, 2)), jnp.float32)}

    def loss(p, tokens):
        return jnp.sum(jnp.tanh(p["embed"][tokens]) @ p["out"], axis=(1, 2))

    tokens = rng.integers(0, 9, size=(5, 8))
    tokens[0, :4], tokens[1] = 3, 5  # repeats within a record; a record of one token
    plan = ghost.plan(loss, params, tokens[0])
    assert [ghost.rule(s) for s in plan.sites][0] == "rows"
    mechanism = dpcore.flat(list(params), 1e-3, 0.0)
    _, _, factors = jax.jit(clipped_sums(loss, mechanism, with_factors=True))(params, tokens)
    per_example = jax.vmap(jax.grad(one_example_loss(loss)), in_axes=(None, 0))(params, tokens)
    sq = sum((np.asarray(g, np.float64).reshape(5, -1) ** 2).sum(1)
             for g in per_example.values())
    np.testing.assert_allclose(np.asarray(factors)[:, 0], 1e-3 / np.sqrt(sq), rtol=1e-5)


@pytest.mark.parametrize("limit", [64, 0])
def test_out_of_range_ids_count_in_neither_norm_nor_sum(monkeypatch, limit):
    """Plain ``E[ids]`` with an id outside [0, V): its forward reads the clamped row, its
    gradient drops the row. The rows rule clamped the id for the norm: a record whose two
    lookups cancelled in the norm released a gradient of norm 1 under a clip of 0.01. Now
    its norm and sum agree with the per-example gradients (vmap), at both routes."""
    monkeypatch.setattr(ghost, "ROWS_GHOST_POSITIONS", limit)
    params = {"E": jnp.zeros((2, 3), jnp.float32)}
    u = jnp.array([1.0, 0.0, 0.0])

    def loss(p, ids):
        h = p["E"][ids]  # id 2 is out of range: clamped to 1 forward
        return (h[:, 0] - h[:, 1]) @ u

    ids = jnp.array([[2, 1], [0, 1], [1, 5]], jnp.int32)
    assert ghost.rule(ghost.plan(loss, params, ids[0]).sites[0]) == "rows"
    mechanism = dpcore.flat(["E"], 0.01, 0.0)
    got = {method: jax.jit(clipped_sums(loss, mechanism, method=method, with_factors=True))(
        params, ids) for method in ("ghost", "vmap")}
    np.testing.assert_allclose(got["ghost"][2], got["vmap"][2], rtol=1e-6)
    np.testing.assert_allclose(got["ghost"][0]["E"], got["vmap"][0]["E"], atol=1e-7)
    for row in range(3):  # each record alone: at most its clip
        alone = jax.jit(clipped_sums(loss, mechanism))(params, ids[row:row + 1]).sums["E"]
        assert float(jnp.linalg.norm(alone)) <= 0.01 * (1 + 1e-5), row


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_leaves_that_are_not_floating_are_refused(method):
    """An integer leaf the loss does not read got noise added to it (a counter drifted from
    7 to 5 over five optax steps); one it reads failed with JAX's float0 error."""
    run = clipped_sums(lambda q, x: jnp.sum(x * q["w"], axis=1),
                       dpcore.flat(["count", "w"], 1.0, 0.0), method=method)
    with pytest.raises(TypeError, match=r"floating arrays; leaves \['count'\]"):
        jax.jit(run)({"count": jnp.int32(7), "w": jnp.zeros(3)}, jnp.ones((2, 3)))


def test_padded_rows_change_nothing_even_when_they_hold_nan():
    rng = np.random.default_rng(5)
    loss_fn, params = models.model(rng, "cnn")
    x, y = models.data(rng, "cnn", 6)
    mechanism = mechanism_for(params, "cnn")
    run = jax.jit(clipped_sums(loss_fn, mechanism))
    real, _ = run(params, (x, y), np.ones(6, bool))
    x_pad = np.concatenate([x, np.full((4,) + x.shape[1:], np.nan, np.float32)])
    y_pad = np.concatenate([y, np.zeros(4, y.dtype)])
    padded, nonfinite = run(params, (x_pad, y_pad), np.arange(10) < 6)
    assert int(nonfinite) == 0  # padded rows are not records: not counted
    for a, b in zip(jax.tree_util.tree_leaves(real), jax.tree_util.tree_leaves(padded)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", [k for k in models.KINDS if k != "transformer"])
@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_nonfinite_records_get_weight_zero_and_are_counted(kind, bad):
    """Every rule (book-keeping sums and sums of formed per-example gradients) gives a
    record with a non-finite input weight 0, not a NaN sum."""
    rng = np.random.default_rng(6)
    loss_fn, params = models.model(rng, kind)
    x, y = models.data(rng, kind, 5)
    mechanism = mechanism_for(params, kind)
    run = jax.jit(clipped_sums(loss_fn, mechanism))
    clean, _ = run(params, (x[:4], y[:4]))
    x[4] = bad
    dirty, nonfinite = run(params, (x, y))
    assert int(nonfinite) == 1
    for a, b in zip(jax.tree_util.tree_leaves(clean), jax.tree_util.tree_leaves(dirty)):
        assert np.all(np.isfinite(b))
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_named():
    rng = np.random.default_rng(7)
    loss_fn, params = models.model(rng, "logistic")
    batch = models.data(rng, "logistic", 6)
    mechanism = dpcore.flat(["w"], 1.0, 0.0)
    with pytest.raises(ValueError, match="leaves in no group: \\['b'\\]"):
        clipped_sums(loss_fn, mechanism)(params, batch)
    good = dpcore.flat(leaf_names(params), 1.0, 0.0)
    with pytest.raises(ValueError, match="chunks of 4"):
        clipped_sums(loss_fn, good, chunk_size=4)(params, batch)
    with pytest.raises(ValueError, match="mask must have shape \\(6,\\)"):
        clipped_sums(loss_fn, good)(params, batch, np.ones(5, bool))
    with pytest.raises(ValueError, match="method must be one of"):
        clipped_sums(loss_fn, good, method="fast")
    with pytest.raises(ValueError, match="chunk_size must be a positive int"):
        clipped_sums(loss_fn, good, chunk_size=0)


CONVS = {  # name: (input shape of one example, kernel shape, conv keyword arguments, rule)
    "nhwc_stride_same_dilated": ((9, 8, 2), (3, 2, 2, 3), dict(
        window_strides=(2, 1), padding="SAME", rhs_dilation=(1, 2),
        dimension_numbers=("NHWC", "HWIO", "NHWC")), "conv"),
    "nchw_explicit_padding": ((2, 7, 6), (3, 2, 3, 2), dict(
        window_strides=(1, 2), padding=((2, 0), (1, 3)),
        dimension_numbers=("NCHW", "OIHW", "NCHW")), "conv"),
    "conv1d_causal": ((10, 3), (4, 3, 2), dict(
        window_strides=(3,), padding=((3, 0),), dimension_numbers=("NWC", "WIO", "NWC")),
        "conv"),
    "feature_groups": ((6, 6, 4), (3, 3, 2, 4), dict(
        window_strides=(1, 1), padding="VALID", feature_group_count=2,
        dimension_numbers=("NHWC", "HWIO", "NHWC")), "formed"),
}


@pytest.mark.parametrize("name", list(CONVS))
def test_convolution_norms_by_kernel_offsets_match_the_float64_oracle(name):
    """The "conv" rule (one product per kernel offset) for strides, SAME and asymmetric
    padding, kernel dilation, NCHW and 1-D layouts; grouped convolutions stay "formed"."""
    from jax import lax

    shape, kernel, kwargs, expected_rule = CONVS[name]
    rng = np.random.default_rng(7)
    params = {"conv": (0.5 * rng.normal(size=kernel)).astype(np.float32),
              "out": (0.3 * rng.normal(size=(3,))).astype(np.float32)}

    def loss_fn(p, batch):
        x, y = batch
        h = jnp.tanh(lax.conv_general_dilated(x, p["conv"], **kwargs))
        return (jnp.sum(h.reshape(h.shape[0], -1), axis=1) * p["out"][y] - 1.0) ** 2

    batch = (rng.normal(size=(6, *shape)).astype(np.float32), rng.integers(0, 3, size=6))
    example = jax.tree_util.tree_map(lambda a: a[0], batch)
    sites = {s.leaf: ghost.rule(s) for s in ghost.plan(loss_fn, params, example).sites}
    assert sites["conv"] == expected_rule
    mechanism = dpcore.Mechanism((dpcore.Group("all", ("conv", "out"), clip=0.5, noise_std=0.0),))
    mask = np.ones(6, bool)
    sums, _ = jax.jit(clipped_sums(loss_fn, mechanism))(params, batch, mask)
    per_example = models.float64_oracle(loss_fn, params, batch)
    norms = np.sqrt(sum((per_example[k].reshape(6, -1) ** 2).sum(1) for k in ("conv", "out")))
    assert (norms > 0.5).sum() >= 3  # the clip binds, so the norms matter
    assert_close(named_leaves(sums), oracle_sums(per_example, mechanism, mask), name)


def _shared_operation_models():
    """Losses where one operation takes two leaves, or control flow takes a leaf."""
    def lora(p, batch):  # W0 + A @ B with C = r = F: shapes that would line up
        x, y = batch
        return jnp.sum((jnp.tanh(x @ (p["W0"] + p["A"] @ p["B"])) - y) ** 2, axis=1)

    def scaled(p, batch):
        x, y = batch
        return jnp.sum((jnp.tanh(x @ (p["W"] * p["s"])) - y) ** 2, axis=1)

    def concatenated(p, batch):
        x, y = batch
        return jnp.sum((jnp.tanh(x @ jnp.concatenate([p["a"], p["b"]], axis=1)) - y) ** 2,
                       axis=1)

    def branching(p, batch):
        x, y = batch
        h = jax.lax.cond(jnp.sum(x) > 0, lambda w: x @ w, lambda w: -(x @ w), p["W"])
        return jnp.sum((jnp.tanh(h) - y) ** 2, axis=1)

    rng = np.random.default_rng(12)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / 2, jnp.float32)  # noqa: E731
    return {"lora": (lora, {"W0": normal(3, 3), "A": normal(3, 3), "B": normal(3, 3)}),
            "scaled": (scaled, {"W": normal(3, 3), "s": normal(3)}),
            "concatenated": (concatenated, {"a": normal(3, 2), "b": normal(3, 1)}),
            "branching": (branching, {"W": normal(3, 3)})}


@pytest.mark.parametrize("name", ["lora", "scaled", "concatenated", "branching"])
def test_leaves_sharing_an_operation_or_under_control_flow_take_the_fallback(name):
    """A site's rule takes every other input of its operation as data: two leaves in one
    operation (a LoRA update) would each see the other as data; cond's branches are not one
    operation. The ghost method's clipped sums equal the vmap method's."""
    loss_fn, params = _shared_operation_models()[name]
    rng = np.random.default_rng(13)
    batch = (jnp.asarray(rng.normal(size=(6, 3)), jnp.float32),
             jnp.asarray(rng.normal(size=(6, 3)), jnp.float32))
    mask = jnp.ones(6, bool)
    mechanism = dpcore.per_layer(leaf_sizes(params), 0.05, 0.0)
    ghost_sums, _ = clipped_sums(loss_fn, mechanism, method="ghost")(params, batch, mask)
    vmap_sums, _ = clipped_sums(loss_fn, mechanism, method="vmap")(params, batch, mask)
    assert_close(named_leaves(ghost_sums), {k: np.asarray(v) for k, v in
                                            named_leaves(vmap_sums).items()}, name)


@pytest.mark.parametrize("site, p", [("dense", 64), ("rows", 64), ("rows", 80)])
def test_float32_ghost_norms_never_fall_below_the_exact_norms(site, p):
    """Inputs nearly equal across positions and backprops summing to nearly zero make the
    ghost identity's terms cancel. With the rounding bound of dpcore.rounding, the norms
    (read off the clip factors) are at least the exact norms of the float32 data's
    per-example gradients (float64 oracle); the plain sums fell below them. On
    ordinary data the bound moves them by under 1%. An embedding with more than
    ROWS_GHOST_POSITIONS positions sums each record's rows per id in one order and its
    clipped sum in another: the same bound."""
    rng = np.random.default_rng(11)
    b, c, f = 16, 128, 256  # P (C + F) <= C F: Gram matrices
    if site == "dense":
        params = {"w": jnp.zeros((c, f), jnp.float32)}

        def loss(q, x):  # x (B, P, C + F): the input and, as data, the backprop g = dl/d(xW)
            return jnp.sum((x[..., :c] @ q["w"]) * x[..., c:], axis=(1, 2))
    else:
        params = {"w": jnp.zeros((9, f), jnp.float32)}

        def loss(q, x):  # x (B, P, 1 + F): token ids (few, repeated) and the backprop
            return jnp.sum(q["w"][x[..., 0].astype(jnp.int32)] * x[..., 1:], axis=(1, 2))
    mechanism = dpcore.flat(["w"], 1e-6, 0.0)
    run = jax.jit(clipped_sums(loss, mechanism, with_factors=True))
    for spread in cancelling.SPREADS:
        a, g, exact = cancelling.case(rng, site, b, p, c, f, spread)
        x = np.concatenate([a.reshape(b, p, -1).astype(np.float32), g], axis=2)
        assert ghost.rule(ghost.plan(loss, params, x[0]).sites[0]) == site
        _, _, factors = run(params, jnp.asarray(x))
        got = (1e-6 / np.asarray(factors, np.float64)[:, 0]) ** 2
        assert (got >= exact * (1 - 1e-6)).all(), (spread, (got / exact).min())
        if spread == 1.0:
            assert (got <= exact * 1.01).all()

def test_bfloat16_ghost_norms_are_formed_in_float32():
    """bfloat16 activations' Gram matrices are formed in float32: their rounding bound, which
    grows with the machine epsilon, would otherwise inflate every norm some 250-fold."""
    rng = np.random.default_rng(13)
    b, p, c, f = 8, 64, 128, 256
    params = {"w": jnp.zeros((c, f), jnp.bfloat16)}

    def loss(q, x):
        return jnp.sum((x[..., :c] @ q["w"]) * x[..., c:], axis=(1, 2))

    x = jnp.asarray(rng.normal(size=(b, p, c + f)), jnp.bfloat16)
    site = ghost.plan(loss, params, x[0]).sites[0]
    assert ghost.rule(site) == "dense"
    # the site's input and output gradient, per record (a batch of one)
    got = ghost.site_grads(site, params["w"], [x[:, None, :, :c]], x[:, None, :, c:]).sq
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    exact = (np.einsum("bpc,bpf->bcf", x64[..., :c], x64[..., c:]) ** 2).sum((1, 2))
    got = np.asarray(got, np.float64)
    assert (got >= exact).all() and (got <= exact * 1.01).all()


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_16_bit_parameters_are_refused(dtype, method):
    """A 16-bit parameter's clipped sum would be rounded in its dtype before the noise: for
    512 records of a bfloat16 Linear, leaving one out moved the sum by 1.6 clips."""
    run = clipped_sums(lambda q, x: jnp.sum(x * q["w"], axis=1), dpcore.flat(["w"], 1.0, 0.0),
                       method=method)
    with pytest.raises(ValueError, match=f"parameter 'w' is {jnp.dtype(dtype).name}.*float32"):
        jax.jit(run)({"w": jnp.zeros(3, dtype)}, jnp.ones((2, 3), dtype))


@pytest.mark.parametrize("method", ["vmap", "ghost"])
def test_parameters_cast_to_bfloat16_inside_the_loss_keep_one_record_within_its_clip(method):
    """The way to compute in bfloat16: float32 parameters cast inside the loss. Their clipped
    sums are float32, and leaving any one of 512 aligned records out moves them by at most
    the clip (in bfloat16 they moved by 1.6 clips)."""
    rng = np.random.default_rng(17)
    b, d_in, d_out = 512, 64, 32
    params = {"w": jnp.asarray(rng.normal(size=(d_in, d_out)) * 0.1, jnp.float32)}
    x = jnp.asarray(rng.normal(size=(b, d_in)) + 3.0, jnp.bfloat16)
    y = jnp.asarray(rng.normal(size=(b, d_out)), jnp.bfloat16)

    def loss(q, batch):
        xb, yb = batch
        out = xb @ q["w"].astype(jnp.bfloat16)
        return jnp.sum((out - yb).astype(jnp.float32) ** 2, axis=-1)

    run = jax.jit(clipped_sums(loss, dpcore.flat(["w"], 1.0, 0.0), method=method))
    full = run(params, (x, y)).sums["w"]
    assert full.dtype == jnp.float32
    full = np.asarray(full, np.float64)
    for i in range(0, b, 37):
        mask = np.ones(b, bool)
        mask[i] = False
        part = np.asarray(run(params, (x, y), jnp.asarray(mask)).sums["w"], np.float64)
        assert np.linalg.norm(full - part) <= 1 + 1e-4, i


def test_long_runs_of_one_id_keep_embedding_norms_within_one_percent():
    """The bound on a per-id row sum grows with the run's length, not the sequence's: with
    P = 4096 positions of 64 ids (runs of about 64), ordinary norms move by under 1%."""
    rng = np.random.default_rng(15)
    b, p, vocab, d = 2, 4096, 64, 256
    params = {"w": jnp.zeros((vocab, d), jnp.float32)}

    def loss(q, x):  # x (B, P, 1 + d): ids and the backprop
        return jnp.sum(q["w"][x[..., 0].astype(jnp.int32)] * x[..., 1:], axis=(1, 2))

    ids = rng.integers(0, vocab, size=(b, p))
    g = rng.normal(size=(b, p, d)).astype(np.float32)
    x = np.concatenate([ids[..., None].astype(np.float32), g], axis=2)
    _, _, factors = jax.jit(clipped_sums(loss, dpcore.flat(["w"], 1e-6, 0.0),
                                         with_factors=True))(params, jnp.asarray(x))
    got = (1e-6 / np.asarray(factors, np.float64)[:, 0]) ** 2
    exact = cancelling.exact_rows_sq_norms(ids, g, vocab)
    assert (got >= exact * (1 - 1e-6)).all() and (got <= exact * 1.01).all()


def several_rows(loss_fn, k):
    """A record of ``k`` rows (augmentations of one image, one user's examples): its loss is
    the mean of its rows' losses, so its gradient is the mean of theirs, clipped as one."""
    def loss(params, batch):
        x, y = batch
        b = x.shape[0]
        rows = (x.reshape(b * k, *x.shape[2:]), jnp.repeat(y, k))
        return loss_fn(params, rows).reshape(b, k).mean(1)
    return loss


@pytest.mark.parametrize("kind", ["mlp", "cnn", "transformer"])
@pytest.mark.parametrize("method", ["ghost", "vmap"])
def test_records_of_several_rows_are_clipped_as_one(kind, method):
    """Augmentation multiplicity (De et al., 2022) and user-level records: 8 records of 3
    rows each against the float64 oracle of one record at a time; a rule that clipped each
    row would bound a record by 3 clips (checked to differ)."""
    rng = np.random.default_rng(4)
    loss_fn, params = models.model(rng, kind)
    x, y = models.data(rng, kind, 24)
    batch = (x.reshape(8, 3, *x.shape[1:]), y[::3])
    loss = several_rows(loss_fn, 3)
    mask = np.array([1, 1, 0, 1, 1, 1, 1, 1], bool)
    mechanism = mechanism_for(params, kind)
    sums, _ = jax.jit(clipped_sums(loss, mechanism, method=method))(params, batch, mask)
    per_record = models.float64_oracle(loss, params, batch)
    assert_close(named_leaves(sums), oracle_sums(per_record, mechanism, mask), f"{kind}/{method}")
    per_row = models.float64_oracle(loss_fn, params, (x, np.repeat(y[::3], 3)))
    by_rows = oracle_sums({leaf: g / 3 for leaf, g in per_row.items()}, mechanism,
                          np.repeat(mask, 3))
    assert any(np.abs(by_rows[leaf] - value).max() > 1e-3
               for leaf, value in named_leaves(sums).items())


def _products(jaxpr):
    """Every dot_general and convolution of a jaxpr, its sub-jaxprs' (cond, scan, jit) too."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("dot_general", "conv_general_dilated"):
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    yield from _products(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    yield from _products(sub)


@pytest.mark.parametrize("method", ["ghost", "vmap"])
def test_norms_and_sums_form_their_products_at_full_precision(method):
    """Default precision on GPUs and TPUs rounds float32 products' inputs to TensorFloat-32
    or bfloat16 ("bfloat16" below), so a clipped sum x^T (c g) would not be the sum of the
    records whose norms were clipped. The loss asks for full precision in its own products:
    every product of the kernel is then at full precision, the forward and backward pass
    (at the loss's precision) and the norms and sums (at full precision whatever the
    default)."""
    from jax import lax

    full = lax.Precision.HIGHEST

    def loss_fn(p, batch):
        x, ids, y = batch
        h = jnp.tanh(lax.conv_general_dilated(x, p["conv"], (1, 1), "VALID", precision=full,
                                              dimension_numbers=("NHWC", "HWIO", "NHWC")))
        s = jnp.einsum("bpc,cf->bpf", p["emb"][ids], p["seq"], precision=full)
        v = jnp.concatenate([h.reshape(h.shape[0], -1), s.reshape(s.shape[0], -1)], axis=1)
        return (jnp.dot(jnp.tanh(v), p["out"], precision=full) - y) ** 2

    rng = np.random.default_rng(3)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape) / 2, jnp.float32)  # noqa: E731
    params = {"conv": normal(3, 3, 2, 3), "emb": normal(7, 4), "seq": normal(4, 3),
              "out": normal(4 * 4 * 3 + 5 * 3)}
    batch = (normal(6, 6, 6, 2), jnp.asarray(rng.integers(0, 7, size=(6, 5))), normal(6))
    mechanism = dpcore.Mechanism((dpcore.Group("all", tuple(params), clip=0.5, noise_std=0.0),))
    with jax.default_matmul_precision("bfloat16"):
        jaxpr = jax.make_jaxpr(clipped_sums(loss_fn, mechanism, method=method))(
            params, batch, np.ones(6, bool))
    products = list(_products(jaxpr.jaxpr))
    assert len(products) >= 6
    for eqn in products:
        assert eqn.params["precision"] == (full, full), eqn
