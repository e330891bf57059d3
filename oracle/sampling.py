"""Sampling, defined bit for bit (docs/sampling.md): temperature, top-k, top-p and the draw.

The input is one row of f32 logits as the model gives it (bit-identical across the oracle and the
engines), so any engine that applies this function, or reproduces docs/sampling.md, chooses the same
token. Nothing depends on the batch, the step or the slot: the only randomness is u(seed, position),
the SplitMix64 output number position+1 of the stream started at `seed`.

    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=1234)
    token = sample(logits_row, params, position)        # position: where the chosen token will sit
    lp = log_softmax(logits_row)                        # the model's log-probabilities (temperature 1)
    tokens, logprobs = sample_loop(model, prompt, 16, params)   # the batch-1 reference loop

Every f32 operation is one IEEE operation (round to nearest even) in the order written; exp is the
canonical expf and the softmax normalizer the canonical csum (docs/contract.md §4.2, 4.3). The two scans (the
top-p cut and the draw) add left to right in f32, in the sorted order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numba import njit

from .numerics.exp_f32 import expf_array
from .numerics.fused import fma
from .numerics.reduction import csum

__all__ = ["SamplingParams", "SamplingError", "SAMPLING_VERSION", "sample", "log_softmax", "uniform24",
           "splitmix64", "sample_loop", "sorted_order"]

SAMPLING_VERSION = 1  # bump when any bit of the definition below changes

_GAMMA = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


class SamplingError(ValueError):
    """Sampling parameters or logits the definition does not cover."""


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy (argmax, ties to the lowest id; top_k, top_p and seed are unused).
    top_k 0 keeps every token; top_p 1.0 keeps every token; seed: an int in [0, 2^64)."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise SamplingError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 0:
            raise SamplingError(f"top_k must be an int >= 0 (0: no limit), got {k!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not (0 < p <= 1):
            raise SamplingError(f"top_p must be a number in (0, 1], got {p!r}")
        if np.float32(p) <= 0:
            raise SamplingError(f"top_p {p!r} rounds to 0 in float32")
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s <= _MASK64:
            raise SamplingError(f"seed must be an int in [0, 2^64), got {s!r}")

    @property
    def greedy(self) -> bool:
        return np.float32(self.temperature) == 0


# -- the counter-based generator ---------------------------------------------------------------------

def splitmix64(seed: int, n: int) -> int:
    """Output number n (n >= 1) of SplitMix64 started at `seed`: mix(seed + n * 0x9E3779B97F4A7C15)."""
    z = (seed + n * _GAMMA) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform24(seed: int, position: int) -> np.float32:
    """u in [0, 1): the top 24 bits of splitmix64(seed, position + 1), times 2^-24 (exact in f32)."""
    if position < 0:
        raise SamplingError(f"position must be >= 0, got {position}")
    return np.float32((splitmix64(seed, position + 1) >> 40) * 2.0 ** -24)


# -- the f32 kernels -----------------------------------------------------------------------------------

def sorted_order(z: np.ndarray) -> np.ndarray:
    """Token ids by logit, largest first, equal logits by the lower id (+0.0 and -0.0 are equal)."""
    return np.argsort(-z, kind="stable")


@njit(cache=True)
def _scaled(z_sorted, k, t32):
    """x_j = (z_j - z_0) / t in f32 for the first k of the sorted logits."""
    x = np.empty(k, np.float32)
    m = z_sorted[0]
    for j in range(k):
        x[j] = (z_sorted[j] - m) / t32
    return x


@njit(cache=True)
def _choose(p, top_p, u):
    """The top-p cut and the draw over probabilities p (sorted order) -> index j into p."""
    n = p.shape[0]
    c = np.empty(n, np.float32)
    acc = np.float32(0.0)
    for j in range(n):
        acc = acc + p[j]
        c[j] = acc
    keep = n
    if top_p < np.float32(1.0):
        for j in range(n):
            if c[j] >= top_p:
                keep = j + 1
                break
    target = u * c[keep - 1]
    for j in range(keep):
        if c[j] > target:
            return j
    for j in range(keep - 1, -1, -1):  # target rounded up to the kept mass: the last token with p > 0
        if p[j] > np.float32(0.0):
            return j
    return 0


@njit(cache=True)
def _log_f64(s):
    """ln(s) for a double s > 0, finite, by a fixed sequence of double operations (docs/sampling.md):
    s = m * 2^e with m in [sqrt(1/2), sqrt(2)), f = (m - 1) / (m + 1), ln m = 2 f (1 + f^2/3 + ... ),
    Horner with fma over 1/(2i+1), i = 12 .. 1, then e * ln2 (hi + lo)."""
    m, e = math.frexp(s)           # s = m * 2^e, m in [0.5, 1): exact
    m = m * 2.0
    e = e - 1
    if m > 1.4142135623730951:
        m = m * 0.5
        e = e + 1
    f = (m - 1.0) / (m + 1.0)
    f2 = f * f
    acc = 1.0 / 25.0
    for i in range(11, 0, -1):
        acc = fma(acc, f2, 1.0 / (2 * i + 1))
    acc = fma(acc, f2, 1.0)
    lnm = 2.0 * f * acc
    ed = np.float64(e)
    return fma(ed, 0.6931471803691238, fma(ed, 1.9082149292705877e-10, lnm))


@njit(cache=True)
def _log_softmax(z):
    n = z.shape[0]
    m = z[0]
    for i in range(1, n):
        if z[i] > m:
            m = z[i]
    d = np.empty(n, np.float32)
    for i in range(n):
        d[i] = z[i] - m
    return d, m


def log_softmax(logits) -> np.ndarray:
    """The model's log-probabilities (temperature 1, nothing cut) of one f32 logits row -> f32 [V].

    d_i = z_i - max(z) (f32); s = csum(expf(d)) in id order; lp_i = f32(f64(d_i) - ln(s)) with ln the
    fixed double sequence of _log_f64."""
    z = _row(logits)
    d, _ = _log_softmax(z)
    s = csum(expf_array(d))
    ls = _log_f64(np.float64(s))
    return (d.astype(np.float64) - ls).astype(np.float32)


def _row(logits) -> np.ndarray:
    z = np.asarray(logits)
    if z.ndim == 2 and z.shape[0] == 1:
        z = z[0]
    if z.ndim != 1 or z.size == 0 or z.dtype != np.float32:
        raise SamplingError(f"logits must be one non-empty float32 row, got {z.dtype} {z.shape}")
    if not np.isfinite(z).all():
        raise SamplingError("logits hold a NaN or an infinity")
    return np.ascontiguousarray(z)


def sample(logits, params: SamplingParams, position: int) -> int:
    """The token chosen from one f32 logits row for the token at `position` (docs/sampling.md)."""
    z = _row(logits)
    if params.greedy:
        return int(np.argmax(z))  # the first maximum: ties to the lowest id
    order = sorted_order(z)
    V = z.size
    k = V if params.top_k == 0 or params.top_k >= V else int(params.top_k)
    x = _scaled(z[order], k, np.float32(params.temperature))
    e = expf_array(x)
    s = csum(e)
    p = (e / s).astype(np.float32)
    j = _choose(p, np.float32(params.top_p), uniform24(params.seed, position))
    return int(order[j])


def sample_loop(model, prompt, n: int, params: SamplingParams, eos=()) -> tuple[list[int], list[float]]:
    """The batch-1 reference: prefill `prompt`, then n tokens one at a time through `sample`, each
    with its log_softmax value -> (tokens, logprobs as f32 values). Stops after a token in `eos`.
    `model` is anything with new_cache() and forward(ids, cache) -> f32 logits (the oracle or an engine)."""
    cache = model.new_cache()
    prompt = [int(t) for t in prompt]
    row = model.forward(prompt, cache)[-1]
    tokens, lps = [], []
    for i in range(n):
        t = sample(row, params, len(prompt) + i)
        tokens.append(t)
        lps.append(float(log_softmax(row)[t]))
        if t in eos or i == n - 1:
            break
        row = model.forward([t], cache)[-1]
    return tokens, lps
