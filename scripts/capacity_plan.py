"""DeepSeek-V4-Flash on DeepSeek's serving layout, on paper: weights per device, KV bytes per
token, sequences per device at 64k context, and a decode tokens/s bound from memory
bandwidth and all-to-all volume. Everything comes from the abstract parameter and state
trees (no weights) plus the hardware figures below; docs/capacity_v4_flash.md explains it.

    python scripts/capacity_plan.py                      # markdown tables
    python scripts/capacity_plan.py --device h200 --context 131072 --json plan.json

What is modelled, and what is not (see the doc): weights in the release's formats (FP4 routed
experts, FP8 attention / shared-expert linears, the rest bf16 / fp32); the KV cache as this
engine stores it (bf16 rows); a decode step as one pass over the weights a device holds plus
the KV rows each sequence reads (window, CSA top-k rows, every indexer key, every HCA row); the
MoE all-to-all as FP8 dispatch + bf16 combine of every routed token copy.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict, dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from deepinfer.config import CSA, ModelConfig  # noqa: E402
from deepinfer.models.deepseek_v4.param_tree import model_spec  # noqa: E402
from deepinfer.params import flatten_dotted  # noqa: E402
from deepinfer.quant.formats import FP4_GROUP, FP8_BLOCK  # noqa: E402
from deepinfer.quant.quantize import release_format  # noqa: E402
from sharding.parallel import MESH_AXES, ParallelConfig  # noqa: E402
from sharding.rules import logical_to_partition_spec  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2**30


@dataclass(frozen=True)
class Device:
    """Public spec-sheet figures (dense, no sparsity); ``net`` is the scale-out bandwidth per GPU."""

    name: str
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    bf16_flops: float
    net_bw: float  # bytes/s, one 400 Gb/s NIC per GPU
    nvlink_bw: float  # bytes/s one way, inside a node


DEVICES = {
    "h800": Device("H800 SXM", 80e9, 3.35e12, 989e12, 50e9, 200e9),
    "h200": Device("H200 SXM", 141e9, 4.8e12, 989e12, 50e9, 450e9),
}

_DTYPE_BYTES = {"model": 2, "float32": 4, "int32": 4}  # "model": the release ships bf16


def stored_bytes(path: str, shape: tuple[int, ...], dtype: str) -> float:
    """Bytes of one tensor in the release's format (scales included)."""
    elems = math.prod(shape)
    fmt = release_format(path)
    if fmt == FP4_GROUP:  # two e2m1 values per byte, one ue8m0 byte per 32
        return elems / 2 + elems / 32
    if fmt == FP8_BLOCK:  # one e4m3 byte each, one ue8m0 byte per 128x128 block
        lead = math.prod(shape[:-2])
        return elems + lead * math.ceil(shape[-2] / 128) * math.ceil(shape[-1] / 128)
    return elems * _DTYPE_BYTES[dtype]


def split_of(axes: tuple, rules: dict, sizes: dict) -> int:
    """How many ways a tensor is split under ``rules`` over a mesh of ``sizes``."""
    parts = 1
    for target in logical_to_partition_spec(tuple(axes), rules):
        for name in (target,) if isinstance(target, str) else (target or ()):
            parts *= sizes.get(name, 1)
    return parts


def weights(cfg: ModelConfig, rules: dict, sizes: dict, include_mtp: bool, redundant: int = 0) -> dict:
    """Per-device weight bytes under a layout, by part; ``redundant`` extra expert slots per layer
    (EPLB replicas) add their share of the expert bytes to each device."""
    out = {"routed experts": 0.0, "attention + shared + dense": 0.0, "embedding + head": 0.0}
    for path, s in flatten_dotted(model_spec(cfg, include_mtp=include_mtp)).items():
        b = stored_bytes(path, s.shape, s.dtype) / split_of(s.axes, rules, sizes)
        if ".ffn.experts." in path:
            b *= (cfg.n_routed_experts + redundant) / cfg.n_routed_experts
            out["routed experts"] += b
        elif path in ("embed", "head"):
            out["embedding + head"] += b
        else:
            out["attention + shared + dense"] += b
    return out


