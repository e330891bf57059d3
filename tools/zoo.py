"""The checkpoint zoo: seeded synthetic GLM-5.3-Flash checkpoints with the real structure.

    make_checkpoint("tiny", "fp8", "zoo/tiny-fp8")        # one release
    make_zoo("small", "zoo")                              # zoo/small-{bf16,fp8,mxfp4}
    oracle make-checkpoint tiny --release all --out zoo   # the CLI (main_make_checkpoint)
    oracle make-checkpoint slice --set num_hidden_layers=6 --dry-run   # the sizes only

Before writing, the exact size of every file is known (checkpoint_sizes) and checked against the free
space of the target's filesystem: what does not fit is refused (NoSpaceError; the CLI exits 2).

Every release is written from one master: BF16 values for `linear` and `bf16` tensors, F32 values for
`f32` tensors (see oracle/names.py). The FP8 and MXFP4 releases quantize the BF16 master; nothing
else differs, so the three releases of a zoo entry are the same model up to weight quantization.

Bytes are deterministic: the random numbers come from our own counter-based generator (splitmix64 on
(seed, tensor key, element index); no numpy RNG stream), every float step is a basic IEEE operation
(or, for the two tensors initialised through log/exp, is rounded to the BF16 grid afterwards), and the
safetensors files are written by our own writer (sorted header, no timestamps). docs/checkpoints.md
states the rules in full.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import numpy as np

from oracle import names as N
from oracle.config import DENSE, KDA, MLA, SPARSE, Config

__all__ = [
    "ZOO",
    "RELEASES",
    "DEFAULT_SEED",
    "zoo_config",
    "zoo_options",
    "make_checkpoint",
    "checkpoint_sizes",
    "space_check",
    "NoSpaceError",
    "make_zoo",
    "main_make_checkpoint",
    "tensor_key",
    "normal",
    "uniform",
    "master",
    "bf16_bits",
    "bf16_round",
    "quantize_fp8",
    "quantize_mxfp4",
    "mxfp4_exponent",
    "plan",
]

RELEASES = ("bf16", "fp8", "mxfp4")
DEFAULT_SEED = 5300  # GLM-5.3
GENERATOR = "oracle.zoo/1"  # the format id written into every file (bytes of golden/); not the module path

# ----------------------------------------------------------------------------- zoo entries

_TINY = dict(
    vocab_size=300,
    hidden_size=96,
    num_hidden_layers=6,
    layer_types=[KDA, KDA, KDA, MLA, MLA, KDA],
    indexer_types=["full", "full", "full", "full", "shared", "full"],
    mlp_layer_types=[DENSE, SPARSE, SPARSE, SPARSE, SPARSE, SPARSE],
    intermediate_size=200,
    moe_intermediate_size=96,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    swiglu_limit=1.5,
    rms_norm_eps=1e-5,
    num_attention_heads=3,
    num_key_value_heads=3,
    q_lora_rank=72,
    kv_lora_rank=40,
    qk_nope_head_dim=24,
    qk_rope_head_dim=0,
    v_head_dim=20,
    index_topk=8,
    index_kpool=4,
    index_head_dim=24,
    index_n_heads=3,
    index_kpool_always_select_tail=True,
    linear_num_heads=3,
    linear_head_dim=24,
    linear_conv_kernel_dim=4,
    linear_lower_bound=-5.0,
    hc_mult=4,
    hc_eps=1e-6,
    hc_sinkhorn_iters=20,
    tie_word_embeddings=False,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)

_SMALL = dict(
    _TINY,
    vocab_size=1000,
    hidden_size=352,
    num_hidden_layers=8,
    layer_types=None,  # default rule: MLA at 3 and 7
    indexer_types=None,  # default: all full
    mlp_layer_types=[DENSE, DENSE] + [SPARSE] * 6,
    intermediate_size=736,
    moe_intermediate_size=160,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=1,
    topk_group=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=160,
    kv_lora_rank=96,
    qk_nope_head_dim=48,
    v_head_dim=48,
    index_n_heads=4,
    index_head_dim=32,
    index_topk=16,
    index_kpool=4,
    linear_num_heads=4,
    linear_head_dim=64,
    swiglu_limit=10.0,
)

# the real model's depth and schedule (45 layers: MLA with its own indexer where l % 4 == 3, else KDA; the
# first three MLPs dense; every indexer full), at tiny-like widths so the oracle runs it in seconds
_DEEP = dict(
    _TINY,
    num_hidden_layers=45,
    layer_types=None,
    indexer_types=None,
    mlp_layer_types=None,
    n_group=1,
    topk_group=1,
    swiglu_limit=10.0,
)


@dataclass(frozen=True)
class ZooEntry:
    name: str
    fields: dict  # Config fields (None schedules: the peer's default rule)
    mxfp4_bf16_expert_layers: tuple[int, ...]  # routed experts that stay BF16 in the MXFP4 release
    tokenizer: bool = False
    shard_bytes: int = 0  # 0: one file
    # the three per-layer lists for any layer count (`--set num_hidden_layers=N`); at the entry's own
    # count they are its `fields`
    schedule: Callable[[int], dict] | None = None
    doc: str = ""
    # a factor on the std of the projections that write into the residual streams (_RESIDUAL_WRITERS):
    # at 45 layers the 90 sublayer outputs add up like a random walk, and below 1 keeps the streams O(1)
    residual_scale: float = 1.0


def _first_dense(k: int) -> Callable[[int], list]:
    return lambda n: [DENSE] * min(k, n) + [SPARSE] * max(n - k, 0)


def _tiny_schedule(n: int) -> dict:
    """tiny's six layers repeated (and cut): every count from 5 on keeps a shared-indexer MLA layer."""
    lt, it = _TINY["layer_types"], _TINY["indexer_types"]
    return {"layer_types": [lt[i % len(lt)] for i in range(n)], "indexer_types": [it[i % len(it)] for i in range(n)],
            "mlp_layer_types": _first_dense(1)(n)}


def _default_schedule(dense: int) -> Callable[[int], dict]:
    """The real model's rules (MLA where idx % 4 == 3, every indexer full), the first `dense` MLPs dense."""
    return lambda n: {"layer_types": None, "indexer_types": None, "mlp_layer_types": _first_dense(dense)(n)}


