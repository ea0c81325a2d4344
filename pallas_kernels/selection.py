"""Which implementation each kernel op runs: the Pallas kernel or its pure-JAX reference.

One switch for the whole model. The platform in use picks a default per op
(``gpu``: the kernels; ``cpu``, ``npu`` and any other PJRT plugin platform: the
references, since Pallas lowers only to GPU and TPU), and ``DEEPINFER_KERNELS``
overrides it: ``ref`` or ``pallas`` for every op, or per op
(``attention=pallas,moe=ref``). Forcing the kernels on a CPU runs them in Pallas'
interpret mode (tests, and checking a kernel end to end without a GPU); forcing
them on a platform Pallas cannot lower to is refused at start, by name.

The choice is a static, hashable value carried on ``ModelConfig.kernels`` (set by
the engine, like batch-invariant mode), so every compiled program knows which code
it traced and no module holds a global.
"""

from __future__ import annotations

from dataclasses import dataclass

OPS = ("attention", "indexer", "moe")
CHOICES = ("ref", "pallas")
# platforms whose devices Pallas lowers to (GPU through Triton; TPU through Mosaic, not a target here)
PALLAS_PLATFORMS = ("gpu", "cuda", "rocm")
INTERPRET_PLATFORMS = ("cpu",)


class KernelChoiceError(ValueError):
    """A DEEPINFER_KERNELS value that names no op or choice, or kernels forced where they cannot run."""


@dataclass(frozen=True)
class KernelChoice:
    attention: str = "ref"  # paged sparse attention of one layer (pallas_kernels/sparse_attention.py)
    indexer: str = "ref"  # CSA indexer score + top-k (pallas_kernels/index_select.py)
    moe: str = "ref"  # grouped expert matmuls with the SwiGLU fused (pallas_kernels/grouped_matmul.py)
    interpret: bool = False  # run the Pallas kernels in interpret mode (a CPU)

    def uses(self, op: str) -> bool:
        return getattr(self, op) == "pallas"

    def describe(self) -> str:
        """The startup log line's part: which implementation each op runs."""
        mode = " (Pallas interpret mode)" if self.interpret and any(self.uses(o) for o in OPS) else ""
        return ", ".join(f"{op}={getattr(self, op)}" for op in OPS) + mode


def parse_override(spec: str | None) -> dict[str, str]:
    """DEEPINFER_KERNELS -> {op: choice}. '' or None: no override."""
    spec = (spec or "").strip()
    if not spec:
        return {}
    if spec in CHOICES:
        return {op: spec for op in OPS}
    out = {}
    for part in spec.split(","):
        op, sep, choice = part.strip().partition("=")
        if not sep or op not in OPS or choice not in CHOICES:
            raise KernelChoiceError(
                f"DEEPINFER_KERNELS={spec!r}: expected 'ref', 'pallas' or op=choice pairs with op in {OPS} and "
                f"choice in {CHOICES} (e.g. 'attention=pallas,moe=ref'); {part.strip()!r} is not one"
            )
        out[op] = choice
    return out


def choose_kernels(platform: str, spec: str | None = None) -> KernelChoice:
    """The implementation of every op on ``platform`` (the name JAX's backend was started with),
    with ``spec`` (DEEPINFER_KERNELS) overriding the platform's default."""
    default = "pallas" if platform in PALLAS_PLATFORMS else "ref"
    picked = {op: default for op in OPS} | parse_override(spec)
    forced = [op for op in OPS if picked[op] == "pallas"]
    if forced and platform not in PALLAS_PLATFORMS + INTERPRET_PLATFORMS:
        raise KernelChoiceError(
            f"DEEPINFER_KERNELS asks for Pallas kernels ({', '.join(forced)}) on platform {platform!r}, which Pallas "
            f"cannot lower to (it lowers to GPU and TPU; on a CPU it interprets); the pure-JAX references run there: "
            f"unset DEEPINFER_KERNELS or set it to 'ref'"
        )
    return KernelChoice(**picked, interpret=platform in INTERPRET_PLATFORMS)
