"""`oracle serve --prefix-cache-dir`: the prefix cache's snapshots as safetensors files that survive a
restart. A server on the directory of a closed one resumes prompts from those files with the bits of
a cold server without any cache (token ids, logprob bits, output and logprobs hashes), its metrics
count the hits from disk, and a snapshot restored from disk is the closed server's resident snapshot
bit for bit. Corrupt files, files of another server (fingerprint) and tampered arrays are skipped with
a warning; the disk budget keeps the most recently used files.
"""
from __future__ import annotations

import logging
import os
import random

import numpy as np
import pytest

from tests.test_prefix_cache import (
    ENGINE,
    _ask,
    _body,
    _metric,
    _snapshot_depths,
    _start,
    _stop,
)

httpx = pytest.importorskip("httpx")
safetensors_numpy = pytest.importorskip("safetensors.numpy")

BLOCK = 5
CHUNK = 5   # prompt chunks of one block: a snapshot at every block boundary
SHARED = (7, 23, 41)   # shared prefix lengths: snapshots at 5, 20 and 40 (tiny's index_kpool is 4)


def _u32(arrays: dict) -> dict:
    return {k: (np.ascontiguousarray(v).view(np.uint32) if v.dtype == np.float32 else v).tolist()
            for k, v in arrays.items()}


def _disk_server(golden_dir, model, d, *extra):
    return _start(golden_dir, model, "--prefix-cache-mb", "64", "--prefix-block", str(BLOCK),
                  "--max-step-tokens", str(CHUNK), "--prefix-cache-dir", str(d), *extra)


def _prompts(seed: int, first: int):
    """(warm, probe) pairs: each pair shares a prefix of one of SHARED's lengths and parts after it."""
    rng = random.Random(seed)
    out = []
    for k, P in enumerate(SHARED):
        shared = [first + k] + [rng.randrange(300) for _ in range(P - 1)]
        a0, b0 = rng.sample(range(300), 2)
        out.append((shared + [a0] + [rng.randrange(300) for _ in range(6)],
                    shared + [b0] + [rng.randrange(300) for _ in range(9)]))
    return out


def _resident(srv) -> dict:
    """The exports of the snapshots a server holds in memory, by file name."""
    return {n.disk: _u32(n.snapshot.export()) for n in srv.prefix._nodes() if n.snapshot is not None and n.disk}


@pytest.mark.parametrize("model", ["tiny-fp8", "tiny-mxfp4"])
def test_a_restarted_server_resumes_from_disk_with_the_bits_of_a_cold_one(golden_dir, tmp_path, model):
    pairs = _prompts(17, 1)
    srv, uv, url = _disk_server(golden_dir, model, tmp_path)
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            for i, (warm, _) in enumerate(pairs):
                _ask(c, _body(model, warm, i))
            assert _metric(c, "glm_prefix_cache_disk_writes_total") == srv.prefix.snapshots > 0
        resident = _resident(srv)
    finally:
        _stop(srv, uv)
    files = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert files == sorted(resident)   # one file per snapshot, named by its prefix, nothing else left

    cold_srv, cold_uv, cold_url = _start(golden_dir, model, "--max-step-tokens", str(CHUNK))
    try:
        with httpx.Client(base_url=cold_url, timeout=120) as c:
            cold = [_ask(c, _body(model, probe, i + 1)) for i, (_, probe) in enumerate(pairs)]
    finally:
        _stop(cold_srv, cold_uv)

    srv, uv, url = _disk_server(golden_dir, model, tmp_path)
    try:
        assert srv.prefix.entries == 0   # nothing read yet: the trie knows the files' prefixes only
        with httpx.Client(base_url=url, timeout=120) as c:
            for i, (warm, probe) in enumerate(pairs):
                saved0 = _metric(c, "glm_prefix_cache_saved_tokens_total")
                disk0 = _metric(c, "glm_prefix_cache_disk_hits_total")
                assert _ask(c, _body(model, probe, i + 1)) == cold[i], i
                depth = max([d for d in _snapshot_depths(len(warm), BLOCK, CHUNK) if d <= SHARED[i]] + [0])
                assert depth > 0
                assert _metric(c, "glm_prefix_cache_saved_tokens_total") - saved0 == depth, i
                assert _metric(c, "glm_prefix_cache_disk_hits_total") - disk0 == 1, i
            assert _metric(c, "glm_prefix_cache_disk_skipped_total") == 0
        # every snapshot read back is the closed server's resident one, bit for bit
        restored = _resident(srv)
        read_back = restored.keys() & resident.keys()   # (the probes' own new snapshots are not A's)
        assert len(read_back) >= len(pairs) and all(restored[n] == resident[n] for n in read_back)
    finally:
        _stop(srv, uv)


def _foreign(path, out, **meta_changes):
    """A copy of a snapshot file with its metadata changed (its arrays and digest kept)."""
    from safetensors import safe_open
    with safe_open(str(path), framework="np") as f:
        meta = dict(f.metadata())
        arrays = {k: f.get_tensor(k) for k in f.keys()}
    safetensors_numpy.save_file(arrays, str(out), metadata=dict(meta, **meta_changes))


