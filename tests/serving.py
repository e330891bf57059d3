"""The server tests' shared helpers: start `oracle serve` in a thread of the test process, stop it, read
one counter from /metrics."""
from __future__ import annotations

import argparse

from tools.serve import add_arguments, build_server, serve_in_thread


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
