#!/usr/bin/env python
"""Regenerate (or check) the committed zoo checkpoints, or write any zoo entry.

    python tools/make_zoo.py                 # rewrite golden/tiny-{bf16,fp8,mxfp4}
    python tools/make_zoo.py --check         # regenerate into a temp dir, compare sha256 with golden/
    python tools/make_zoo.py small --out zoo # any entry, all releases (same options as
                                             #   `oracle make-checkpoint`)

Regenerating must give byte-identical files (tests/test_zoo.py checks it too). If --check reports a
difference, the generator changed: that changes the golden hashes as well (docs/contract.md §8), so it is a
deliberate, reviewed act.
"""

from __future__ import annotations

import os
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools import zoo  # noqa: E402

GOLDEN = os.path.join(REPO, "golden")
COMMITTED = ("tiny",)


def regenerate(root: str) -> list[str]:
    out = []
    for name in COMMITTED:
        out += zoo.make_zoo(name, root)
    return out


def check() -> int:
    bad = 0
    with tempfile.TemporaryDirectory() as tmp:
        for d in regenerate(tmp):
            base = os.path.basename(d)
            new = zoo.file_hashes(d)
            old = zoo.file_hashes(os.path.join(GOLDEN, base)) if os.path.isdir(os.path.join(GOLDEN, base)) else {}
            for fn in sorted(set(new) | set(old)):
                if new.get(fn) != old.get(fn):
                    bad += 1
                    print(f"DIFFERS  golden/{base}/{fn}: committed {old.get(fn, 'absent')[:16]} regenerated {new.get(fn, 'absent')[:16]}")
                else:
                    print(f"same     golden/{base}/{fn}  {new[fn][:16]}")
    return 1 if bad else 0


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--check":
        return check()
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv:
        return zoo.main_make_checkpoint(argv)
    for d in regenerate(GOLDEN):
        size = sum(os.path.getsize(os.path.join(d, f)) for f in os.listdir(d))
        print(f"{os.path.relpath(d, REPO)}  {size / 2**20:.2f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
