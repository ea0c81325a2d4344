"""What batch-invariant mode (DEEPINFER_BATCH_INVARIANT=1) needs from XLA, and the check for it.

Inside the model, the mode (``ModelConfig.batch_invariant``, set by the engine)
runs every per-token computation in fixed token tiles (numerics.token_tiled: the
same shapes whatever the step holds) and gathers each token's window keys by
position into a fixed-size set; every sum a token depends on is a fixed-order
tree (numerics.fixed_sum). ARCHITECTURE.md has the phases.

Before the tiles, the mode also needed this on an AVX-512 CPU: with jax 0.10.2,
XLA's code for the same elementwise expression (e.g. softmax + eps, then a sum)
gave different bits for a token depending on the array's size once the 512-bit
path was taken (measured: [1, T, 4, 4] differs between T <= 8 and T >= 16), and
capping the ISA at AVX2 made it hold. With fixed tiles no arithmetic sees the
array's size, and the needle test also passed uncapped (XLA_FLAGS=
--xla_cpu_max_isa=AVX512_BF16: bundled model and one drawn config, budgets 13,
256, 2048); the cap stays until a wider check says it can go. The flag must be in XLA_FLAGS before JAX starts its CPU backend, so
``configure_xla()`` is called by ``import deepinfer`` when the environment asks
for the mode, and by the server's --batch-invariant flag; ``check_xla()`` refuses
to run the mode on a CPU backend started without it.
"""

from __future__ import annotations

import os

CPU_FLAG = "--xla_cpu_max_isa=AVX2"


def requested_by_env() -> bool:
    return os.environ.get("DEEPINFER_BATCH_INVARIANT") == "1"


def configure_xla() -> None:
    """Add the CPU flag to XLA_FLAGS (a no-op when present). Effective only before JAX's backend starts."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_max_isa" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " " + CPU_FLAG).strip()


def check_xla(platform: str) -> None:
    if platform == "cpu" and "xla_cpu_max_isa" not in os.environ.get("XLA_FLAGS", ""):
        raise RuntimeError(
            "batch-invariant mode on CPU needs XLA_FLAGS=" + CPU_FLAG + " set before JAX starts "
            "(AVX-512 code makes a token's bits depend on the batch size). Set DEEPINFER_BATCH_INVARIANT=1 "
            "before importing deepinfer, or start the process with that XLA_FLAGS."
        )
