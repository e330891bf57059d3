"""tools/moe_load.py: the item plan's split of an expert load, and the tool end to end on the CPU engine."""
import re

import numpy as np

from tools import moe_load


def test_split_follows_the_plan_rule():
    counts = np.array([0, 5, 40, 64, 100])
    # threshold 32: 5 -> an item of 16; 40 and 100's remainder 36 take a lane item; 64 is one
    assert moe_load.split(counts, 32) == {"lane pairs": 204, "lane slots": 256, "small pairs": 5, "small slots": 16}
    # threshold 48: 40 and 100's remainder 36 go to items of 16 (3 each, 48 slots)
    assert moe_load.split(counts, 48) == {"lane pairs": 128, "lane slots": 128, "small pairs": 81, "small slots": 112}


def test_tool_on_the_cpu_engine(capsys):
    assert moe_load.main(["--checkpoint", "golden/tiny-fp8", "--tokens", "32", "--device", "cpu", "--thresholds", "16,48"]) == 0
    out = capsys.readouterr().out
    layers = [ln for ln in out.splitlines() if ln.startswith("layer ")]
    assert layers, out
    for ln in out.splitlines():
        if "lanes_items" in ln:
            lane_pairs, small_pairs = (int(v) for v in re.findall(r"(\d+) pairs", ln))
            assert lane_pairs + small_pairs == 32 * 2  # tiny: top 2 of 8 experts