ZOO: dict[str, ZooEntry] = {
    "tiny": ZooEntry(
        "tiny",
        _TINY,
        (2,),
        tokenizer=True,
        schedule=_tiny_schedule,
        doc="CI: every layer kind, shared indexer, group-limited routing, low swiglu_limit, odd sizes",
    ),
    "tiny-g1": ZooEntry(
        "tiny-g1", dict(_TINY, n_group=1, topk_group=1), (2,), tokenizer=True, schedule=_tiny_schedule,
        doc="tiny without expert groups",
    ),
    "small": ZooEntry("small", _SMALL, (5,), schedule=_default_schedule(2),
                      doc="wider: several KDA head blocks, 16 experts top 4, 8 layers"),
    "deep": ZooEntry("deep", _DEEP, (5,), tokenizer=True, schedule=_default_schedule(3), residual_scale=0.375,
                     doc="the real 45-layer schedule (MLA+indexer at l % 4 == 3, first 3 dense) at tiny widths"),
    "slice": ZooEntry(
        "slice",
        dict(num_hidden_layers=4, layer_types=None, mlp_layer_types=None, indexer_types=None),
        (3,),
        shard_bytes=4 << 30,
        schedule=_default_schedule(1),
        doc="real GLM-5.3-Flash widths, 4 layers (KDA, KDA, KDA, MLA; first dense): GPU benchmarks",
    ),
    "flash": ZooEntry(
        "flash",
        dict(num_hidden_layers=45, n_routed_experts=32, layer_types=None, mlp_layer_types=None, indexer_types=None),
        (7,),
        shard_bytes=4 << 30,
        schedule=_default_schedule(3),
        doc="the real model's 45 layers at real widths, 32 routed experts (top 8): what one token reads "
            "is the real model's; FP8 42.5 GiB, made on the GPU machine",
    ),
}

_SCHEDULES = ("layer_types", "mlp_layer_types", "indexer_types")


def zoo_config(name: str, **overrides: Any) -> Config:
    """The Config of a zoo entry; any Config field may be overridden.

    With another num_hidden_layers, the per-layer lists not given too follow the entry's schedule;
    layer_types given without indexer_types get the default indexers (every one full), as the
    entry's shared-indexer pattern belongs to its own layer pattern."""
    if name not in ZOO:
        raise KeyError(f"unknown zoo checkpoint {name!r}; known: {', '.join(ZOO)}")
    z = ZOO[name]
    d = dict(z.fields)
    if z.schedule is not None:
        n = overrides.get("num_hidden_layers", d.get("num_hidden_layers", Config.num_hidden_layers))
        if isinstance(n, int) and not isinstance(n, bool) and n >= 1:  # else Config names the bad value
            d.update(z.schedule(n))
            if "layer_types" in overrides and "indexer_types" not in overrides:
                d["indexer_types"] = None
    d.update(overrides)
    return Config(**{k: v for k, v in d.items()})


def zoo_options(name: str, cfg: Config, mxfp4_bf16_expert_layers: Iterable[int] | None = None) -> dict:
    z = ZOO[name]
    keep = z.mxfp4_bf16_expert_layers if mxfp4_bf16_expert_layers is None else tuple(mxfp4_bf16_expert_layers)
    keep = tuple(l for l in keep if 0 <= l < cfg.num_hidden_layers and cfg.is_moe(l))
    return {"mxfp4_bf16_expert_layers": keep, "tokenizer": z.tokenizer and cfg.vocab_size >= 256, "shard_bytes": z.shard_bytes}


# ----------------------------------------------------------------------------- RNG

_M64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15


def _mix64_py(z: int) -> int:
    z &= _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def tensor_key(seed: int, name: str) -> int:
    """64-bit stream key of one tensor: splitmix64 finalizer over (seed, FNV-1a-64 of the key text)."""
    h = 0xCBF29CE484222325
    for b in name.encode("utf-8"):
        h = ((h ^ b) * 0x100000001B3) & _M64
    return _mix64_py(_mix64_py((seed & _M64) ^ 0x5A6F6F) ^ h)


def stream_py(key: int, i: int) -> int:
    """Element i of a stream (reference implementation): x_i = mix64(key + (i + 1) * GAMMA)."""
    return _mix64_py(key + (i + 1) * _GAMMA)


_nb_cache: dict[str, Callable] = {}
_SQRT3 = 1.7320508075688772  # fl64(sqrt(3))


