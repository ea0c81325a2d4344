"""Load time and peak host memory per checkpoint format, and V4-Flash's memory per weight mode.

    python benchmarks/checkpoint_load.py [--config configs/mid.json] [--repeats 2]

Writes one random model (the config's shapes) as fp32 and bf16 safetensors, in the
release's FP8 / FP4 layout (several shards with an index), and as orbax folders,
then loads each in a fresh process (peak RSS: the high-water mark reset just before
the load, Linux's /proc/self/clear_refs) and prints
seconds and memory. On the CPU backend device arrays live in host memory, so the
loaded parameters themselves are part of the peak, and so are the memory-mapped
file pages read (page cache, reclaimable: counted in RSS, not allocated). The
column that tells whether loading streams is the anonymous overhead: the peak of
anonymous memory (sampled every 2 ms) - before loading - the loaded parameters'
bytes. A load that materialised the whole checkpoint on the host first would show
an overhead about the size of the model; a streamed one about its largest tensor.

The V4-Flash table is computed from the abstract parameter tree (no weights).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024  # kB
    raise KeyError(field)


def _reset_peak() -> None:
    # Linux: writing 5 to clear_refs resets the high-water mark, so the peak is the load's alone
    # (importing JAX and starting its backend peak higher than a small load does)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(directory: str, dtype: str, mode: str) -> None:
    import jax

    from deepinfer.model_loading import load_model

    jax.numpy.zeros(1).block_until_ready()  # the backend is up before the baseline
    _reset_peak()
    base, base_anon = _status_mib("VmRSS"), _status_mib("RssAnon")
    peak_anon = [base_anon]
    done = threading.Event()

    def sample() -> None:  # the kernel keeps no high-water mark of anonymous memory alone
        while not done.wait(0.002):
            peak_anon[0] = max(peak_anon[0], _status_mib("RssAnon"))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    _, params = load_model(directory, dtype=dtype, mtp="skip", quantized_weights=mode)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    done.set()
    sampler.join()
    nbytes = sum(x.nbytes for x in jax.tree.leaves(params))
    print(json.dumps({"seconds": seconds, "base": base, "peak": _status_mib("VmHWM"), "params_mib": nbytes / 2**20,
                      "anon_overhead": max(peak_anon[0], _status_mib("RssAnon")) - base_anon - nbytes / 2**20}))


def _write_all(cfg_path: str, work: str) -> dict[str, str]:
    import jax

    from deepinfer.config import ModelConfig
    from deepinfer.models.deepseek_v4 import model_spec
    from deepinfer.models.deepseek_v4.loader import save_official
    from deepinfer.orbax_io import save_orbax
    from deepinfer.params import init_params
    from deepinfer.quant.quantize import quantize_like_release

    cfg = ModelConfig.from_json_file(cfg_path)
    spec = model_spec(cfg, include_mtp=False)
    dirs = {}
    for dtype in ("float32", "bfloat16"):
        params = init_params(spec, jax.random.key(0), dtype)
        dirs[f"safetensors {dtype}"] = os.path.join(work, f"st_{dtype}")
        save_official(cfg, params, dirs[f"safetensors {dtype}"], max_shard_bytes=256 << 20)
        if dtype == "bfloat16":
            dirs["orbax bfloat16"] = os.path.join(work, "orbax_bf16")
            save_orbax(dirs["orbax bfloat16"], cfg, params)
    release = quantize_like_release(init_params(spec, jax.random.key(0)), dtype="bfloat16")
    dirs["safetensors FP8/FP4"] = os.path.join(work, "st_release")
    save_official(cfg, release, dirs["safetensors FP8/FP4"], max_shard_bytes=64 << 20)
    dirs["orbax FP8/FP4 kept"] = os.path.join(work, "orbax_release")
    save_orbax(dirs["orbax FP8/FP4 kept"], cfg, release)
    return dirs


def _folder_mib(path: str) -> float:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) / 2**20


def flash_memory(cfg_path: str) -> list[tuple[str, float]]:
    """GiB of V4-Flash's weights (MTP excluded) per mode, from the abstract tree."""
    from deepinfer.config import ModelConfig
    from deepinfer.models.deepseek_v4 import model_spec
    from deepinfer.params import flatten_dotted
    from deepinfer.quant.formats import FP4_GROUP, FP8_BLOCK
    from deepinfer.quant.quantize import release_format

    cfg = ModelConfig.from_json_file(cfg_path)
    specs = flatten_dotted(model_spec(cfg, include_mtp=False))

    def size(model_bytes: float, quantized: bool) -> float:
        total = 0.0
        for path, s in specs.items():
            n = 1
            for d in s.shape:
                n *= d
            kind = release_format(path) if quantized else None
            if s.dtype != "model":
                total += 4 * n  # pinned float32 / int32 leaves
            elif kind == FP8_BLOCK:
                rows, cols = s.shape[-2:]
                total += n + 4 * (n // (rows * cols)) * -(-rows // 128) * -(-cols // 128)  # e4m3 + fp32 block scales
            elif kind == FP4_GROUP:
                total += n / 2 + n / 32  # packed e2m1 + one ue8m0 byte per 32
            else:
                total += model_bytes * n
        return total / 2**30

    return [("float32", size(4, False)), ("bfloat16", size(2, False)), ("FP8/FP4 kept quantized (rest bf16)", size(2, True))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "mid.json"))
    ap.add_argument("--flash-config", default=os.path.join(ROOT, "configs", "deepseek_v4_flash.json"))
    ap.add_argument("--repeats", type=int, default=2, help="loads per row (the fastest is shown)")
    ap.add_argument("--child", nargs=3, metavar=("DIR", "DTYPE", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    rows = [
        ("safetensors float32", "float32", "dequantize"),
        ("safetensors bfloat16", "bfloat16", "dequantize"),
        ("safetensors FP8/FP4", "bfloat16", "dequantize"),
        ("safetensors FP8/FP4", "bfloat16", "keep"),
        ("orbax bfloat16", "bfloat16", "dequantize"),
        ("orbax FP8/FP4 kept", "bfloat16", "keep"),
    ]
    with tempfile.TemporaryDirectory() as work:
        t0 = time.perf_counter()
        dirs = _write_all(args.config, work)
        print(f"wrote {len(dirs)} checkpoints of {os.path.basename(args.config)} in {time.perf_counter() - t0:.1f} s\n")
        print("| source | loaded as | on disk MiB | load s | params MiB | peak RSS MiB | before MiB | "
              "anonymous overhead MiB |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for source, dtype, mode in rows:
            best = None
            for _ in range(args.repeats):
                out = subprocess.run([sys.executable, __file__, "--child", dirs[source], dtype, mode],
                                     capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
                r = json.loads(out)
                best = r if best is None or r["seconds"] < best["seconds"] else best
            loaded = f"{dtype}" if mode == "dequantize" else "kept FP8/FP4 (rest bf16)"
            overhead = best["anon_overhead"]
            print(f"| {source} | {loaded} | {_folder_mib(dirs[source]):,.0f} | {best['seconds']:.2f} | "
                  f"{best['params_mib']:,.0f} | {best['peak']:,.0f} | {best['base']:,.0f} | {overhead:,.0f} |")
    print("\nV4-Flash weights (MTP excluded), from the abstract tree:\n")
    print("| mode | GiB |")
    print("|---|---:|")
    for mode, gib in flash_memory(args.flash_config):
        print(f"| {mode} | {gib:,.1f} |")


if __name__ == "__main__":
    main()
