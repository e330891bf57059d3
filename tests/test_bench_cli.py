"""`oracle bench` runs every engine on the same prompt, reports ratios and checks the tokens agree."""
from __future__ import annotations

import json

import pytest

from tools.cli import main


def test_bench_reports_ratios_and_same_tokens(capsys, golden_dir):
    pytest.importorskip("fast._core")
    assert main(["bench", "--checkpoint", str(golden_dir / "tiny-mxfp4"), "--engines", "oracle,cpu",
                 "--prompt-len", "12", "--new", "4", "--json"]) == 0
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    oracle_row, cpu_row = r["engines"]
    assert oracle_row["prefill_x"] == 1.0 and cpu_row["same_tokens_as_first"]
    assert cpu_row["decode_tok_s"] > 0 and r["active_weight_bytes_per_token"] > 0


def test_bench_refuses_a_too_short_run(golden_dir):
    assert main(["bench", "--checkpoint", str(golden_dir / "tiny-bf16"), "--new", "1"]) == 2


# -- bench --serve: the load generator of tools/serve/loadgen.py --------------------------------------

def _oracle(*args, timeout=120):
    import subprocess
    import sys
    from pathlib import Path
    return subprocess.run([sys.executable, "-m", "tools", *args], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=timeout, check=False)


SERVE_LOAD = ("bench", "--checkpoint", "golden/tiny-fp8", "--serve", "--concurrency", "1,2", "--requests", "3",
              "--prompt-len", "8", "--new", "4")


def test_bench_serve_reports_throughput_ttft_and_tpot_per_concurrency():
    pytest.importorskip("fast._core")
    pytest.importorskip("httpx")
    p = _oracle(*SERVE_LOAD)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "8 prompt + 4 new tokens" in p.stdout                       # bench's options reached the load
    header = next(line for line in p.stdout.splitlines() if "conc" in line)
    for name in ("server tok/s", "offline tok/s", "TTFT p50/p99", "TPOT p50/p99"):
        assert name in header, (name, header)
    p = _oracle(*SERVE_LOAD, "--json")
    assert p.returncode == 0, p.stdout + p.stderr
    r = json.loads(p.stdout)
    assert (r["engine"], r["prompt"], r["new"]) == ("cpu", 8, 4)
    assert [x["concurrency"] for x in r["levels"]] == [1, 2] and [x["requests"] for x in r["levels"]] == [3, 3]
    for x in r["levels"]:
        assert x["same_tokens_as_offline"], x
        assert x["server_tok_s"] > 0 and 0 < x["ttft_p50_ms"] <= x["ttft_p99_ms"] and 0 < x["tpot_p50_ms"] <= x["tpot_p99_ms"]
        # where each side's wall went: 3 requests of 8 prompt + 4 new tokens take at least 4 steps on
        # either side (a prompt step, then 3 decodes), each step inside the wall
        for side in ("server_steps", "offline_steps"):
            b = x["runs"][0][side]
            assert b["steps"] >= 4 and b["rows_per_step"] >= 1 and 0 < b["engine_s"] <= b["wall_s"], (side, b)
    assert r["client_procs"] >= 1


@pytest.mark.parametrize("args, words", [
    (("--serve", "--engines", "oracle"), ("--serve", "oracle")),
    (("--serve", "--engines", "cpu", "cpu:threads=1"), ("--serve", "one engine SPEC")),
    (("--serve", "--concurrency", "1,0"), ("--concurrency", "1,0")),
    (("--concurrency", "4"), ("--concurrency", "--serve")),
    (("--url", "http://127.0.0.1:1"), ("--url", "--serve")),
])
def test_bench_serve_refuses_what_it_cannot_run(args, words):
    p = _oracle("bench", "--checkpoint", "golden/tiny-fp8", *args)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr
    for w in words:
        assert w in p.stderr, (w, p.stderr)


# -- tools/bench_cpu.py --gemm / --prefill-on: the CPU A/B measurements (docs/perf.md, "Session 35") ------

