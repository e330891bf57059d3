"""Run a command as N expert-parallel ranks on this machine (torchrun-style; docs/ep.md).

    python -m fast.launch --ranks 2 -- oracle run --checkpoint golden/tiny-fp8 --ids 1,2,3 --max-new 8 --engine cpu
    python -m fast.launch --ranks 3 -- python my_script.py        # my_script builds fast.Engine(path)

Every rank runs the same command with RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT (what torch.distributed's env:// initialization reads, as torchrun sets them) and GLM_EP=1,
which makes fast.Engine(path) (no `ranks=` needed) one rank of a gloo group of WORLD_SIZE ranks, each
loading only its own experts. Only rank 0's standard output is shown (--all-output: every rank's);
standard error is always shown. When a rank fails, the others are stopped; the exit code is the first
failing rank's, else rank 0's. This module imports neither torch nor the engine.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fast.launch",
        description="Run COMMAND as N expert-parallel ranks (one process per rank, gloo on localhost).",
        epilog="Example: python -m fast.launch --ranks 2 -- oracle run --checkpoint golden/tiny-fp8 "
               "--ids 1,2,3 --max-new 8 --engine cpu")
    p.add_argument("--ranks", type=int, required=True, help="number of ranks (processes)")
    p.add_argument("--master-port", type=int, default=0, help="rendezvous port on 127.0.0.1 (default: a free one)")
    p.add_argument("--all-output", action="store_true", help="show every rank's standard output, not only rank 0's")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    return p


def _command(cmd: list[str]) -> list[str]:
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise SystemExit("fast.launch: no command given (put it after --)")
    if cmd[0] == "oracle" and shutil.which("oracle") is None:
        cmd = [sys.executable, "-m", "oracle"] + cmd[1:]  # a checkout without the console script installed
    elif cmd[0] in ("python", "python3") and shutil.which(cmd[0]) is None:
        cmd = [sys.executable] + cmd[1:]
    return cmd


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.ranks < 1:
        print("fast.launch: --ranks must be >= 1", file=sys.stderr)
        return 2
    cmd = _command(args.command)
    port = args.master_port or _free_port()
    procs = []
    for r in range(args.ranks):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(args.ranks),
                   LOCAL_WORLD_SIZE=str(args.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLM_EP="1")
        out = None if (r == 0 or args.all_output) else subprocess.DEVNULL
        try:
            procs.append(subprocess.Popen(cmd, env=env, stdout=out, stdin=subprocess.DEVNULL if r else None))
        except OSError as e:
            print(f"fast.launch: cannot start {cmd[0]!r}: {e}", file=sys.stderr)
            for p in procs:
                p.kill()
            return 2
    failed = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad and failed is None:
                failed = bad[0]
                print(f"fast.launch: rank {failed[0]} exited with code {failed[1]}; stopping the other ranks",
                      file=sys.stderr)
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                deadline = time.monotonic() + 10
            if failed is not None and time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
            if all(c is not None for c in codes):
                break
            time.sleep(0.05)
    except KeyboardInterrupt:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            p.wait()
        return 130
    return failed[1] if failed is not None else procs[0].returncode


if __name__ == "__main__":
    sys.exit(main())
