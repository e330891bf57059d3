"""oracle/sampling.py against its definition (docs/sampling.md), written again here in plain Python
one scalar f32 operation at a time, and the batch-1 loop on the oracle against the CPU engine."""
from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest

from oracle.numerics import csum, expf
from oracle.sampling import (SamplingError, SamplingParams, _log_f64, log_softmax, sample, sample_loop,
                             splitmix64, uniform24)

F = np.float32


def _doc_sample(z: np.ndarray, temperature: float, top_k: int, top_p: float, seed: int, position: int) -> int:
    """docs/sampling.md, step by step, with Python lists and np.float32 scalars."""
    V = len(z)
    if F(temperature) == 0:
        best = 0
        for i in range(V):
            if z[i] > z[best]:
                best = i
        return best
    order = sorted(range(V), key=lambda i: (-float(z[i]), i))
    K = V if top_k == 0 or top_k >= V else top_k
    order = order[:K]
    t, m = F(temperature), z[order[0]]
    e = [expf(F(F(z[i] - m) / t)) for i in order]
    s = csum(np.array(e, np.float32))
    p = [F(v / s) for v in e]
    c, acc = [], F(0)
    for v in p:
        acc = F(acc + v)
        c.append(acc)
    J = K
    if F(top_p) < 1:
        J = next((j + 1 for j in range(K) if c[j] >= F(top_p)), K)
    x = splitmix64(seed, position + 1)
    u = F((x >> 40) / 2 ** 24)
    target = F(u * c[J - 1])
    for j in range(J):
        if c[j] > target:
            return order[j]
    return order[max(j for j in range(J) if p[j] > 0)]


def test_splitmix64_matches_the_published_stream():
    # Vigna's splitmix64.c seeded with 0: the first three outputs (the reference implementation's values)
    assert [splitmix64(0, n) for n in (1, 2, 3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_uniform24_is_a_24_bit_grid_in_0_1_keyed_only_by_seed_and_position():
    us = [uniform24(s, p) for s in (0, 1, 2 ** 64 - 1) for p in range(200)]
    assert all(u.dtype == np.float32 and 0 <= u < 1 and float(u) * 2 ** 24 == int(float(u) * 2 ** 24) for u in us)
    assert uniform24(5, 17) == uniform24(5, 17) and len(set(map(float, us))) > 590
    with pytest.raises(SamplingError):
        uniform24(1, -1)


@pytest.mark.parametrize("case", range(60))
def test_sample_is_the_documented_algorithm(case):
    rng = np.random.default_rng(case)
    V = int(rng.choice([1, 2, 7, 64, 65, 300]))
    z = (rng.standard_normal(V) * rng.choice([0.1, 3, 30])).astype(np.float32)
    if case % 4 == 0:   # ties, and +0.0 / -0.0
        z = np.round(z).astype(np.float32)
        z[:: 3] = -0.0 if case % 8 else 0.0
    temperature = float(rng.choice([0.0, 1e-30, 0.3, 0.7, 1.0, 1.7, 100.0]))
    top_k = int(rng.choice([0, 1, 2, 5, 1000]))
    top_p = float(rng.choice([1.0, 0.9, 0.5, 1e-6]))
    seed = int(rng.integers(0, 2 ** 63)) * 2 + int(case % 2)
    for position in (0, 1, 37, 4095):
        got = sample(z, SamplingParams(temperature, top_k, top_p, seed), position)
        assert got == _doc_sample(z, temperature, top_k, top_p, seed, position), (case, position)


def test_greedy_is_argmax_ties_to_the_lowest_id_and_ignores_the_rest():
    z = np.array([0.5, 2.0, -1.0, 2.0, 2.0], np.float32)
    for seed in (0, 1, 99):
        assert sample(z, SamplingParams(0.0, 3, 0.2, seed), 10) == 1
    # top_k 1 at any temperature is the same token
    assert {sample(z, SamplingParams(1.3, 1, 1.0, s), p) for s in range(5) for p in range(5)} == {1}


def test_top_k_ties_at_the_cut_go_to_the_lower_ids():
    z = np.array([1.0, 3.0, 3.0, 3.0, 3.0, 0.0], np.float32)
    got = {sample(z, SamplingParams(1.0, 2, 1.0, 7), p) for p in range(200)}
    assert got == {1, 2}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    # probabilities about 0.64, 0.24, 0.09, 0.03: top_p 0.7 keeps two tokens, 0.5 one
    z = np.log(np.array([0.64, 0.235, 0.0865, 0.0385])).astype(np.float32)
    assert {sample(z, SamplingParams(1.0, 0, 0.7, 3), p) for p in range(300)} == {0, 1}
    assert {sample(z, SamplingParams(1.0, 0, 0.5, 3), p) for p in range(50)} == {0}


def test_the_draws_follow_the_distribution():
    z = np.log(np.array([0.5, 0.3, 0.15, 0.05])).astype(np.float32)
    n = 4000
    counts = np.bincount([sample(z, SamplingParams(1.0, 0, 1.0, 12345), p) for p in range(n)], minlength=4)
    expect = np.array([0.5, 0.3, 0.15, 0.05]) * n
    assert np.all(np.abs(counts - expect) < 5 * np.sqrt(expect)), counts  # five standard deviations


def test_log_f64_is_within_four_ulps_and_rounds_correctly_to_f32_and_log_softmax_is_defined_by_it():
    rng = np.random.default_rng(0)
    xs = np.concatenate([rng.uniform(1, 2, 500), rng.uniform(1, 2e5, 1500), [1.0, 2.0, 2 ** 0.5, 151552.0]])
    for x in xs:
        exact = mpmath.log(mpmath.mpf(float(x)))
        got = _log_f64(float(x))
        assert abs(mpmath.mpf(got) - exact) <= 4 * math.ulp(got), x
        assert np.float32(got) == np.float32(float(exact)), x   # what a logprob keeps: the f32 rounding
    z = (rng.standard_normal(300) * 4).astype(np.float32)
    lp = log_softmax(z)
    d = z - z.max()
    s = csum(np.array([expf(v) for v in d], np.float32))
    ref = (d.astype(np.float64) - _log_f64(float(s))).astype(np.float32)
    assert lp.dtype == np.float32 and np.array_equal(lp.view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0),
                                dict(top_p=1.5), dict(top_k=-1), dict(seed=-1), dict(seed=2 ** 64),
                                dict(top_k=1.5), dict(temperature=True)])