def _kernels():
    if _nb_cache:
        return _nb_cache
    import numba

    U = numba.uint64
    U32 = numba.uint32

    @numba.njit(cache=False)
    def mix(z):
        z = (z ^ (z >> U(30))) * U(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> U(27))) * U(0x94D049BB133111EB)
        return z ^ (z >> U(31))

    @numba.njit(parallel=True, cache=False)
    def raw(key, start, count, out):
        g = U(_GAMMA)
        for j in numba.prange(count):
            out[j] = mix(U(key) + (U(start) + U(j) + U(1)) * g)

    @numba.njit(parallel=True, cache=False)
    def irwin4(key, start, count, out):
        g = U(_GAMMA)
        m32 = U(0xFFFFFFFF)
        for j in numba.prange(count):
            c = (U(start) + U(j)) * U(2)
            a = mix(U(key) + (c + U(1)) * g)
            b = mix(U(key) + (c + U(2)) * g)
            out[j] = (a >> U(32)) + (a & m32) + (b >> U(32)) + (b & m32)

    @numba.njit(parallel=True, cache=False)
    def normal_f32(key, start, count, std, mean, add_mean, out):
        # the fused form of: f32(normal(key, start, count) * std [+ mean])
        g = U(_GAMMA)
        m32 = U(0xFFFFFFFF)
        for j in numba.prange(count):
            c = (U(start) + U(j)) * U(2)
            a = mix(U(key) + (c + U(1)) * g)
            b = mix(U(key) + (c + U(2)) * g)
            s = (a >> U(32)) + (a & m32) + (b >> U(32)) + (b & m32)
            z = (np.float64(s) * 2.0**-32 - 2.0) * _SQRT3
            w = z * std
            if add_mean:
                w = w + mean
            out[j] = np.float32(w)

    @numba.njit(parallel=True, cache=False)
    def bf16_inplace(u):  # u: the float32 values' bits; BF16 RNE, kept as float32 bits
        for j in numba.prange(u.size):
            x = u[j]
            u[j] = ((x + np.uint32(0x7FFF) + ((x >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)) << np.uint32(16)

    @numba.njit(parallel=True, cache=False)
    def fp8_scale(w, sc, x):
        # per 128x128 block: sc = fl32(amax / 448) (1 if amax = 0); x = clip(fl32(w / sc), +-448)
        R, C = w.shape
        Rb, Cb = sc.shape
        for bi in numba.prange(Rb):
            r0, r1 = bi * 128, min(R, bi * 128 + 128)
            for bj in range(Cb):
                c0, c1 = bj * 128, min(C, bj * 128 + 128)
                amax = np.float32(0.0)
                for r in range(r0, r1):
                    for c in range(c0, c1):
                        v = abs(w[r, c])
                        if v > amax:
                            amax = v
                s = amax / np.float32(448.0) if amax > 0 else np.float32(1.0)
                sc[bi, bj] = s
                for r in range(r0, r1):
                    for c in range(c0, c1):
                        x[r, c] = min(max(w[r, c] / s, np.float32(-448.0)), np.float32(448.0))

    @numba.njit(parallel=True, cache=False)
    def enc_e4m3(u, q):
        # u: float32 bits of values with |x| <= 448 -> E4M3fn codes, round to nearest even, sign kept
        for j in numba.prange(u.size):
            b = u[j]
            a = b & U32(0x7FFFFFFF)
            E = np.int64(a >> U32(23)) - 127
            if E >= -6:  # E4M3 normal: keep 3 mantissa bits
                code = np.int64(((E + 7) << 3) | np.int64((a >> U32(20)) & U32(7)))
                rem = a & U32(0xFFFFF)
                if rem > U32(0x80000) or (rem == U32(0x80000) and (code & 1) == 1):
                    code += 1
            elif E >= -127 + 1 and E >= -30:  # E4M3 subnormal: round(a * 2^9) (< 1 ulp of 2^-9 apart)
                m = np.int64((a & U32(0x7FFFFF)) | U32(0x800000))
                sh = 14 - E  # a * 2^9 = m * 2^(E - 14)
                code = m >> sh
                rem = m & ((np.int64(1) << sh) - 1)
                half = np.int64(1) << (sh - 1)
                if rem > half or (rem == half and (code & 1) == 1):
                    code += 1
            else:  # zero, f32 subnormal or below 2^-30: rounds to zero
                code = 0
            if b >> U32(31):
                code |= 0x80
            q[j] = np.uint8(code)

    @numba.njit(parallel=True, cache=False)
    def mx_scale(w, sc, x):
        # per row and group of 32: e = smallest integer with amax <= 6 * 2^e; x = w * 2^-e (exact)
        R, C = w.shape
        for r in numba.prange(R):
            for gi in range(C // 32):
                amax = np.float32(0.0)
                for c in range(gi * 32, gi * 32 + 32):
                    v = abs(w[r, c])
                    if v > amax:
                        amax = v
                m, k = math.frexp(np.float64(amax))
                e = k - 3 if m <= 0.75 else k - 2
                if amax == 0:
                    e = 0
                e = min(max(e, -127), 127)
                sc[r, gi] = np.uint8(e + 127)
                f = np.float32(2.0 ** (-e))
                for c in range(gi * 32, gi * 32 + 32):
                    x[r, c] = w[r, c] * f

    @numba.njit(parallel=True, cache=False)
    def enc_e2m1_pack(u, packed):
        # u: float32 bits [R, C] of values with |x| <= 6 -> E2M1 RNE nibbles, column 2b low, 2b+1 high
        R, C = u.shape
        for r in numba.prange(R):
            for c in range(C):
                b = u[r, c]
                a = b & U32(0x7FFFFFFF)
                E = np.int64(a >> U32(23)) - 127
                if E >= 0:  # E2M1 normal: keep 1 mantissa bit
                    code = np.int64(((E + 1) << 1) | np.int64((a >> U32(22)) & U32(1)))
                    rem = a & U32(0x3FFFFF)
                    if rem > U32(0x200000) or (rem == U32(0x200000) and (code & 1) == 1):
                        code += 1
                elif E >= -3:  # subnormal: round(a * 2), a * 2 = m * 2^(E - 22)
                    m = np.int64((a & U32(0x7FFFFF)) | U32(0x800000))
                    sh = 22 - E
                    code = m >> sh
                    rem = m & ((np.int64(1) << sh) - 1)
                    half = np.int64(1) << (sh - 1)
                    if rem > half or (rem == half and (code & 1) == 1):
                        code += 1
                else:  # a < 2^-3: rounds to zero
                    code = 0
                if b >> U32(31):
                    code |= 0x8
                if c % 2 == 0:
                    packed[r, c // 2] = np.uint8(code)
                else:
                    packed[r, c // 2] |= np.uint8(code << 4)

    _nb_cache.update(raw=raw, irwin4=irwin4, normal_f32=normal_f32, bf16_inplace=bf16_inplace, fp8_scale=fp8_scale,
                     enc_e4m3=enc_e4m3, mx_scale=mx_scale, enc_e2m1_pack=enc_e2m1_pack)
    return _nb_cache


def raw_stream(key: int, start: int, count: int) -> np.ndarray:
    out = np.empty(count, dtype=np.uint64)
    _kernels()["raw"](np.uint64(key), np.uint64(start), count, out)
    return out


def normal(key: int, start: int, count: int) -> np.ndarray:
    """Approximately N(0,1) float64 values for elements [start, start+count) of a stream.

    Element i: a = x_{2i}, b = x_{2i+1} (64-bit stream words); s = sum of the four 32-bit halves of a
    and b (an exact integer < 2^34); z = (s * 2^-32 - 2) * fl64(sqrt 3). Irwin-Hall(4), unit variance,
    |z| < 3.47. Only exact steps and one rounded multiply: bit-identical everywhere.
    """
    s = np.empty(count, dtype=np.uint64)
    _kernels()["irwin4"](np.uint64(key), np.uint64(start), count, s)
    return (s.astype(np.float64) * 2.0**-32 - 2.0) * _SQRT3


def uniform(key: int, start: int, count: int) -> np.ndarray:
    """U[0,1) float64: (x_i >> 11) * 2^-53 (exact)."""
    return (raw_stream(key, start, count) >> np.uint64(11)).astype(np.float64) * 2.0**-53


# ----------------------------------------------------------------------------- formats (encode)


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bits, round to nearest even (finite inputs only)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise ValueError("bf16_bits: non-finite input")
    u = x.view(np.uint32)
    r = (u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    return r.astype(np.uint16)


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float32 -> the float32 value of its BF16 rounding (RNE)."""
    return (bf16_bits(x).astype(np.uint32) << np.uint32(16)).view(np.float32)


def quantize_fp8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w f32 [R, C] -> (E4M3 codes u8 [R, C], scale_inv f32 [ceil(R/128), ceil(C/128)]).

    Numba kernel; bit-identical to quantize_fp8_reference (the readable definition, tested)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    R, C = w.shape
    q = np.empty((R, C), np.uint8)
    sc = np.empty((-(-R // N.FP8_BLOCK), -(-C // N.FP8_BLOCK)), np.float32)
    x = np.empty((R, C), np.float32)
    k = _kernels()
    k["fp8_scale"](w, sc, x)
    k["enc_e4m3"](x.reshape(-1).view(np.uint32), q.reshape(-1))
    return q, sc


def quantize_fp8_reference(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w f32 [R, C] -> (E4M3 codes u8 [R, C], scale_inv f32 [ceil(R/128), ceil(C/128)]).

    Per 128x128 block: amax = max |w| (f32); scale_inv = fl32(amax / 448) (1.0 for an all-zero block);
    code = E4M3fn RNE of fl32(w / scale_inv), clipped to +-448 first (|w / scale_inv| can exceed 448
    by an ulp).
    """
    import ml_dtypes

    w = np.ascontiguousarray(w, dtype=np.float32)
    R, C = w.shape
    B = N.FP8_BLOCK
    Rb, Cb = -(-R // B), -(-C // B)
    pad = np.zeros((Rb * B, Cb * B), dtype=np.float32)
    pad[:R, :C] = np.abs(w)
    amax = pad.reshape(Rb, B, Cb, B).max(axis=(1, 3))
    scale = np.where(amax > 0, amax / np.float32(448.0), np.float32(1.0)).astype(np.float32)
    full = np.repeat(np.repeat(scale, B, axis=0), B, axis=1)[:R, :C]
    q = np.clip(w / full, np.float32(-448.0), np.float32(448.0)).astype(np.float32)
    codes = q.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return np.ascontiguousarray(codes), scale


def mxfp4_exponent(amax: np.ndarray) -> np.ndarray:
    """Per-group scale exponent e (int32): the smallest integer with amax <= 6 * 2^e, clamped to
    [-127, 127]; e = 0 for an all-zero group. With amax = m * 2^k (frexp, m in [0.5, 1)):
    e = k - 3 if m <= 0.75 else k - 2 (exact; no logarithm)."""
    amax = np.asarray(amax, dtype=np.float32)
    m, k = np.frexp(amax)
    e = np.where(m <= np.float32(0.75), k - 3, k - 2).astype(np.int32)
    e = np.where(amax == 0, 0, e)
    return np.clip(e, -127, 127).astype(np.int32)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w f32 [R, C] (C % 32 == 0) -> (packed u8 [R, C/2], E8M0 scale u8 [R, C/32]).

    Numba kernel; bit-identical to quantize_mxfp4_reference (the readable definition, tested)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    R, C = w.shape
    if C % N.MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs in-features divisible by {N.MXFP4_GROUP}, got {C}")
    packed = np.empty((R, C // 2), np.uint8)
    sc = np.empty((R, C // N.MXFP4_GROUP), np.uint8)
    x = np.empty((R, C), np.float32)
    k = _kernels()
    k["mx_scale"](w, sc, x)
    k["enc_e2m1_pack"](x.view(np.uint32), packed)
    return packed, sc


def quantize_mxfp4_reference(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w f32 [R, C] (C % 32 == 0) -> (packed u8 [R, C/2], E8M0 scale u8 [R, C/32]).

    Per row and group of 32 columns: e = mxfp4_exponent(amax); nibble = E2M1 RNE of w * 2^-e (exact
    scaling); byte b holds column 2b in its low nibble and 2b+1 in its high nibble; scale = e + 127.
    """
    import ml_dtypes

    w = np.ascontiguousarray(w, dtype=np.float32)
    R, C = w.shape
    G = N.MXFP4_GROUP
    if C % G:
        raise ValueError(f"MXFP4 needs in-features divisible by {G}, got {C}")
    g = w.reshape(R, C // G, G)
    e = mxfp4_exponent(np.abs(g).max(axis=2))
    x = np.ldexp(g, (-e)[:, :, None].astype(np.int32)).astype(np.float32)
    if np.abs(x).max(initial=0) > 6:
        raise AssertionError("mxfp4: scaled value beyond 6")
    codes = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8).reshape(R, C) & np.uint8(0x0F)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))).astype(np.uint8)
    return np.ascontiguousarray(packed), (e + 127).astype(np.uint8)


# ----------------------------------------------------------------------------- initialisation


_RESIDUAL_WRITERS = frozenset({"kda.o_proj", "mla.o_proj", "mlp.down_proj", "moe.expert.down_proj", "moe.shared.down_proj"})


def _init_rule(t: N.TensorSpec, cfg: Config) -> tuple[str, float, float]:
    """(law, mean, std) of one tensor's master values. law: 'normal' | 'A_log' | 'dt_bias'."""
    D, hc = cfg.hidden_size, cfg.hc_mult
    r = t.role
    norm_like = {"final_norm", "attn_norm", "ffn_norm", "kda.o_norm", "mla.q_a_norm", "mla.kv_a_norm", "indexer.k_norm"}
    if r in norm_like:
        return "normal", 1.0, 0.1
    if r == "kda.A_log":
        return "A_log", 0.0, 0.0
    if r == "kda.dt_bias":
        return "dt_bias", 0.0, 0.0
    special = {
        "embed": (0.0, 1.0),
        "lm_head": (0.0, 2.0 / math.sqrt(D)),  # logits std ~2: spread, argmax varies
        "attn_hc.fn": (0.0, 1.0 / math.sqrt(hc * D)),  # m_r ~ N(0, 1) over unit-RMS streams
        "ffn_hc.fn": (0.0, 1.0 / math.sqrt(hc * D)),
        "attn_hc.base": (0.0, 1.0),
        "ffn_hc.base": (0.0, 1.0),
        "attn_hc.scale": (1.0, 0.1),
        "ffn_hc.scale": (1.0, 0.1),
        "kda.q_conv": (0.0, 1.0 / math.sqrt(cfg.linear_conv_kernel_dim)),
        "kda.k_conv": (0.0, 1.0 / math.sqrt(cfg.linear_conv_kernel_dim)),
        "kda.v_conv": (0.0, 1.0 / math.sqrt(cfg.linear_conv_kernel_dim)),
        "kda.f_b_proj": (0.0, 3.0 / math.sqrt(cfg.linear_head_dim)),  # forget-gate pre-activation ~N(0, 9)
        "indexer.k_norm_bias": (0.0, 0.1),
        "indexer.kpool_ape": (0.0, 1.0),
        "moe.gate": (0.0, 2.0 / math.sqrt(D)),  # router logits ~N(0, 4): sigmoid scores spread
        "moe.gate_bias": (0.0, 0.05),
    }
    if r in special:
        m, s = special[r]
        return "normal", m, s
    shape = t.shape(cfg)
    fan_in = int(np.prod(shape[1:]))
    return "normal", 0.0, 1.0 / math.sqrt(fan_in)  # linear weights (and kpool gate): N(0, 1/fan_in)


def _chunk_values(t: N.TensorSpec, cfg: Config, key: int, start: int, count: int,
                  residual_scale: float = 1.0) -> np.ndarray:
    """Master float32 values of elements [start, start+count) (flat, row-major)."""
    law, mean, std = _init_rule(t, cfg)
    if t.role in _RESIDUAL_WRITERS:
        std = std * residual_scale  # x 1.0 is exact: the other entries' bytes do not move
    if law == "normal":  # = f32(normal(key, start, count) * std [+ mean]), then BF16 unless kind f32
        v = np.empty(count, np.float32)
        _kernels()["normal_f32"](np.uint64(key), np.uint64(start), count, float(std), float(mean), mean != 0.0, v)
        if t.kind != N.F32:
            _kernels()["bf16_inplace"](v.view(np.uint32))
        return v
    elif law == "A_log":  # log(U(1, 2)), then onto the BF16 grid
        v = bf16_round(np.log(1.0 + uniform(key, start, count)).astype(np.float32))
    elif law == "dt_bias":  # the peer's init: dt = exp(U(log 1e-3, log 1e-1)), dt_bias = softplus^-1(dt)
        lo, hi = math.log(1e-3), math.log(1e-1)
        dt = np.maximum(np.exp(lo + (hi - lo) * uniform(key, start, count)), 1e-4)
        v = bf16_round((dt + np.log(-np.expm1(-dt))).astype(np.float32))
    else:
        raise AssertionError(law)
    if t.kind != N.F32:
        v = bf16_round(v)
    return v


def master(cfg: Config, entry: N.Entry, seed: int = DEFAULT_SEED, rows: tuple[int, int] | None = None,
           residual_scale: float = 1.0) -> np.ndarray:
    """The master values of one tensor (float32; BF16-representable unless kind 'f32'), optionally
    only rows [r0, r1) of its first axis; residual_scale: the zoo entry's (ZooEntry.residual_scale)."""
    shape = entry.spec.shape(cfg)
    inner = int(np.prod(shape[1:]))
    r0, r1 = rows if rows is not None else (0, shape[0])
    key = tensor_key(seed, entry.key)
    v = _chunk_values(entry.spec, cfg, key, r0 * inner, (r1 - r0) * inner, residual_scale)
    return v.reshape((r1 - r0,) + tuple(shape[1:]))


# ----------------------------------------------------------------------------- planning and writing


@dataclass
class _Out:
    key: str  # stored key
    dtype: str
    shape: tuple[int, ...]
    shard: int = 0
    offset: int = 0  # absolute file offset

    @property
    def nbytes(self) -> int:
        isz = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "U8": 1}[self.dtype]
        return int(np.prod(self.shape)) * isz


@dataclass
class _Job:
    entry: N.Entry
    fmt: str  # 'f32' | 'bf16' | 'fp8' | 'mxfp4'
    outs: list[_Out]  # [weight] or [weight, scale]
    residual_scale: float = 1.0  # the entry's (ZooEntry.residual_scale)


def _stored(key: str) -> str:
    return key if key == "lm_head.weight" else "model." + key


def plan(cfg: Config, release: str, mxfp4_bf16_expert_layers: Iterable[int] = (), residual_scale: float = 1.0) -> list[_Job]:
    """What to write for one release: one job per tensor (in name-table order)."""
    if release not in RELEASES:
        raise ValueError(f"release must be one of {RELEASES}, got {release!r}")
    keep = set(mxfp4_bf16_expert_layers)
    jobs = []
    for e in N.expected(cfg):
        t = e.spec
        S = t.shape(cfg)
        sk = _stored(e.key)
        if t.kind == N.F32:
            jobs.append(_Job(e, "f32", [_Out(sk, "F32", S)]))
        elif t.kind == N.LINEAR and release == "fp8" and t.zoo_fp8:
            jobs.append(_Job(e, "fp8", [_Out(sk, "F8_E4M3", S), _Out(N.fp8_scale_key(sk), "F32", N.fp8_scale_shape(S))]))
        elif t.kind == N.LINEAR and release == "mxfp4" and t.mxfp4_ok and e.layer not in keep:
            jobs.append(
                _Job(e, "mxfp4", [_Out(sk, "U8", N.mxfp4_packed_shape(S)), _Out(N.mxfp4_scale_key(sk), "U8", N.mxfp4_scale_shape(S))])
            )
        else:
            jobs.append(_Job(e, "bf16", [_Out(sk, "BF16", S)]))
        jobs[-1].residual_scale = residual_scale
    return jobs


def _header(outs: list[_Out], metadata: dict[str, str]) -> bytes:
    """Assign offsets (F32 first, then BF16, then 1-byte types; by key within) and build the header,
    padded with spaces so that the data start at a multiple of 64 bytes."""
    order = sorted(outs, key=lambda o: ({"F32": 0, "BF16": 1}.get(o.dtype, 2), o.key))
    hdr: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    pos = 0
    for o in order:
        hdr[o.key] = {"dtype": o.dtype, "shape": list(o.shape), "data_offsets": [pos, pos + o.nbytes]}
        o.offset = pos
        pos += o.nbytes
    text = json.dumps(hdr, sort_keys=True, separators=(",", ":")).encode("utf-8")
    n = len(text) + (-(8 + len(text)) % 64)
    text = text + b" " * (n - len(text))
    for o in order:
        o.offset += 8 + n
    return struct.pack("<Q", n) + text


def _row_chunk(S: tuple[int, ...], target: int = 1 << 22) -> int:
    inner = int(np.prod(S[1:]))
    rows = max(1, target // max(inner, 1))
    if rows >= N.FP8_BLOCK:
        rows -= rows % N.FP8_BLOCK
    else:
        rows = N.FP8_BLOCK if S[0] > rows else rows  # fp8 needs whole 128-row blocks
    return min(rows, S[0])


def _produce(cfg: Config, job: _Job, seed: int, fds: dict[int, int]) -> None:
    e = job.entry
    S = e.spec.shape(cfg)
    step = _row_chunk(S)
    inner = int(np.prod(S[1:]))
    for r0 in range(0, S[0], step):
        r1 = min(S[0], r0 + step)
        v = master(cfg, e, seed, (r0, r1), job.residual_scale)
        if job.fmt == "f32":
            parts = [v.astype("<f4")]
        elif job.fmt == "bf16":  # the master is already on the BF16 grid: its high halves
            parts = [(np.ascontiguousarray(v).view(np.uint32) >> np.uint32(16)).astype("<u2")]
        elif job.fmt == "fp8":
            q, s = quantize_fp8(v.reshape(r1 - r0, inner))
            parts = [q, s.astype("<f4")]
        else:
            q, s = quantize_mxfp4(v.reshape(r1 - r0, inner))
            parts = [q, s]
        for o, p in zip(job.outs, parts):
            row_bytes = o.nbytes // o.shape[0]
            rr0 = r0 if o is job.outs[0] or job.fmt == "mxfp4" else r0 // N.FP8_BLOCK
            b = np.ascontiguousarray(p).tobytes()
            os.pwrite(fds[o.shard], b, o.offset + rr0 * row_bytes)


_WORKER_PLANS: dict[str, tuple] = {}


def _produce_in_worker(args) -> tuple[str, int]:
    (name, release, overrides, bf16_layers, seed, paths), k, places = args
    key = json.dumps([name, release, overrides, bf16_layers], sort_keys=True)
    if key not in _WORKER_PLANS:  # one plan per worker process, not per job
        cfg = zoo_config(name, **overrides)
        _WORKER_PLANS[key] = (cfg, plan(cfg, release, bf16_layers, ZOO[name].residual_scale))
    cfg, jobs = _WORKER_PLANS[key]
    job = jobs[k]
    for o, (shard, offset) in zip(job.outs, places):  # placed by the parent (_shards, _header)
        o.shard, o.offset = shard, offset
    fds = {i: os.open(paths[i], os.O_RDWR) for i in {o.shard for o in job.outs}}
    try:
        _produce(cfg, job, seed, fds)
    finally:
        for fd in fds.values():
            os.close(fd)
    return job.entry.key, sum(o.nbytes for o in job.outs)


def _shards(jobs: list[_Job], shard_bytes: int) -> int:
    n = 0
    acc = 0
    for j in jobs:
        size = sum(o.nbytes for o in j.outs)
        if shard_bytes and acc and acc + size > shard_bytes:
            n += 1
            acc = 0
        for o in j.outs:
            o.shard = n
        acc += size
    return n + 1


class NoSpaceError(OSError):
    """A checkpoint that would not fit on its filesystem (refused before anything is written)."""


SPACE_MARGIN = 64 << 20  # kept free beyond the checkpoint (and 2% of its size): logs, temp files


@dataclass
class _Layout:
    """Everything make_checkpoint writes, decided before a byte is written."""

    cfg: Config
    jobs: list[_Job]
    fnames: list[str]  # the .safetensors files
    heads: list[bytes]  # their headers
    texts: dict[str, str]  # config.json, tokenizer.json, the shard index

    def sizes(self) -> dict[str, int]:
        """file name -> its exact size in bytes."""
        out = {}
        for i, fn in enumerate(self.fnames):
            out[fn] = len(self.heads[i]) + sum(o.nbytes for j in self.jobs for o in j.outs if o.shard == i)
        for fn, text in self.texts.items():
            out[fn] = len(text.encode("utf-8"))
        return out


def _layout(name: str, release: str, seed: int, shard_bytes: int | None, mxfp4_bf16_expert_layers: Iterable[int] | None,
            tokenizer: bool | None, overrides: dict) -> _Layout:
    cfg = zoo_config(name, **overrides)
    opts = zoo_options(name, cfg, mxfp4_bf16_expert_layers)
    if shard_bytes is None:
        shard_bytes = opts["shard_bytes"]
    if tokenizer is None:
        tokenizer = opts["tokenizer"]
    jobs = plan(cfg, release, opts["mxfp4_bf16_expert_layers"], ZOO[name].residual_scale)
    nshards = _shards(jobs, shard_bytes)
    metadata = {
        "format": "pt",
        "generator": GENERATOR,
        "zoo": name,
        "release": release,
        "seed": str(seed),
        "mxfp4_bf16_expert_layers": ",".join(map(str, opts["mxfp4_bf16_expert_layers"])) if release == "mxfp4" else "",
    }
    if overrides:
        metadata["overrides"] = json.dumps(overrides, sort_keys=True)
    fnames = (
        ["model.safetensors"]
        if nshards == 1
        else [f"model-{i + 1:05d}-of-{nshards:05d}.safetensors" for i in range(nshards)]
    )
    all_outs = [o for j in jobs for o in j.outs]
    heads = [_header([o for o in all_outs if o.shard == i], metadata) for i in range(nshards)]  # places the tensors
    texts = {}
    if nshards > 1:
        index = {
            "metadata": {"total_size": sum(o.nbytes for o in all_outs)},
            "weight_map": {o.key: fnames[o.shard] for o in sorted(all_outs, key=lambda o: o.key)},
        }
        texts["model.safetensors.index.json"] = json.dumps(index, indent=2, sort_keys=True) + "\n"
    conf = cfg.to_dict()
    conf["dtype"] = "bfloat16"
    texts["config.json"] = json.dumps(conf, indent=2, sort_keys=True) + "\n"
    if tokenizer:
        texts["tokenizer.json"] = tokenizer_json(cfg.vocab_size)
    return _Layout(cfg, jobs, fnames, heads, texts)


def _replaced_bytes(out_dir: str) -> int:
    """Bytes of the files in out_dir that writing a checkpoint there removes or overwrites."""
    if not os.path.isdir(out_dir):
        return 0
    return sum(
        os.path.getsize(os.path.join(out_dir, fn))
        for fn in os.listdir(out_dir)
        if (fn.endswith(".safetensors") or fn in ("model.safetensors.index.json", "config.json", "tokenizer.json"))
        and os.path.isfile(os.path.join(out_dir, fn))
    )


def space_check(out_dirs: Iterable[str], sizes: Iterable[int]) -> tuple[bool, str, int, int, int]:
    """Would checkpoints of `sizes` bytes fit into `out_dirs` (on one filesystem: the nearest existing
    ancestor of the first)? -> (fits, that directory, bytes needed, free bytes, margin). Files the
    writes replace count as free."""
    import shutil

    out_dirs = [os.path.abspath(os.fspath(d)) for d in out_dirs]
    total = sum(sizes)
    needed = max(total - sum(_replaced_bytes(d) for d in out_dirs), 0)
    where = out_dirs[0]
    while not os.path.isdir(where):
        where = os.path.dirname(where)
    free = shutil.disk_usage(where).free
    margin = SPACE_MARGIN + total // 50
    return needed + margin <= free, where, needed, free, margin


def _no_space_message(where: str, needed: int, free: int, margin: int) -> str:
    return (f"not enough space on the filesystem of {where}: the checkpoint needs {_human(needed)} ({needed:,} bytes) "
            f"plus a margin of {_human(margin)}, {_human(free)} ({free:,} bytes) are free; nothing was written")


def _human(n: int) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):.1f} {unit}"
    return f"{n} B"


def checkpoint_sizes(
    name: str,
    release: str,
    *,
    seed: int = DEFAULT_SEED,
    shard_bytes: int | None = None,
    mxfp4_bf16_expert_layers: Iterable[int] | None = None,
    tokenizer: bool | None = None,
    **overrides: Any,
) -> dict[str, int]:
    """The files make_checkpoint would write with these arguments -> their exact sizes (nothing is written)."""
    return _layout(name, release, seed, shard_bytes, mxfp4_bf16_expert_layers, tokenizer, overrides).sizes()


def make_checkpoint(
    name: str,
    release: str,
    out_dir: str | os.PathLike,
    *,
    seed: int = DEFAULT_SEED,
    shard_bytes: int | None = None,
    mxfp4_bf16_expert_layers: Iterable[int] | None = None,
    tokenizer: bool | None = None,
    progress: Callable[[str, float], None] | None = None,
    workers: int = 1,
    check_space: bool = True,
    **overrides: Any,
) -> str:
    """Write zoo checkpoint `name` in `release` ('bf16' | 'fp8' | 'mxfp4') into `out_dir`.

    Any Config field may be overridden (e.g. n_routed_experts=16, num_hidden_layers=2 for `slice`).
    Tensors are generated and written one row-chunk at a time: memory stays small at any size.
    workers > 1 produces the tensors in that many processes (the same bytes). Raises NoSpaceError,
    before writing anything, when the files would not fit (check_space). Returns out_dir.
    """
    lay = _layout(name, release, seed, shard_bytes, mxfp4_bf16_expert_layers, tokenizer, overrides)
    out_dir = os.fspath(out_dir)
    if check_space:
        fits, where, needed, free, margin = space_check([out_dir], [sum(lay.sizes().values())])
        if not fits:
            raise NoSpaceError(_no_space_message(where, needed, free, margin))
    os.makedirs(out_dir, exist_ok=True)
    for fn in os.listdir(out_dir):  # a stale shard from an earlier run would be read as part of the model
        if fn.endswith(".safetensors") or fn == "model.safetensors.index.json":
            os.remove(os.path.join(out_dir, fn))

    cfg, jobs, fnames = lay.cfg, lay.jobs, lay.fnames
    opts = zoo_options(name, cfg, mxfp4_bf16_expert_layers)
    all_outs = [o for j in jobs for o in j.outs]
    fds: dict[int, int] = {}
    try:
        for i, fn in enumerate(fnames):
            head = lay.heads[i]
            total = len(head) + sum(o.nbytes for o in all_outs if o.shard == i)
            fd = os.open(os.path.join(out_dir, fn), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            fds[i] = fd
            os.pwrite(fd, head, 0)
            os.ftruncate(fd, total)
        done, todo = 0, sum(o.nbytes for o in all_outs)
        if workers > 1:
            # every job writes its own byte ranges of the preallocated shards: the files are the same
            # whichever process writes which job, in whatever order
            # (the jobs hold lambdas, which do not pickle, and fork is unsafe once Numba's OpenMP runs:
            # each spawned worker plans the same jobs again from the same arguments)
            paths = {i: os.path.join(out_dir, fn) for i, fn in enumerate(fnames)}
            spec = (name, release, overrides, list(opts["mxfp4_bf16_expert_layers"]), seed, paths)
            with multiprocessing.get_context("spawn").Pool(workers) as pool:
                for key, nbytes in pool.imap_unordered(
                    _produce_in_worker, [(spec, k, [(o.shard, o.offset) for o in j.outs]) for k, j in enumerate(jobs)]
                ):
                    done += nbytes
                    if progress is not None:
                        progress(key, done / max(todo, 1))
        else:
            for j in jobs:
                _produce(cfg, j, seed, fds)
                done += sum(o.nbytes for o in j.outs)
                if progress is not None:
                    progress(j.entry.key, done / max(todo, 1))
    finally:
        for fd in fds.values():
            os.close(fd)

    for fn, text in lay.texts.items():
        _write_text(os.path.join(out_dir, fn), text)
    tok_path = os.path.join(out_dir, "tokenizer.json")
    if "tokenizer.json" not in lay.texts and os.path.exists(tok_path):
        os.remove(tok_path)
    return out_dir


def make_zoo(name: str, out_root: str | os.PathLike, releases: Iterable[str] = RELEASES, **kw: Any) -> list[str]:
    """Write `name` in each release to out_root/{name}-{release}; returns the directories."""
    return [make_checkpoint(name, r, os.path.join(os.fspath(out_root), f"{name}-{r}"), **kw) for r in releases]


def _write_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


def file_hashes(directory: str | os.PathLike) -> dict[str, str]:
    """sha256 of every file in a checkpoint directory (name -> hex)."""
    out = {}
    for fn in sorted(os.listdir(directory)):
        p = os.path.join(directory, fn)
        if os.path.isfile(p):
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for blk in iter(lambda: f.read(1 << 22), b""):
                    h.update(blk)
            out[fn] = h.hexdigest()
    return out


# ----------------------------------------------------------------------------- tokenizer

_TOKENIZER_TEXT = """\
The oracle defines every bit of the output: each rounding point and each summation order is written
down, so two engines that follow the definition agree exactly, on any machine and at any batch size.
A fast engine is only trusted when its logits, tokens and every captured stage match the reference.
When they part, the diff tool names the first layer, position, stage and element where they differ.
Linear attention keeps a recurrent state; latent attention caches a compressed key and value; the
router picks the top experts of each token, and the hyper-connections mix four residual streams.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 16 32 64 128 256 512 1024 2048 4096. Punctuation: (a, b); c. d! e?
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (used by byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def tokenizer_json(vocab_size: int, text: str = _TOKENIZER_TEXT) -> str:
    """A byte-level BPE tokenizer.json with vocab <= vocab_size, trained by our own deterministic loop
    (pair counts over GPT-2-like pre-tokens; ties broken by the smaller pair)."""
    import re

    b2u = _bytes_to_unicode()
    words: dict[tuple[str, ...], int] = {}
    for w in re.findall(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+", text):
        sym = tuple(b2u[b] for b in w.encode("utf-8"))
        words[sym] = words.get(sym, 0) + 1
    vocab = {b2u[b]: b for b in range(256)}
    merges: list[tuple[str, str]] = []
    while len(vocab) < vocab_size:
        counts: dict[tuple[str, str], int] = {}
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                counts[(a, b)] = counts.get((a, b), 0) + c
        if not counts:
            break
        best = min(counts, key=lambda p: (-counts[p], p))
        merges.append(best)
        new = best[0] + best[1]
        vocab.setdefault(new, len(vocab))
        nw: dict[tuple[str, ...], int] = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(new)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            nw[tuple(out)] = nw.get(tuple(out), 0) + c
        words = nw
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [[a, b] for a, b in merges],
        },
    }
    return json.dumps(tok, ensure_ascii=False, indent=1) + "\n"


# ----------------------------------------------------------------------------- CLI


def _parse_value(s: str) -> Any:
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        return s


def main_make_checkpoint(argv: list[str] | None = None) -> int:
    """`oracle make-checkpoint`: write zoo checkpoints. Exit 0 on success, 2 on a usage/config error.
    Errors as every command reports them (tools/term.py): `error: ...` on stderr, or a JSON object."""
    from .term import error
    p = argparse.ArgumentParser(
        prog="oracle make-checkpoint",
        description="Write a seeded synthetic GLM-5.3-Flash checkpoint (the zoo) in one or all releases.",
        epilog="Zoo: " + "; ".join(f"{k}: {z.doc}" for k, z in ZOO.items()),
    )
    p.add_argument("name", choices=list(ZOO), help="zoo entry")
    p.add_argument("--release", default="all", choices=list(RELEASES) + ["all"], help="release to write (default all)")
    p.add_argument("--out", default="zoo", help="parent directory; writes OUT/NAME-RELEASE (default ./zoo)")
    p.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"generator seed (default {DEFAULT_SEED})")
    p.add_argument(
        "--set", action="append", default=[], metavar="FIELD=VALUE",
        help="override a config field (JSON value), e.g. --set n_routed_experts=16 --set num_hidden_layers=2",
    )
    p.add_argument("--shard-gb", type=float, default=None, help="shard size in GiB (default: one file; slice: 4)")
    p.add_argument("--mxfp4-bf16-layers", default=None, help="comma list of layers whose routed experts stay BF16 in mxfp4")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the size of what would be written; write nothing")
    p.add_argument("--json", action="store_true", help="print the written directories (and sizes) as JSON")
    a = p.parse_args(argv)

    overrides = {}
    for s in a.set:
        if "=" not in s:
            p.error(f"--set expects FIELD=VALUE, got {s!r}")
        k, v = s.split("=", 1)
        overrides[k.strip()] = _parse_value(v)
    kw: dict[str, Any] = dict(seed=a.seed, **overrides)
    if a.shard_gb is not None:
        kw["shard_bytes"] = int(a.shard_gb * (1 << 30))
    if a.mxfp4_bf16_layers is not None:
        kw["mxfp4_bf16_expert_layers"] = [int(x) for x in a.mxfp4_bf16_layers.split(",") if x.strip()]
    releases = list(RELEASES) if a.release == "all" else [a.release]
    try:
        zoo_config(a.name, **overrides)
    except (ValueError, TypeError) as e:
        return error(str(e), a.json)

    # the sizes first: a checkpoint that does not fit is refused before anything is written
    dirs = [os.path.join(a.out, f"{a.name}-{r}") for r in releases]
    sizes = [sum(checkpoint_sizes(a.name, r, **kw).values()) for r in releases]
    if not a.json:
        out = sys.stdout if a.dry_run else sys.stderr
        if a.dry_run or not a.quiet:
            for d, n in zip(dirs, sizes):
                print(f"{d}  {n:,} bytes ({_human(n)})", file=out)
            if len(dirs) > 1:
                print(f"total  {sum(sizes):,} bytes ({_human(sum(sizes))})", file=out)
    fits, where, needed, free, margin = space_check(dirs, sizes)
    if a.dry_run:
        if a.json:
            print(json.dumps({"sizes": dict(zip(dirs, sizes)), "needed": needed, "free": free, "fits": fits}))
        elif not fits:
            print(f"(would not fit: {_no_space_message(where, needed, free, margin)})")
        return 0
    if not fits:
        return error(_no_space_message(where, needed, free, margin), a.json, needed=needed, free=free)

    last = [0.0]

    def progress(key: str, frac: float) -> None:
        now = time.monotonic()
        if frac >= 1.0 or now - last[0] > 0.5:
            last[0] = now
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\r  [{bar:<30}] {frac * 100:5.1f}%  {key[:60]:<60}")
            if frac >= 1.0:
                sys.stderr.write("\n")
            sys.stderr.flush()

    bar = not a.quiet and sys.stderr.isatty()  # a progress bar only where someone watches it, never into a pipe
    for r, d in zip(releases, dirs):
        if not a.quiet:
            print(f"writing {d}", file=sys.stderr)
        t0 = time.monotonic()
        make_checkpoint(a.name, r, d, progress=progress if bar else None, check_space=False, **kw)
        if not a.quiet and not a.json:
            size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
            print(f"{d}  {size / 2**20:.1f} MiB  {time.monotonic() - t0:.1f} s")
    if a.json:
        print(json.dumps({"checkpoints": dirs, "sizes": dict(zip(dirs, sizes))}))
    return 0


if __name__ == "__main__":  # python -m tools.zoo
    sys.exit(main_make_checkpoint())
