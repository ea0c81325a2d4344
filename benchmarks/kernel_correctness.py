"""Each Pallas kernel against its pure-JAX twin on the kernel tests' ragged inputs: max |kernel - ref|.

    python benchmarks/kernel_correctness.py

Interpret mode on a CPU (the GPU lowering on a GPU). Inputs are the tests' (tests/test_kernel_*.py):
decode and prefill rows mixed, a ring that wrapped, rows with no visible compressed row, top-k
from 1 to more than the rows, empty experts and a tile straddled by several. Prints the table of
BENCHMARKS.md §12 and writes benchmarks/results/kernel_correctness.json.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.timing import write_record  # noqa: E402
from pallas_kernels import grouped_matmul as gm  # noqa: E402
from pallas_kernels.index_select import index_select, index_select_ref  # noqa: E402
from tests import test_kernel_grouped_matmul as moe_case  # noqa: E402
from tests import test_kernel_index_select as index_case  # noqa: E402
from tests import test_kernel_sparse_attention as attention_case  # noqa: E402
from tests.kernel_batches import INTERPRET  # noqa: E402


def _f32(a):
    return np.asarray(a, np.float32)


def attention_rows(dt, name):
    for compressed in (True, False):
        out, ref = attention_case._both(*attention_case._inputs(dt, compressed))
        yield "sparse_attention", name, "compressed rows + ring + step" if compressed else "ring + step", \
            float(np.abs(out - ref).max()), float(np.abs(ref).max())


def indexer_rows(dt, name):
    for k in (1, 7, 24, 100):
        args, valid = index_case._inputs(dt)
        sel, scores = index_select(*args, k=k, interpret=INTERPRET)
        ref_sel, ref_scores = index_select_ref(*args, k=k)
        seen = (np.arange(scores.shape[1])[None] < np.asarray(args[4])[:, None]) & valid[:, None]
        same = bool((np.asarray(sel)[valid] == np.asarray(ref_sel)[valid]).all())
        yield "index_select", name, f"top-{k}: scores (selection identical: {same})", \
            float(np.abs(_f32(scores)[seen] - _f32(ref_scores)[seen]).max()), float(np.abs(_f32(ref_scores)[seen]).max())


def moe_rows(dt, name):
    for sizes, n in moe_case.GROUPS.values():
        rows, w1, w3, w2, gs = moe_case._inputs(dt, sizes, n)
        hidden = gm.grouped_swiglu(rows, w1, w3, gs, limit=moe_case.LIMIT, interpret=INTERPRET)
        ref_hidden = gm.grouped_swiglu_ref(rows, w1, w3, gs, limit=moe_case.LIMIT)
        out, ref_out = gm.grouped_matmul(ref_hidden, w2, gs, interpret=INTERPRET), gm.grouped_matmul_ref(ref_hidden, w2, gs)
        diff = max(np.abs(_f32(hidden) - _f32(ref_hidden)).max(), np.abs(_f32(out) - _f32(ref_out)).max())
        yield "grouped_swiglu / grouped_matmul", name, f"rows per expert {sizes}", float(diff), \
            float(max(np.abs(_f32(ref_hidden)).max(), np.abs(_f32(ref_out)).max()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "kernel_correctness.json"))
    args = ap.parse_args()
    rows = []
    for dt, name in ((jnp.float32, "fp32"), (jnp.bfloat16, "bf16")):
        for gen in (attention_rows, indexer_rows, moe_rows):
            rows.extend(gen(dt, name))
    mode = "interpret mode" if INTERPRET else "GPU lowering"
    print(f"# {jax.default_backend()} ({mode}), jax {jax.__version__}")
    print("| kernel | dtype | case | max abs diff vs reference | max abs of reference |")
    print("|---|---|---|---:|---:|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.3g} | {r[4]:.3g} |")
    write_record({"backend": jax.default_backend(), "mode": mode, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