def test_bad_parameters_are_refused(kw):
    with pytest.raises(SamplingError):
        SamplingParams(**kw)


def test_bad_logits_are_refused():
    p = SamplingParams(1.0, 0, 1.0, 1)
    for z in (np.zeros(3, np.float64), np.zeros((2, 3), np.float32), np.array([0, np.nan], np.float32),
              np.zeros(0, np.float32)):
        with pytest.raises(SamplingError):
            sample(z, p, 0)


def test_the_batch_1_loop_is_the_same_on_the_oracle_and_the_cpu_engine(golden_dir):
    pytest.importorskip("fast._core")
    import fast
    import oracle
    path = str(golden_dir / "tiny-fp8")
    model, engine = oracle.load(path), fast.Engine(path, threads=1)
    for params in (SamplingParams(0.0), SamplingParams(0.9, 20, 0.9, 7), SamplingParams(1.5, 0, 1.0, 2 ** 64 - 1)):
        a_tok, a_lp = sample_loop(model, [1, 2, 3, 4, 5], 10, params)
        b_tok, b_lp = sample_loop(engine, [1, 2, 3, 4, 5], 10, params)
        assert a_tok == b_tok and len(a_tok) == 10
        assert np.array_equal(np.array(a_lp, np.float32).view(np.uint32), np.array(b_lp, np.float32).view(np.uint32))
    # sampling is not greedy: some seeded run differs from the greedy one
    greedy = sample_loop(engine, [1, 2, 3, 4, 5], 10, SamplingParams(0.0))[0]
    assert any(sample_loop(engine, [1, 2, 3, 4, 5], 10, SamplingParams(1.0, 0, 1.0, s))[0] != greedy for s in range(3))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_generate_samples_as_the_batch_1_loop(golden_dir, device):
    """Engine.generate(sampling=...) with several requests of different parameters, arriving at
    different steps, chunked, in one batch: each request's tokens are the batch-1 loop's
    (oracle.sampling.sample_loop on the same engine), greedy requests included."""
    import fast
    if device == "cuda":
        from fast.cuda import cuda_available
        if not cuda_available():
            pytest.skip("no CUDA engine (fast._cuda not built or no device)")
    engine = fast.Engine(str(golden_dir / "tiny-fp8"), device=device)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(20, 41)), [5, 5, 5, 5]]
    params = [SamplingParams(0.9, 20, 0.9, 7), SamplingParams(0.0), SamplingParams(1.5, 0, 1.0, 2 ** 64 - 1),
              SamplingParams(1.0, 5, 0.5, 3)]
    want = [sample_loop(engine, p, 9, sp)[0] for p, sp in zip(prompts, params)]
    got = engine.generate(prompts, 9, sampling=params, chunk=4, max_batch=3, arrivals=[0, 2, 1, 5])
    assert got == want
    assert engine.generate(prompts[0], 9, sampling=params[0]) == want[0]
    with pytest.raises(fast.EngineInputError, match="sampling must be"):
        engine.generate(prompts, 2, sampling=params[:2])
    with pytest.raises(fast.EngineInputError, match="speculate decodes greedily"):
        engine.generate(prompts, 2, sampling=params, speculate="ngram:2")
