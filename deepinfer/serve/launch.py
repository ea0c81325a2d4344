"""Start `python -m deepinfer.serve` as a child process on a free loopback port and wait until it
answers /health (the benchmarks and the tests use it; needs httpx)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], log_path: str, env: dict | None = None, timeout: float = 600.0):
    """(process, port, seconds until /health answered). The log goes to log_path."""
    port = free_port()
    t0 = time.perf_counter()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer.serve", "--port", str(port), *args],
                            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    log.close()  # the child has its own descriptor
    base = f"http://127.0.0.1:{port}"
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}):\n{open(log_path).read()[-5000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, port, time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server not up after {timeout} s:\n{open(log_path).read()[-5000:]}")


def stop(proc) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
