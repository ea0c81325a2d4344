"""A real `python -m deepinfer.serve` process for tests (deepinfer.serve.launch underneath)."""

from __future__ import annotations

import time

import httpx

from deepinfer.serve.launch import launch, stop


class ServerProcess:
    def __init__(self, args: list[str], cache_dir: str, log_path: str, timeout: float = 180.0):
        self.log_path = log_path
        env = {"DEEPINFER_CACHE": cache_dir, "JAX_PLATFORMS": "cpu"}
        self.proc, self.port, _ = launch(args, log_path, env=env, timeout=timeout)
        self.base = f"http://127.0.0.1:{self.port}"

    def debug(self, key: str | None = None) -> dict:
        """GET /debug/engine: running / waiting / in-flight sequences, pages and slots in use."""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.get(self.base + "/debug/engine", headers=headers, timeout=30).json()

    def wait_idle(self, key: str | None = None, timeout: float = 30.0) -> dict:
        """Wait until nothing is running, waiting or in flight; returns /debug/engine then."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            d = self.debug(key)
            if d["running"] == 0 and d["waiting"] == 0 and d["sequences_in_flight"] == 0:
                return d
            time.sleep(0.05)
        raise AssertionError(f"server not idle: {self.debug(key)}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            stop(self.proc)
        return self.proc.returncode