def test_corrupt_and_foreign_files_are_skipped_with_a_warning(golden_dir, tmp_path, caplog):
    model = "tiny-fp8"
    pairs = _prompts(23, 11)
    srv, uv, url = _disk_server(golden_dir, model, tmp_path)
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            for i, (warm, _) in enumerate(pairs):
                _ask(c, _body(model, warm, 2 * i))
        depth_of = {n.disk: n.depth for n in srv.prefix._nodes() if n.disk}
    finally:
        _stop(srv, uv)
    by_depth = {d: name for name, d in depth_of.items()}
    # the 41-token prompt's deepest file (40): another server's (fingerprint changed, same name)
    foreign = tmp_path / by_depth[40]
    _foreign(foreign, foreign, fingerprint="glm-exact-0:sampling-v1:cpu:other-000000000000")
    # the 23-token prompt's deepest file (20): one value of its arrays changed (its digest kept)
    tampered = tmp_path / by_depth[20]
    from safetensors import safe_open
    with safe_open(str(tampered), framework="np") as f:
        meta, arrays = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}
    s_name = next(k for k in arrays if k.endswith(".kda.S"))
    arrays[s_name] = arrays[s_name].copy()
    arrays[s_name].view(np.uint32)[0, 0, 0] ^= 1
    safetensors_numpy.save_file(arrays, str(tampered), metadata=meta)
    # and junk: a truncated file, a safetensors file of something else
    (tmp_path / ("0" * 40 + ".safetensors")).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"a\":")
    safetensors_numpy.save_file({"x": np.zeros(3, np.float32)}, str(tmp_path / "other.safetensors"))

    caplog.set_level(logging.WARNING, logger="glm.serve.prefix")
    cold_srv, cold_uv, cold_url = _start(golden_dir, model, "--max-step-tokens", str(CHUNK))
    try:
        with httpx.Client(base_url=cold_url, timeout=120) as c:
            cold = [_ask(c, _body(model, probe, 2 * i + 1)) for i, (_, probe) in enumerate(pairs)]
    finally:
        _stop(cold_srv, cold_uv)
    srv, uv, url = _disk_server(golden_dir, model, tmp_path)
    try:
        skipped_at_start = {"0" * 40 + ".safetensors", "other.safetensors", foreign.name}
        assert {r.args[0].name for r in caplog.records if r.name == "glm.serve.prefix"} == skipped_at_start
        with httpx.Client(base_url=url, timeout=120) as c:
            assert _metric(c, "glm_prefix_cache_disk_skipped_total") == 3
            saved = []
            for i, (_, probe) in enumerate(pairs):
                saved0 = _metric(c, "glm_prefix_cache_saved_tokens_total")
                assert _ask(c, _body(model, probe, 2 * i + 1)) == cold[i], i
                saved.append(_metric(c, "glm_prefix_cache_saved_tokens_total") - saved0)
            # the tampered file is found out when read, skipped, and the request resumes one block higher
            assert _metric(c, "glm_prefix_cache_disk_skipped_total") == 4
            assert {r.args[0].name for r in caplog.records if r.name == "glm.serve.prefix"} == skipped_at_start | {tampered.name}
            assert saved == [5, 15, 35]   # (7: its 5; 23: 20 tampered, 15; 41: 40 foreign, 35)
        # skipped files are left alone (another server may own them)
        assert foreign.exists() and (tmp_path / "other.safetensors").exists()
    finally:
        _stop(srv, uv)


def test_the_disk_budget_keeps_the_most_recently_used_files(golden_dir, tmp_path):
    """The cache on its own: four prompts' snapshots under a budget of about two files; the oldest are
    deleted (and forgotten by the trie), a use renews a file, and a new cache on the directory finds
    the files that are left."""
    import fast
    from tools.serve.prefix import DiskTier, PrefixCache
    B = 4
    with fast.Engine(str(golden_dir / "tiny-fp8"), threads=1) as eng:
        def prefill(pc, ids):
            cache, node, _ = pc.restore(ids)
            cache = cache or eng.new_cache()
            eng.step([(cache, ids[cache.length:8], None, None)])
            pc.unpin(pc.insert(node, ids, cache))
            cache.close()
        probe = DiskTier(tmp_path / "probe", 1 << 30, "fp", B)
        pc = PrefixCache(eng, 1 << 24, B, None, probe)
        prefill(pc, [9] * 9)
        size = probe.bytes   # one snapshot file of 8 positions
        pc.clear()
        prompts = [[k + 1] * 9 for k in range(3)]
        disk = DiskTier(tmp_path / "d", int(2.5 * size), "fp", B)
        pc = PrefixCache(eng, 1 << 24, B, None, disk)
        for k, ids in enumerate(prompts[:2]):
            prefill(pc, ids)
            os.utime(disk.dir / disk.name(ids[:8]), ns=(k * 10**9, k * 10**9))   # distinct mtimes
        assert len(disk.files) == 2 and disk.evictions == 0
        os.utime(disk.dir / disk.name(prompts[0][:8]), ns=(5 * 10**9, 5 * 10**9))   # prompt 0's file used again
        prefill(pc, prompts[2])   # a third file: prompt 1's, now the oldest, goes
        kept = {disk.name(p[:8]) for p in (prompts[0], prompts[2])}
        assert set(os.listdir(disk.dir)) == set(disk.files) == kept
        assert disk.bytes <= disk.budget and disk.evictions == 1
        assert {n.disk for n in pc._nodes() if n.disk} == kept
        again = PrefixCache(eng, 1 << 24, B, None, DiskTier(tmp_path / "d", int(2.5 * size), "fp", B))
        assert {n.disk for n in again._nodes() if n.disk} == kept
        pc.clear()
        again.clear()


def test_a_disk_tier_needs_the_memory_tier(golden_dir, tmp_path):
    import argparse

    from tools.serve import add_arguments, build_server
    p = argparse.ArgumentParser()
    add_arguments(p)
    for extra in (["--prefix-cache-dir", str(tmp_path)], ["--prefix-cache-mb", "1", "--prefix-cache-dir",
                                                            str(tmp_path), "--prefix-cache-disk-mb", "0"]):
        args = p.parse_args(["--checkpoint", str(golden_dir / "tiny-fp8"), "--engine", ENGINE, *extra])
        with pytest.raises(ValueError, match="--prefix-cache-dir"):
            build_server(args)
