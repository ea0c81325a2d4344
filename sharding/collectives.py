"""What a compiled program moves between devices, read from its optimized HLO.

``collectives(hlo_text)`` lists every cross-device op (all-reduce, all-gather, reduce-scatter,
all-to-all, collective-permute) with its result shapes and bytes, so a test can check that a
step communicates only where the design puts it (activations at the layer boundaries, never a
weight or a KV pool re-sharded inside the step) and BENCHMARKS.md can report bytes per step.
``in_control_flow(hlo_text)`` lists those a loop runs (once per iteration) and those a conditional's
branch runs (on some steps only): a once-per-layer exchange belongs in neither.
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
# a computation's header line: "%name (params) -> result {" or "ENTRY %name ..."
_HEADER = re.compile(r"(?:ENTRY\s+)?%?([\w.\-]+)\s*\(")
# what an instruction runs: a loop's body and condition, a conditional's branches, a call's callee
_LOOPED = re.compile(r"\b(?:body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\b(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=(%?[\w.\-]+))")
_CALLS = re.compile(r"\b(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")


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


def in_control_flow(hlo_text: str) -> dict[str, list[Collective]]:
    """The collectives a while loop runs ("loop": once per iteration) and those only a conditional's
    branch runs, outside any loop ("branch": on the steps that take it), with what those computations call."""
    text = _COMMENT.sub("", hlo_text)
    blocks = {}
    for block in re.split(r"\n(?=\S)", text):  # a computation's header starts at the line's first column
        m = _HEADER.match(block)
        if m:
            blocks[m.group(1)] = block

    def branches(body: str) -> list[str]:
        names = [n for group, single in _BRANCHES.findall(body) for n in (group.split(",") if group else [single])]
        return [n.strip().lstrip("%") for n in names]

    def reached(roots: list[str]) -> set[str]:
        seen: set[str] = set()
        while roots:
            name = roots.pop()
            if name in seen or name not in blocks:
                continue
            seen.add(name)
            roots += _CALLS.findall(blocks[name]) + branches(blocks[name])
        return seen

    looped = reached([n for b in blocks.values() for n in _LOOPED.findall(b)])
    branched = reached([n for b in blocks.values() for n in branches(b)]) - looped
    return {kind: [c for name in sorted(names) for c in collectives(blocks[name])]
            for kind, names in (("loop", looped), ("branch", branched))}


def summary(found: list[Collective]) -> dict[str, tuple[int, int]]:
    """kind -> (count, bytes of results)."""
    out: dict[str, tuple[int, int]] = {}
    for c in found:
        n, b = out.get(c.kind, (0, 0))
        out[c.kind] = (n + 1, b + c.bytes)
    return out