def param_counts(cfg: ModelConfig) -> dict:
    def count(include_mtp, experts_only=False):
        return sum(math.prod(s.shape) for p, s in flatten_dotted(model_spec(cfg, include_mtp=include_mtp)).items()
                   if not experts_only or ".ffn.experts." in p)

    main = count(False)
    per_expert = count(False, True) / cfg.n_routed_experts
    active = main - count(False, True) + per_expert * cfg.num_experts_per_tok
    return {"total_without_mtp": main, "total_with_mtp": count(True), "active_per_token": active}


def kv_figures(cfg: ModelConfig) -> dict:
    """Bytes of engine state per token of context (bf16 pool rows) and per sequence slot, measured on
    the engine's own abstract state (kv/paged_state.py)."""
    from deepinfer.kv.paged_state import bytes_per_page, bytes_per_slot
    from deepinfer.models.interface import PagedLayout
    from deepinfer.models.registry import family_for

    family = family_for(cfg)
    pools = family.pools(cfg)
    layout = PagedLayout(num_slots=1, page_size=16, num_pages=tuple((p.name, 1) for p in pools))
    per_token = {p.name: bytes_per_page(family, cfg, layout, p.name, "bfloat16") / (16 * p.tokens_per_row)
                 for p in pools}
    return {"per_token": per_token, "per_token_total": sum(per_token.values()),
            "per_slot": bytes_per_slot(family, cfg, layout, "bfloat16")}


def kv_read_per_step(cfg: ModelConfig, context: int) -> float:
    """Bytes of cache one decoding sequence reads per step at ``context`` tokens (bf16): every layer its
    window; a CSA layer its top-k main rows and every indexer key (the indexer scores all of them);
    an HCA layer every row."""
    total = 0.0
    for t in cfg.layer_types:
        total += min(cfg.sliding_window, context) * cfg.head_dim * 2
        ratio = cfg.compress_ratio(t)
        if not ratio:
            continue
        rows = context // ratio
        if t == CSA:
            total += min(cfg.index_topk, rows) * cfg.head_dim * 2 + rows * cfg.index_head_dim * 2
        else:
            total += rows * cfg.head_dim * 2
    return total


