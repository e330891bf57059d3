#!/usr/bin/env python3
"""Kernels whose global loads the compiler scheduled before their PDL wait (docs/engine_cuda.md, "PDL").

    python tools/pdl_sass_check.py fast/_cuda.cpython-312-x86_64-linux-gnu.so [--cuobjdump PATH]

Every kernel waits for the stream's earlier kernels (pdl_enter(): griddepcontrol.wait, ACQBULK in SASS)
before it reads what they write. A load through a `const T* __restrict__` pointer may be moved above that
wait by the compiler (restrict promises the data does not change during the kernel), and then it reads
memory an earlier kernel may still be writing: in session 29 two variants of k_hb_exact read their
candidate count before the wait and chose wrong tokens, while the build they came from did not. This
lists, for every kernel that waits, the global memory instructions before its first wait; the ones known
to read what no kernel of the step writes are named in ALLOWED with the reason. Exit 1 on any other.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

# kernel name (demangled, without parameters) -> why its early loads are safe
ALLOWED = {
    "k_mla_olat": "sel_n and seg_of, uploaded by the host before the step's kernels",
    "k_mla_olat_tiled": "sel_n and seg_of, uploaded by the host before the step's kernels",
}
_MEMORY = re.compile(r"\b(LDG|LD|LDGSTS|ATOMG|RED)(\.[A-Z0-9_]+)*\b")


def cuobjdump_path(given: str | None) -> str:
    for p in (given, shutil.which("cuobjdump"), os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "cuobjdump")):
        if p and os.path.exists(p):
            return p
    sys.exit("pdl_sass_check: cuobjdump not found (--cuobjdump PATH, or CUDA_HOME)")


def early_loads(sass: str) -> dict[str, list[str]]:
    """{mangled kernel: the memory instructions before its first ACQBULK} for kernels that wait."""
    out = {}
    for part in re.split(r"\n\s*Function : ", sass)[1:]:
        name, body = part.split("\n", 1)
        wait = body.find("ACQBULK")
        if wait < 0:
            continue
        ops = [m.group(0) for m in _MEMORY.finditer(body[:wait])]
        if ops:
            out[name.strip()] = ops
    return out


def short_name(mangled: str) -> str:
    full = subprocess.run(["c++filt", mangled], capture_output=True, text=True).stdout.strip() or mangled
    base = full.replace("(anonymous namespace)::", "").split("(", 1)[0]
    return re.sub(r"<.*$", "", base).rsplit("::", 1)[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("module")
    ap.add_argument("--cuobjdump")
    args = ap.parse_args()
    sass = subprocess.run([cuobjdump_path(args.cuobjdump), "-sass", args.module], capture_output=True, text=True,
                          check=True).stdout
    if "Function : " not in sass:
        sys.exit(f"pdl_sass_check: no SASS in {args.module}")
    bad = 0
    for mangled, ops in sorted(early_loads(sass).items()):
        name = short_name(mangled)
        why = ALLOWED.get(name)
        print(f"{'allowed' if why else 'EARLY LOAD'}: {name}: {' '.join(ops)}" + (f" ({why})" if why else ""))
        bad += why is None
    print(f"pdl_sass_check: {bad} kernel(s) load before their wait without a reason on record")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
