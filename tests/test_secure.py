"""Sampling and noise from the system's CSPRNG (dpcore.secure, PrivateAggregator(secure=True)).
The draws cannot be seeded, so the statistical tests use thresholds a correct generator
crosses with probability below 1e-6, and a 10% error in a standard deviation or a rate
would cross."""

import math
import os
import pickle

import numpy as np
import pytest
from scipy import stats

from dpcore import PrivateAggregator, flat
from dpcore.ledger import SumQueryEvent
from dpcore import secure
from dpcore.secure import SecureGenerator, SecurePoissonSampler


def test_normals_are_standard_normal():
    x = SecureGenerator().standard_normal(200_000)
    assert x.dtype == np.float64 and np.isfinite(x).all()
    assert stats.kstest(x, "norm").pvalue > 1e-6
    assert abs(x.mean()) < 5.5 / math.sqrt(len(x))
    assert abs(x.std() - 1) < 5.5 / math.sqrt(2 * len(x))  # a 10% error is 60 such sigmas


@pytest.fixture(params=["keystream", "os.urandom"])
def source(request, monkeypatch):
    """Large draws from AES-256-CTR (the `secure` extra) and, without it, from os.urandom."""
    if request.param == "keystream":
        assert secure.Cipher is not None, "the test extra installs cryptography"
    else:
        monkeypatch.setattr(secure, "Cipher", None)
    return request.param


def test_large_draws_are_uniform_words_and_standard_normals(source):
    """Above the keystream's and the threads' thresholds: the words' bytes are uniform
    (chi-square), two draws differ, and each thread's half of the normals is standard."""
    words = secure._words(8 * secure.STREAM_WORDS)
    assert words.dtype == np.uint64 and len(words) == 8 * secure.STREAM_WORDS
    counts = np.bincount(words.view(np.uint8), minlength=256)
    assert stats.chisquare(counts).pvalue > 1e-6
    assert not np.array_equal(words, secure._words(len(words)))
    size = 2 * secure.PARALLEL_NORMALS + 1
    x = SecureGenerator().standard_normal(size)
    assert x.shape == (size,) and np.isfinite(x).all()
    for half in (x[:size // 2], x[size // 2:]):
        assert stats.kstest(half, "norm").pvalue > 1e-6
        assert abs(half.std() - 1) < 5.5 / math.sqrt(2 * len(half))


def test_without_an_affinity_call_the_cpu_count_decides(monkeypatch):
    """os.sched_getaffinity is Linux's: elsewhere the CPU count says whether to use threads."""
    monkeypatch.delattr(os, "sched_getaffinity", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert secure._cores() == 2
    x = SecureGenerator().standard_normal(secure.PARALLEL_NORMALS)
    assert np.isfinite(x).all() and stats.kstest(x, "norm").pvalue > 1e-6


def test_a_failure_in_the_helper_thread_is_raised(monkeypatch):
    """Never the half the helper thread did not write: its error is raised."""
    import threading

    def ndtri(u, out=None):
        if threading.current_thread() is not threading.main_thread():
            raise FloatingPointError("helper")
        out[...] = 0.0

    monkeypatch.setattr(secure, "ndtri", ndtri)
    monkeypatch.setattr(secure, "_cores", lambda: 2)
    with pytest.raises(FloatingPointError, match="helper"):
        secure._ndtri(np.full(secure.PARALLEL_NORMALS, 0.25))


def test_uniforms_lie_on_the_53_bit_grid():
    u = SecureGenerator().uniform(100_000)
    assert (u >= 0).all() and (u < 1).all()
    assert np.array_equal(u * 2.0 ** 53, np.floor(u * 2.0 ** 53))
    assert stats.kstest(u, "uniform").pvalue > 1e-6


def test_normals_are_symmetric_and_finite_at_the_extremes(monkeypatch):
    """The sign from the top bit, the lower half's midpoints (2k + 1) 2^-54 from the next
    52: the extreme words give +-8.29 and +-1.4e-16, never an infinity."""
    words = np.array([0, 1 << 63, (1 << 63) - 1, (1 << 64) - 1], np.uint64)
    monkeypatch.setattr(secure, "_words", lambda size: words[:size])
    z = SecureGenerator().standard_normal(4)
    assert np.isfinite(z).all() and z[0] == -z[1] and z[2] == -z[3]
    assert z[0] == pytest.approx(-8.2924, abs=1e-4) and abs(z[2]) < 1e-15


def test_a_secure_aggregator_pickles():
    agg = pickle.loads(pickle.dumps(PrivateAggregator(flat(["w"], 1.0, 1.0), n=10, q=0.5,
                                                      secure=True)))
    agg.sample()
    assert agg.release({"w": np.zeros((3, 4))})["w"].shape == (4,)


@pytest.mark.parametrize("q", [0.1, 0.5])  # geometric gaps; one uniform per record
def test_poisson_samples_include_each_record_with_probability_q(q):
    n, draws = 500, 400
    sampler = SecurePoissonSampler(n, q, steps=draws)
    counts = np.zeros(n)
    sizes = []
    for sample in sampler:
        assert np.array_equal(sample, np.unique(sample)) and (sample < n).all()
        counts[sample] += 1
        sizes.append(len(sample))
    assert len(sizes) == draws
    total = n * draws
    assert abs(sum(sizes) - q * total) < 5.5 * math.sqrt(total * q * (1 - q))
    # every record alike: a chi-square test of the inclusion counts
    expected = q * draws
    chi2 = (((counts - expected) ** 2) / (expected * (1 - q))).sum()
    assert stats.chi2.sf(chi2, n - 1) > 1e-6


def test_a_secure_release_adds_the_noise_the_ledger_records():
    """Zero gradients: the released average is the noise over q n, with the std the ledger
    records (numpy backend; the torch and JAX backends' tests do the same through theirs)."""
    agg = PrivateAggregator(flat(["w", "b"], 0.5, 2.0), n=100, q=0.5, secure=True)
    b = len(agg.sample())
    out = agg.release({"w": np.zeros((b, 100_000)), "b": np.zeros((b, 3))})
    event = next(e for e in agg.ledger.events if isinstance(e, SumQueryEvent))
    std = out["w"].std() * agg.expected_size
    assert abs(std / event.noise_std - 1) < 0.02
    assert agg.secure and isinstance(agg.rng, SecureGenerator)


def test_a_secure_aggregator_takes_no_seed_and_compiled_steps_refuse_it():
    with pytest.raises(ValueError, match="takes no seed"):
        PrivateAggregator(flat(["w"], 1.0, 1.0), n=10, q=0.5, seed=0, secure=True)
    agg = PrivateAggregator(flat(["w"], 1.0, 1.0), n=10, q=0.5, secure=True)
    with pytest.raises(ValueError, match="secure=True .* the fused step"):
        agg.require_backend_generator("the fused step")
    PrivateAggregator(flat(["w"], 1.0, 1.0), n=10, q=0.5).require_backend_generator("it")
