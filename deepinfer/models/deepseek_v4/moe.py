"""V4 mixture of experts: hash- or score-routed experts plus a shared expert.

Router scores are ``sqrt(softplus(x @ gate.T))`` (or sigmoid). Score layers pick the
top-k of ``score + bias`` (the bias only selects); hash layers take the experts
from the fixed ``tid2eid[token]`` table. The chosen scores are renormalised and
multiplied by ``routed_scaling_factor``. Experts are clamped SwiGLU MLPs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from deepinfer.config import HASH_MOE, ModelConfig
from deepinfer.models.deepseek_v4.ops import linear, swiglu
from deepinfer.models.deepseek_v4.weight_layout import InOut
from deepinfer.numerics import fixed_sum, opaque_count
from pallas_kernels import grouped_matmul as gm
from sharding.expert_placement import physical_choice

# CPU: the pair loop up to this many (token, expert) pairs per expert held, expert by expert past it
# (bundled model, one layer: the loop is ahead of expert-by-expert 2x at 16 tokens x top-2 and even at
# 256; expert-by-expert ahead at 512: BENCHMARKS.md section 8, "The MoE on a CPU")
PAIR_LOOP_PER_EXPERT = 16


def route(cfg: ModelConfig, p: dict, mlp_type: str, x: jax.Array, token_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [N, D], token_ids [N] -> (weights [N, k] fp32, experts [N, k] int32)."""
    logits = linear(x, p["weight"]).astype(jnp.float32)
    if cfg.scoring_func == "sqrtsoftplus":
        scores = jnp.sqrt(jax.nn.softplus(logits))
    else:
        scores = jax.nn.sigmoid(logits)
    if mlp_type == HASH_MOE:
        experts = p["tid2eid"][token_ids].astype(jnp.int32)
    else:
        _, experts = lax.top_k(scores + p["bias"].astype(jnp.float32), cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    weights = weights / (fixed_sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, experts


def routed_experts(cfg: ModelConfig, p: dict, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    """Sum over each token's k experts of weight * expert(x). x [N, D] -> [N, D].

    Three exact formulations, chosen by backend and (static) size:
    * accelerators, or the MoE kernel chosen (cfg.kernels, also in interpret mode on a CPU):
      grouped matmuls over expert-sorted rows (pallas_kernels/grouped_matmul.py, the kernel
      or its lax.ragged_dot reference);
    * CPU, up to 16 (token, expert) pairs per expert held (decode, verification, batch-invariant
      tiles, short chunks): a loop over the pairs, each running its expert's weights in place;
    * CPU otherwise: expert by expert over every token (unrouted experts skipped), combined with
      zero weight for the tokens not routed to it.
    XLA's CPU ragged_dot costs ~13 ms even for 2 rows (measured with 12 experts of 512x512),
    and copying each pair's expert weights out first (w[experts], the former decode path) cost
    7-12x the pair loop (BENCHMARKS.md section 8, "The MoE on a CPU").
    The choice is static (from the token count), so in batch-invariant mode, where the
    block runs in fixed token tiles, every tile takes the same formulation.
    """
    plan = cfg.sharding
    if plan is not None and plan.expert_axes:
        return _expert_parallel(cfg, p, x, weights, experts)
    return _local_experts(cfg, p, x, weights, experts)


def _local_experts(cfg: ModelConfig, p: dict, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    """The experts in ``p`` (all of them, or one device's share) on every token."""
    n, k = experts.shape
    if cfg.kernels.uses("moe") or jax.default_backend() != "cpu":
        return _grouped_experts(cfg, p, x, weights, experts)
    if n * k <= PAIR_LOOP_PER_EXPERT * cfg.n_routed_experts:  # static: the same choice on every device and tile
        return _pair_loop_experts(cfg, p, x, weights, experts)
    return _expert_by_expert(cfg, p, x, weights, experts)


def _expert_parallel(cfg: ModelConfig, p: dict, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    """Routed experts split over the plan's expert axes: every device holds E / ep experts and sees
    every token (tokens are replicated over the expert axes: attention is not split by tokens), runs
    its own experts on the tokens routed to them (the others weigh 0) and the partial sums are added
    across devices (one all-reduce of [N, D] per layer). The weights never move.

    Bytes per device per layer: the all-reduce's ~2 N D (ring); an all-to-all dispatch + combine would
    receive ~2 N k D / ep, fewer once ep > k, but needs the tokens split over devices first (attention
    data-parallel), which this layout does not have yet (BENCHMARKS.md, the parallel layout)."""
    plan = cfg.sharding
    if plan.in_data_parallel_step():
        return _expert_parallel_over_ranks(cfg, p, x, weights, experts)
    axes = plan.expert_axes
    per_device = p["w1"].shape[0] // plan.expert_parallel_size  # expert slots per device (EPLB: physical)
    spec = jax.sharding.PartitionSpec(axes)
    rep = jax.sharding.PartitionSpec()

    def local(p_local, x, weights, experts):
        out = _device_experts(cfg, p_local, x, weights, experts, jax.lax.axis_index(axes), per_device)
        return jax.lax.psum(out, axes)

    return jax.shard_map(local, mesh=plan.mesh, in_specs=(spec, rep, rep, rep), out_specs=rep,
                         check_vma=False)(p, x, weights, experts)


def _expert_parallel_over_ranks(cfg: ModelConfig, p: dict, x: jax.Array, weights: jax.Array,
                                experts: jax.Array) -> jax.Array:
    """Expert parallelism under attention data-parallel (traced per "dp" rank, each with its own
    tokens; ``p`` holds this rank's E / dp expert slots, split further over the rank's other mesh
    axes): every rank's tokens are gathered (all-gather over "dp"), each device runs its own experts
    on the tokens routed to them, the partial sums are added within the rank (all-reduce over its
    other axes) and across ranks with each rank keeping only its own tokens' sums (reduce-scatter
    over "dp"). DeepSeek / SGLang's DP-attention + EP-MoE, with the gather / scatter scheme in place
    of the all-to-all (BENCHMARKS.md, the parallel layout, compares the bytes)."""
    plan = cfg.sharding
    inner = tuple(a for a in plan.expert_axes if a != "dp" and plan.mesh.shape[a] > 1)
    inner_size = plan.expert_parallel_size // plan.data_parallel_size
    per_device = p["w1"].shape[0] // inner_size  # (p: this rank's slots)
    everyone = [jax.lax.all_gather(a, "dp", tiled=True) for a in (x, weights, experts)]

    def local(p_local, x, weights, experts):
        rank = jax.lax.axis_index("dp") * inner_size + (jax.lax.axis_index(inner) if inner else 0)
        out = _device_experts(cfg, p_local, x, weights, experts, rank, per_device)
        return jax.lax.psum(out, inner) if inner else out

    if inner:
        spec, rep = jax.sharding.PartitionSpec(inner), jax.sharding.PartitionSpec()
        out = jax.shard_map(local, mesh=jax.sharding.get_abstract_mesh(), in_specs=(spec, rep, rep, rep),
                            out_specs=rep, axis_names=frozenset(inner), check_vma=False)(p, *everyone)
    else:
        out = local(p, *everyone)
    return jax.lax.psum_scatter(out, "dp", tiled=True)


def _device_experts(cfg: ModelConfig, p_local: dict, x: jax.Array, weights: jax.Array, experts: jax.Array,
                    rank: jax.Array, per_device: int) -> jax.Array:
    """Expert-parallel device ``rank``'s share: its ``per_device`` expert slots (ids rank * per_device ...)
    on the tokens routed to them; picks of other devices' experts weigh 0."""
    ids = experts - rank * per_device
    mine = (ids >= 0) & (ids < per_device)
    return _local_experts(cfg, p_local, x, jnp.where(mine, weights, 0.0), jnp.where(mine, ids, 0))


def _expert(p: dict, e: jax.Array) -> dict:
    """Expert ``e``'s {w1, w2, w3} from the stacked [E, out, in] weights (a QuantizedArray stays
    quantized: data and scale share the leading axis), read in place by the dots that use them."""
    return jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, e, keepdims=False), p)


def _pair_loop_experts(cfg: ModelConfig, p: dict, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    """One (token, expert) pair per loop iteration, its expert's weights read in place: the cost
    follows the pairs, not the experts held. A token's k picks are added in order into its row, and
    every program runs the same body (the trip count is opaque), so a token's result does not
    depend on how many tokens share the step."""
    n, k = experts.shape
    dt = x.dtype

    def pair(i, out):
        t, j = i // k, i % k
        row = lax.dynamic_slice_in_dim(x, t, 1)
        y = expert_mlp(cfg, _expert(p, experts[t, j]), row) * weights[t, j].astype(dt)
        return lax.dynamic_update_slice_in_dim(out, lax.dynamic_slice_in_dim(out, t, 1) + y, t, 0)

    return lax.fori_loop(0, opaque_count(n * k, x), pair, jnp.zeros_like(x))


def _expert_by_expert(cfg: ModelConfig, p: dict, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    """Each expert held (all, or one device's) on every token, weighted by the token's routing
    weight for it (0 if not routed there); an expert no token was routed to is skipped."""
    dt = x.dtype
    held = p["w1"].shape[0]
    combine = jnp.zeros((x.shape[0], held), dt)
    combine = combine.at[jnp.arange(x.shape[0])[:, None], experts].add(weights.astype(dt))
    routed = jnp.any(combine != 0, axis=0)
    out = jnp.zeros_like(x)
    for e in range(held):
        def run(out, e=e):
            return out + expert_mlp(cfg, _expert(p, jnp.int32(e)), x) * combine[:, e:e + 1]

        out = lax.cond(routed[e], run, lambda out: out, out)
    return out


def _grouped_experts(cfg: ModelConfig, p: dict, x: jax.Array, weights: jax.Array, experts: jax.Array) -> jax.Array:
    """(token, expert) pairs sorted by expert; one grouped matmul per projection; scattered back."""
    n, k = experts.shape
    flat_experts = experts.reshape(-1)
    order = jnp.argsort(flat_experts, stable=True)
    token_of = order // k
    # per expert held; an expert-parallel device's foreign pairs (weight 0) count in its first group
    group_sizes = jnp.bincount(flat_experts, length=p["w1"].shape[0]).astype(jnp.int32)
    rows = x[token_of]
    kernel = cfg.kernels.uses("moe")
    swiglu_op = gm.grouped_swiglu if kernel else gm.grouped_swiglu_ref
    matmul_op = gm.grouped_matmul if kernel else gm.grouped_matmul_ref
    interpret = cfg.kernels.interpret
    hidden = swiglu_op(rows, p["w1"], p["w3"], group_sizes, limit=cfg.swiglu_limit, interpret=interpret)
    out = matmul_op(hidden, p["w2"], group_sizes, interpret=interpret)
    out = out * weights.reshape(-1)[order][:, None].astype(out.dtype)
    return jnp.zeros_like(x).at[token_of].add(out)


def expert_mlp(cfg: ModelConfig, p: dict, x: jax.Array) -> jax.Array:
    """One expert's clamped SwiGLU MLP ({w1, w2, w3} [out, in]) on rows x [n, D]: the shared expert, or
    a routed one picked out of the stack (``_expert``)."""
    return linear(swiglu(linear(x, p["w1"]), linear(x, p["w3"]), cfg.swiglu_limit), p["w2"])


def moe(cfg: ModelConfig, p: dict, mlp_type: str, x: jax.Array, token_ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B, S, D] (normed), token_ids [B, S] -> (out [B, S, D], the experts each token was routed to
    [B, S, k]: the expert-load counts of EPLB)."""
    flat = x.reshape(-1, x.shape[-1])
    weights, experts = route(cfg, p["gate"], mlp_type, flat, token_ids.reshape(-1))
    # EPLB: the experts live in physical slots (some replicated); each pick goes to one replica
    slots = physical_choice(p["placement"], experts, token_ids.reshape(-1)) if "placement" in p else experts
    axis = _width_axis(cfg.sharding, p)
    if axis is not None:
        out = _width_split_mlps(cfg, p, flat, weights, slots, axis)
    else:
        out = routed_experts(cfg, p["experts"], flat, weights, slots)
        if "shared" in p:
            out = out + expert_mlp(cfg, p["shared"], flat)
    return out.reshape(x.shape), experts.reshape(*x.shape[:-1], -1)


def _width_axis(plan, p: dict) -> str | None:
    """The mesh axis the experts' MLP width is split over when the experts themselves are not split
    (tensor parallelism without expert parallelism), with the shared expert's width split alike; else None."""
    if plan is None or plan.expert_axes:
        return None
    rules = plan.rules
    axis = rules.get("expert_mlp")
    if not isinstance(axis, str) or plan.mesh.shape.get(axis, 1) == 1:
        return None
    return axis if "shared" not in p or rules.get("mlp") == axis else None


def _width_split_mlps(cfg: ModelConfig, p: dict, x: jax.Array, weights: jax.Array, experts: jax.Array,
                      axis: str) -> jax.Array:
    """Tensor parallelism without expert parallelism: every device holds every expert's (and the
    shared expert's) slice of the MLP width, runs its slices on the tokens routed to them and the
    partial sums are added once per layer (one all-reduce of [N, D] over ``axis``). Left to XLA's
    partitioner, the reduction lands inside the CPU formulations' loops and branches instead: an
    all-reduce per (token, expert) pair in the pair loop, one per routed expert's branch at prefill
    (BENCHMARKS.md, the parallel layout)."""
    P = jax.sharding.PartitionSpec
    rows, cols = P(None, axis), P(None, None, axis)  # [E, width, D] and w2's [E, D, width]
    specs = {"experts": {"w1": rows, "w2": cols, "w3": rows}}
    mlps = {"experts": p["experts"]}
    if "shared" in p:
        # [width, D] / [D, width]; stored transposed (InOut, a CPU's layout: weight_layout.py) the other way
        width_first, width_last = ((P(None, axis), P(axis)) if isinstance(p["shared"]["w1"], InOut)
                                   else (P(axis), P(None, axis)))
        specs["shared"] = {"w1": width_first, "w2": width_last, "w3": width_first}
        mlps["shared"] = p["shared"]

    def local(mlps, x, weights, experts):
        out = _local_experts(cfg, mlps["experts"], x, weights, experts)
        if "shared" in mlps:
            out = out + expert_mlp(cfg, mlps["shared"], x)
        return jax.lax.psum(out, axis)

    rep = P()
    return jax.shard_map(local, mesh=cfg.sharding.context_mesh(), in_specs=(specs, rep, rep, rep), out_specs=rep,
                         axis_names=frozenset({axis}), check_vma=False)(mlps, x, weights, experts)
