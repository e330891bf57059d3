#!/usr/bin/env python3
"""Where a kernel's instructions go, from ncu's per-SASS export.

    ncu -i REPORT.ncu-rep --page source --print-source sass --csv > K.csv
    python tools/ncu_blocks.py K.csv [--blocks 6] [--ops 14]

For each kernel in the export: the executed warp instructions by opcode (FFMA's share is the FMA pipe's
best case), the warp-stall reasons summed over the instructions, and the hottest basic blocks (runs of
consecutive instructions executed equally often), each with its length, executions and opcodes. Session
12 read the register-tiled GEMM this way (docs/engine_cuda.md): the chunk loop 83 instructions per 64
FFMAs, the slab's decode 142 a warp, its copies 50, its barrier 29.

    python tools/ncu_blocks.py K.csv --lines SASS.txt [--top 24]

adds where they go by source line: SASS.txt is `nvdisasm --print-line-info` of the cubin the profiled
module was built from (`cuobjdump -xelf all weights.cu.o` gives it; the kernels are built with -lineinfo).
Each kernel of the export is matched to the disassembled function with the same instruction sequence
(opcode for opcode), so no name has to agree; then its executed instructions and stall samples are summed
per file and line. nvdisasm and cuobjdump come with the CUDA toolkit, or from PyPI's nvidia-cuda-nvdisasm
and nvidia-cuda-cuobjdump wheels (`pip download --no-deps`, then unzip: a machine without a GPU reads
a profile this way). Session 21 read the lane-pass kernel so (docs/perf.md).
"""
from __future__ import annotations

import argparse
import csv
import linecache
import re
import sys
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Kernel:
    name: str
    rows: list = field(default_factory=list)  # (address, opcode, executed, {stall: samples})


def opcode(source: str) -> str:
    """The instruction's opcode without its modifiers or predicate: '@!P0 LDS.128 R4, [R2]' -> 'LDS'."""
    s = re.sub(r"^@!?U?P\w+\s+", "", source.strip())
    return s.split()[0].split(".")[0] if s else "?"


def read(path: str) -> list[Kernel]:
    kernels: list[Kernel] = []
    header: list[str] | None = None
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                kernels.append(Kernel(row[1] if len(row) > 1 else "?"))
                header = None
                continue
            if row[0] == "Address" and "Source" in row:
                header = row
                continue
            if header is None or not kernels or len(row) < len(header):
                continue
            ix = {h: i for i, h in enumerate(header)}
            stalls = {h[len("stall_"):]: int(row[i] or 0) for h, i in ix.items()
                      if h.startswith("stall_") and "Not Issued" not in h}
            kernels[-1].rows.append((row[ix["Address"]], opcode(row[ix["Source"]]),
                                     int(row[ix["Instructions Executed"]] or 0), stalls))
    return kernels


def blocks(k: Kernel) -> list[tuple[int, int, Counter]]:
    """Runs of consecutive instructions with one execution count: (count, length, opcodes)."""
    out: list[tuple[int, int, Counter]] = []
    for _, op, n, _ in k.rows:
        if out and out[-1][0] == n:
            out[-1][2][op] += 1
            out[-1] = (n, out[-1][1] + 1, out[-1][2])
        else:
            out.append((n, 1, Counter({op: 1})))
    return out


def summary(k: Kernel, n_blocks: int = 6, n_ops: int = 14) -> dict:
    ops, stalls = Counter(), Counter()
    for _, op, n, st in k.rows:
        ops[op] += n
        stalls.update(st)
    hot = sorted((b for b in blocks(k) if b[0] > 0), key=lambda b: -b[0] * b[1])[:n_blocks]
    return {"name": k.name, "instructions": sum(ops.values()), "ops": ops.most_common(n_ops),
            "stalls": stalls.most_common(), "blocks": hot}


_FUNC = re.compile(r"^\.text\.(\S+):")
_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')
_INSN = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def read_disasm(path: str) -> dict[str, list[tuple[str, tuple[str, int] | None]]]:
    """nvdisasm --print-line-info output: each function's instructions in order, as (opcode, (file, line)),
    the line the last line-info comment before it names (None before the first)."""
    funcs: dict[str, list] = {}
    cur: list | None = None
    where = None
    with open(path) as f:
        for text in f:
            m = _FUNC.match(text)
            if m:
                cur = funcs.setdefault(m.group(1), [])
                where = None
                continue
            if cur is None:
                continue
            m = _LINE.search(text)
            if m:
                where = (m.group(1), int(m.group(2)))
                continue
            m = _INSN.match(text)
            if m:
                cur.append((opcode(m.group(2)), where))
    return funcs


def by_line(k: Kernel, funcs: dict) -> tuple[str, Counter, Counter, Counter] | None:
    """The function whose instructions are k's, opcode for opcode, and k's executed instructions, FFMAs
    and stall samples summed per (file, line); None where no function matches."""
    ops = [op for _, op, _, _ in k.rows]
    for name, insns in funcs.items():
        if len(insns) == len(ops) and all(o == i[0] for o, i in zip(ops, insns)):
            ex, ff, st = Counter(), Counter(), Counter()
            for (_, op, n, stalls), (_, where) in zip(k.rows, insns):
                ex[where] += n
                st[where] += sum(stalls.values())
                if op == "FFMA":
                    ff[where] += n
            return name, ex, ff, st
    return None


def source_text(where: tuple[str, int] | None) -> str:
    return linecache.getline(where[0], where[1]).strip()[:70] if where else ""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("csv")
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--ops", type=int, default=14)
    p.add_argument("--lines", default=None, help="nvdisasm --print-line-info of the profiled module's cubin")
    p.add_argument("--top", type=int, default=24, help="source lines shown with --lines")
    a = p.parse_args(argv)
    kernels = read(a.csv)
    if not kernels:
        print(f"{a.csv}: no kernel in it (an ncu --page source --csv export?)", file=sys.stderr)
        return 1
    funcs = read_disasm(a.lines) if a.lines else {}
    for k in kernels:
        s = summary(k, a.blocks, a.ops)
        total = s["instructions"] or 1
        print(f"== {s['name']}: {s['instructions'] / 1e6:.1f} M warp instructions executed")
        print("  " + ", ".join(f"{op} {n / total:.1%}" for op, n in s["ops"]))
        st_total = sum(n for _, n in s["stalls"]) or 1
        print("  stalls: " + ", ".join(f"{r} {n / st_total:.1%}" for r, n in s["stalls"][:8] if n))
        for n, length, mix in s["blocks"]:
            print(f"  block of {length} executed {n:,} times ({n * length / total:.1%}): "
                  + " ".join(f"{op} {c}" for op, c in mix.most_common(10)))
        if a.lines:
            found = by_line(k, funcs)
            if found is None:
                print(f"  no function of {a.lines} has this kernel's {len(k.rows)} instructions")
                continue
            name, ex, ff, st = found
            samples = sum(st.values()) or 1
            print(f"  by source line ({name[:60]}...):")
            for where, n in ex.most_common(a.top):
                loc = f"{where[0].split('/')[-1]}:{where[1]}" if where else "?"
                print(f"    {loc:24s} {n / total:6.1%} (FFMA {ff[where] / total:5.1%}), stalls {st[where] / samples:5.1%}"
                      f"  {source_text(where)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
