"""The server tests' shared helpers: the servers' engine, start `oracle serve` in a thread of the test
process, stop it, read one counter from /metrics."""
from __future__ import annotations

import argparse
import os

from tools.serve import add_arguments, build_server, serve_in_thread

# The engine of every server the server tests start (tests/test_serve.py, test_prefix_cache.py,
# test_prefix_disk.py, test_speculate.py): GLM_SERVE_ENGINE=cuda (tools/gpu_check.sh SERVE=1) runs them on
# the CUDA engine. The references the answers are compared with stay CPU engines: the two engines give
# the same logits bit for bit, so the same answers, and a difference is a failure either way.
SERVE_ENGINE = os.environ.get("GLM_SERVE_ENGINE", "cpu:threads=1")


def engine_spec(max_context: int | None = None, base: str | None = None) -> str:
    """The servers' --engine SPEC (`base`, default GLM_SERVE_ENGINE), with max-context added when given."""
    spec = base or SERVE_ENGINE
    if max_context is None:
        return spec
    return f"{spec}{',' if ':' in spec else ':'}max-context={max_context}"


def start_server(checkpoint, engine: str, *extra):
    """`oracle serve --checkpoint CHECKPOINT --engine ENGINE EXTRA...` on a free port -> (server, uvicorn, url)."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    srv = build_server(p.parse_args(["--checkpoint", str(checkpoint), "--engine", engine, *extra]))
    uv, url = serve_in_thread(srv)
    return srv, uv, url


def stop_server(srv, uv) -> None:
    uv.should_exit = True
    uv.thread.join(10)
    srv.close()


def metric(client, name) -> int:
    """The value of the counter or gauge `name` in the server's /metrics."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return int(float(line.split()[1]))
    raise AssertionError(f"{name} is not in /metrics")