def sequences_fit(dev: Device, w: dict, kv: dict, context: int, reserve: float) -> int:
    """Sequences of ``context`` tokens whose cache fits beside the weights ``w`` and the reserve."""
    return int((dev.hbm_bytes - sum(w.values()) - reserve) // (kv["per_token_total"] * context + kv["per_slot"]))


def decode_plan(cfg, dev: Device, w: dict, group: int, tp: int, kv: dict, context: int, batch: int,
                reserve: float, active: float) -> dict:
    """One engine of ``tp`` devices (tp = 1: a DP-attention rank) in an expert-parallel group of ``group``
    devices, decoding ``batch`` sequences of ``context`` tokens. V4 has one KV head, so tensor parallelism
    cannot split the cache: each of the tp devices holds and reads every sequence's KV."""
    held = sum(w.values())
    seq_bytes = kv["per_token_total"] * context + kv["per_slot"]
    fits = sequences_fit(dev, w, kv, context, reserve)
    moe_layers = len(cfg.mlp_layer_types)
    # every weight a device holds is read once per step (at batch >= 8 per rank every local expert gets
    # tokens: 64 ranks x 8 x 6 copies / 256 experts = 12 per expert), plus each sequence's KV reads
    mem = held + batch * kv_read_per_step(cfg, context)
    t_mem = mem / dev.hbm_bw
    if tp == 1:  # DP attention + EP: each token's routed copies leave (FP8 dispatch) and return (bf16 combine)
        comm = batch * moe_layers * cfg.num_experts_per_tok * cfg.hidden_size * (1 + 2) * (1 - 1 / group)
        t_net = comm / dev.net_bw
    else:  # this engine's TP + EP: per layer an fp32 all-reduce of [batch, hidden] after attention and after
        # the experts (benchmarks/collectives.py), ring: 2 (n-1)/n of the buffer per device, over NVLink
        comm = 2 * len(cfg.layer_types) * batch * cfg.hidden_size * 4 * 2 * (tp - 1) / tp
        t_net = comm / dev.nvlink_bw
    flops = batch * 2 * active / tp
    t_flop = flops / dev.bf16_flops
    overlapped = max(t_mem, t_net, t_flop)  # two micro-batches hide the communication (DeepSeek's decode)
    return {"batch": batch, "context": context, "seq_bytes": seq_bytes, "sequences_fit": fits,
            "bytes_read": mem, "t_mem_ms": t_mem * 1e3, "comm_bytes": comm, "t_net_ms": t_net * 1e3,
            "t_flop_ms": t_flop * 1e3, "step_ms_overlapped": overlapped * 1e3,
            "step_ms_serial": (t_mem + t_net) * 1e3,
            "tok_s_per_device": batch / overlapped / tp, "tok_s_per_sequence": 1 / overlapped}


def prefill_plan(cfg, dev: Device, context: int, mfu: float, active: float, kv: dict) -> dict:
    """Compute-bound prefill: 2 x active params per token plus attention (window, top-k, indexer, HCA)."""
    heads = cfg.num_attention_heads
    attn = 0.0  # score + value flops per token at the middle of the context
    mid = context // 2
    for t in cfg.layer_types:
        ratio = cfg.compress_ratio(t)
        rows = min(cfg.sliding_window, mid)
        if t == CSA:
            rows += min(cfg.index_topk, mid // 4)
            attn += 2 * cfg.index_n_heads * cfg.index_head_dim * (mid // 4)  # indexer scores every row
        elif ratio:
            rows += mid // ratio
        attn += 4 * heads * cfg.head_dim * rows
    per_token = 2 * active + attn
    tok_s = dev.bf16_flops * mfu / per_token
    return {"flops_per_token": per_token, "tok_s_per_device": tok_s, "mfu": mfu,
            "kv_out_bytes_per_s": tok_s * kv["per_token_total"]}


def build(config: str, device: str, context: int, reserve_gib: float, mfu: float, redundant: int) -> dict:
    cfg = ModelConfig.from_json_file(config)
    dev = DEVICES[device]
    kv = kv_figures(cfg)
    params = param_counts(cfg)
    active = params["active_per_token"]

    def built(tp: int) -> dict:  # the engine's own rules for TP + EP (ParallelConfig refuses DP above 1)
        return ParallelConfig(tensor_parallel_size=tp, enable_expert_parallel=True).rules()

    layouts = {
        # DeepSeek's: attention data-parallel (every rank all attention weights), experts split 64 ways
        "decode-64: DP64 attention + EP64 (target)": ({"experts": MESH_AXES}, {"dp": 64}, 64, 1),
        # what the engine builds today for a node: TP8 attention + EP8, one engine per 8-GPU node
        "decode, built today: TP8 + EP8 per node": (built(8), {"tp": 8}, 8, 8),
        "prefill-4: DP4 attention + EP4 (target)": ({"experts": MESH_AXES}, {"dp": 4}, 4, 1),
        "prefill-4, built today: TP4 + EP4": (built(4), {"tp": 4}, 4, 4),
    }
    out = {"config": os.path.relpath(config, ROOT), "device": asdict(dev), "params": params, "kv": kv,
           "kv_read_per_step": {c: kv_read_per_step(cfg, c) for c in (4096, 65536, context)}, "layouts": {}}
    for name, (rules, sizes, ep, tp) in layouts.items():
        w = weights(cfg, rules, sizes, include_mtp=True, redundant=redundant if "decode" in name else 0)
        entry = {"weights": w, "weights_total": sum(w.values()), "ep": ep, "tp": tp}
        if "decode" in name:
            most = max(sequences_fit(dev, w, kv, context, reserve_gib * GiB), 1)
            entry["decode"] = [decode_plan(cfg, dev, w, ep, tp, kv, context, b, reserve_gib * GiB, active)
                               for b in sorted({8, 32, 64, most}) if b <= most]
        out["layouts"][name] = entry
    out["prefill"] = prefill_plan(cfg, dev, context, mfu, active, kv)
    out["assumptions"] = {"context": context, "reserve_gib": reserve_gib, "mfu": mfu,
                          "redundant_experts_per_layer": redundant}
    return out


def markdown(plan: dict) -> str:
    p, kv, dev = plan["params"], plan["kv"], plan["device"]
    lines = [f"# {plan['config']} on {dev['name']} ({dev['hbm_bytes'] / 1e9:.0f} GB, "
             f"{dev['hbm_bw'] / 1e12:.2f} TB/s, {dev['net_bw'] / 1e9:.0f} GB/s per GPU to the network, "
             f"{dev['nvlink_bw'] / 1e9:.0f} GB/s NVLink one way)", "",
             f"parameters: {p['total_without_mtp'] / 1e9:.1f} B without MTP, {p['total_with_mtp'] / 1e9:.1f} B with it; "
             f"{p['active_per_token'] / 1e9:.1f} B active per token", "",
             "KV per token of context (bf16): " + ", ".join(f"{k} {v:.0f} B" for k, v in kv["per_token"].items())
             + f" -> {kv['per_token_total']:.0f} B; per sequence slot {kv['per_slot'] / 2**20:.1f} MiB", "",
             "KV read per decode step per sequence: " + ", ".join(
                 f"{c // 1024}k ctx {b / 2**20:.1f} MiB" for c, b in plan["kv_read_per_step"].items()), "",
             "| layout | routed experts | attention + shared + dense | embedding + head | total per device |",
             "|---|---|---|---|---|"]
    for name, e in plan["layouts"].items():
        w = e["weights"]
        lines.append(f"| {name} | " + " | ".join(f"{w[k] / GiB:.1f} GiB" for k in w) + f" | **{e['weights_total'] / GiB:.1f} GiB** |")
    a = plan["assumptions"]
    lines += ["", f"Decode at {a['context'] // 1024}k context ({a['reserve_gib']} GiB kept for activations, "
              f"{a['redundant_experts_per_layer']} redundant experts per layer):", "",
              "| layout | sequences fit per engine | batch per engine | read per device | t_mem ms | sent per device | t_net ms | t_flop ms | step ms (overlapped / serial) | tok/s per device | tok/s per sequence |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in plan["layouts"].items():
        for d in e.get("decode", []):
            lines.append(f"| {name} | {d['sequences_fit']} | {d['batch']} | {d['bytes_read'] / GiB:.1f} GiB | "
                         f"{d['t_mem_ms']:.2f} | {d['comm_bytes'] / 2**20:.0f} MiB | {d['t_net_ms']:.2f} | "
                         f"{d['t_flop_ms']:.2f} | {d['step_ms_overlapped']:.2f} / {d['step_ms_serial']:.2f} | "
                         f"{d['tok_s_per_device']:.0f} | {d['tok_s_per_sequence']:.1f} |")
    pf = plan["prefill"]
    lines += ["", f"Prefill (compute-bound at MFU {pf['mfu']}): {pf['flops_per_token'] / 1e9:.1f} GFLOP per token, "
              f"{pf['tok_s_per_device']:.0f} tok/s per device, KV leaving for the decode group "
              f"{pf['kv_out_bytes_per_s'] / 1e9:.2f} GB/s per device"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "deepseek_v4_flash.json"))
    ap.add_argument("--device", choices=sorted(DEVICES), default="h800")
    ap.add_argument("--context", type=int, default=65536)
    ap.add_argument("--reserve-gib", type=float, default=8.0, help="HBM kept for activations and workspace")
    ap.add_argument("--mfu", type=float, default=0.4, help="prefill's fraction of peak bf16 flops")
    ap.add_argument("--redundant-experts", type=int, default=0, help="EPLB replicas per layer (decode)")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    plan = build(args.config, args.device, args.context, args.reserve_gib, args.mfu, args.redundant_experts)
    print(markdown(plan))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan, f, indent=1)


if __name__ == "__main__":
    main()
