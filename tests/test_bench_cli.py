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
