"""A real `python -m deepinfer.serve` process for tests (deepinfer.serve.launch underneath)."""

from __future__ import annotations

from deepinfer.serve.launch import launch, stop


class ServerProcess:
    def __init__(self, args: list[str], cache_dir: str, log_path: str, timeout: float = 180.0):
        self.log_path = log_path
        env = {"DEEPINFER_CACHE": cache_dir, "JAX_PLATFORMS": "cpu"}
        self.proc, self.port, _ = launch(args, log_path, env=env, timeout=timeout)
        self.base = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            stop(self.proc)
        return self.proc.returncode