def test_bench_cpu_gemm_and_prefill_lines(golden_dir):
    pytest.importorskip("fast._core")
    from tools.bench_cpu import bench_gemm, bench_prefill
    g = bench_gemm(rows=96, cols=256, tokens=(1, 7), releases=("fp8", "mxfp4"), warm=1, reps=3)
    assert [(x["release"], x["tokens"]) for x in g["runs"]] == [("fp8", 1), ("fp8", 7), ("mxfp4", 1), ("mxfp4", 7)]
    assert g["fma_peak_MACs_per_ns"] > 0 and all(0 < x["of_fma_peak"] == x["MACs_per_ns"] / g["fma_peak_MACs_per_ns"]
                                                for x in g["runs"])
    # each run against its roofline: max(weight bytes / copy bandwidth, multiply-adds / FMA peak), both measured
    assert g["copy_Bps"] > 0
    for x in g["runs"]:
        wbytes = 96 * 256 + 1 * 2 * 4 if x["release"] == "fp8" else 96 * 128 + 96 * 8  # codes + scales
        t_mem, t_fma = wbytes / g["copy_Bps"], 96 * 256 * x["tokens"] / (g["fma_peak_MACs_per_ns"] * 1e9)
        assert x["roofline_s"] == max(t_mem, t_fma) and x["bound"] == ("memory" if t_mem >= t_fma else "FMA")
        assert x["of_roofline"] == x["roofline_s"] / x["seconds"] > 0
    from fast import _core
    assert {x["kernels"] for x in g["runs"]} == {_core.cpu_kernels()["chosen"]}
    ks = tuple(_core.cpu_kernels()["available"])  # --kernels: each build by turns, every shape
    g2 = bench_gemm(rows=96, cols=256, tokens=(3,), releases=("bf16",), warm=1, reps=1, kernels=ks)
    assert [x["kernels"] for x in g2["runs"]] == list(ks)
    f = bench_prefill(str(golden_dir / "tiny-fp8"), lengths=(3, 5), warm=1, reps=3)
    assert sorted(f["prefill_tok_s"]) == [3, 5] and min(f["prefill_tok_s"].values()) > 0
    assert all(f["of_roofline"][L] > 0 and f["bound"][L] in ("memory", "FMA") for L in (3, 5))


def test_bench_cpu_machine_names_the_kernels():
    """The machine facts of every bench_cpu report name the linear kernels' build the engine runs there."""
    core = pytest.importorskip("fast._core")
    from tools.bench_cpu import machine_info
    k = machine_info()["cpu_kernels"]
    assert k == core.cpu_kernels()["chosen"] and k in core.cpu_kernels()["available"]


def test_cpu_step_roofline_counts_the_step(golden_dir):
    """step_roofline: the CUDA rooflines' formula over CPU ceilings; with a copy bandwidth that makes memory free,
    a step's time is its multiply-adds (the experts k of E a token, the head on the rows that want logits) / peak."""
    pytest.importorskip("fast._core")
    from oracle.checkpoint import open_checkpoint
    from tools.bench_cpu import step_roofline
    from tools.bench_throughput import weight_census
    path = str(golden_dir / "tiny-bf16")
    with open_checkpoint(path, verify=False) as ck:
        cfg = ck.config
    c = weight_census(path)
    # (peak 0.5 MAC/ns = 1e9 FLOP/s and copy 1 B/s: the expected values below are the formula's own operations in
    # its order, so they compare exactly)
    roof = step_roofline(path, {"copy_Bps": 1e30, "fma_peak_MACs_per_ns": 0.5})
    k, E = cfg.num_experts_per_tok, cfg.n_routed_experts
    for tokens, head in ((1, 1), (8, 8), (16, 1)):
        flops = 2.0 * (tokens * (c["dense_mac"] + c["expert_mac"] * k / E) + head * c["head_mac"])
        assert roof(tokens, head) == (flops / 1e9, "FMA")
    touched = E * (1 - (1 - k / E) ** 4)
    assert step_roofline(path, {"copy_Bps": 1.0, "fma_peak_MACs_per_ns": 1e30})(4, 4) == \
        ((c["dense_bytes"] + c["expert_bytes"] * touched / E) / 1.0, "memory")


