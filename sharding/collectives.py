"""What a compiled program moves between devices, read from its optimized HLO.

``collectives(hlo_text)`` lists every cross-device op (all-reduce, all-gather, reduce-scatter,
all-to-all, collective-permute) with its result shapes and bytes, so a test can check that a
step communicates only where the design puts it (activations at the layer boundaries, never a
weight or a KV pool re-sharded inside the step) and BENCHMARKS.md can report bytes per step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1}
# "%name = f32[4,32]{1,0} all-reduce(" or a tuple result "(f32[2], f32[8,4]) all-gather-start("
_OP = re.compile(r"=\s*(\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+(" + "|".join(KINDS) + r")(?:-start)?\(")
_SHAPE = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
# XLA numbers the elements of a long tuple with comments ("/*index=5*/"), whose "=" would end a match
_COMMENT = re.compile(r"/\*.*?\*/")


@dataclass(frozen=True)
class Collective:
    kind: str
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of each result

    @property
    def bytes(self) -> int:
        return sum(_BYTES.get(dt, 4) * int(np.prod(dims)) for dt, dims in self.shapes)


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective in an HLO module's text (an async pair counted once, at its start)."""
    found = []
    for m in _OP.finditer(_COMMENT.sub("", hlo_text)):
        shapes = tuple((dt, tuple(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE.findall(m.group(1)))
        found.append(Collective(m.group(2), shapes))
    return found


def summary(found: list[Collective]) -> dict[str, tuple[int, int]]:
    """kind -> (count, bytes of results)."""
    out: dict[str, tuple[int, int]] = {}
    for c in found:
        n, b = out.get(c.kind, (0, 0))
        out[c.kind] = (n + 1, b + c.bytes)
    return out