def test_bench_cpu_batch_and_shape(golden_dir):
    """--batch-on: the engine's batched greedy decode, one figure per batch; --shape: refused unless ROWSxCOLS."""
    pytest.importorskip("fast._core")
    from tools.bench_cpu import bench_batch
    b = bench_batch(str(golden_dir / "tiny-bf16"), batches=(2, 3), warm=1, reps=3)
    assert sorted(b["batch_tok_s"]) == [2, 3] and min(b["batch_tok_s"].values()) > 0
    assert all(b["of_roofline"][B] > 0 and b["bound"][B] in ("memory", "FMA") for B in (2, 3))
    import subprocess
    import sys
    from pathlib import Path
    p = subprocess.run([sys.executable, "tools/bench_cpu.py", "--gemm", "--shape", "8192by4096"],
                       cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "--shape '8192by4096'" in p.stderr, p.stderr


def test_bench_peer_cpu_batched_decode_rows(golden_dir):
    """tools/bench_peer_cpu.py --batches: a row per thread count and batch, both sides timed on the same prompts."""
    pytest.importorskip("fast._core")
    pytest.importorskip("transformers")
    from tools.bench_peer_cpu import batch_prompts, format_peer_report, run_peer_bench
    r = run_peer_bench(str(golden_dir / "tiny-bf16"), prompt=5, new=3, threads=(1,), reps=1, pause=0, warmup=1,
                       batches=(2, 3))
    rows = r["runs"][1]["batch_decode"]
    assert sorted(rows) == [2, 3]
    for B, b in rows.items():
        assert b["peer_tok_s"] > 0 and b["engine_tok_s"] > 0
        assert b["ratio"] == pytest.approx(b["engine_tok_s"] / b["peer_tok_s"], rel=1e-12)
        assert 0 <= b["sequences_agreeing"] <= B and b["steps"] == 3
    text = format_peer_report(r)
    assert "| 1 | 3 |" in text and f"{rows[3]['sequences_agreeing']}/3 |" in text
    assert batch_prompts(3, 1000).shape == (3, 8) and (batch_prompts(3, 1000) == batch_prompts(3, 1000)).all()


def test_bench_peer_cpu_names_its_peer_and_refuses_unknown_implementations(golden_dir):
    pytest.importorskip("transformers")
    from tools.bench_peer_cpu import load_peer
    with pytest.raises(ValueError, match="experts one of .*'grouped_mm'.*got 'eager', 'fused'"):
        load_peer(str(golden_dir / "tiny-bf16"), "eager", "fused")
    model, head = load_peer(str(golden_dir / "tiny-bf16"), "sdpa", "grouped_mm")
    assert model.config._attn_implementation == "sdpa" and model.config._experts_implementation == "grouped_mm"
    assert head.shape == (model.config.vocab_size, model.config.hidden_size)


def test_bench_throughput_rows_say_what_the_peer_needs():
    """A row's shares: the engine's of the step roofline, and the peer's (what the engine must reach to match it);
    a failed peer leaves both of its figures empty and keeps its error."""
    from tools.bench_throughput import table_row
    r = table_row("prefill", 2048, 0.5, 0.25, 0.125, "FFMA")
    assert (r["engine_tok_s"], r["peer_tok_s"], r["of_roofline"], r["peer_of_roofline"]) == (4096.0, 8192.0, 0.25, 0.5)
    e = table_row("decode", 256, 0.5, "OutOfMemoryError: ...", 0.125, "HBM")
    assert (e["peer_s"], e["peer_tok_s"], e["peer_of_roofline"], e["peer_error"]) == \
        (None, None, None, "OutOfMemoryError: ...")
    assert table_row("decode", 8, 0.5, None, 0.125, "HBM")["peer_error"] is None
