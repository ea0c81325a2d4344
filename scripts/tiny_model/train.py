"""Training loop for the bundled model: deepinfer's own forward + MTP, optax AdamW.

Loss = cross-entropy of the next token + MTP_WEIGHT * cross-entropy of the MTP
block's token t+2 (it reads the main model's pre-head streams at t and the true
token t+1, as in training DeepSeek-V3/V4). Score-routed layers keep their experts
balanced without an auxiliary loss, the DeepSeek way: after each step a layer's
selection bias moves by BIAS_RATE towards experts that got fewer tokens than the
mean. Hash layers route by their fixed random token table.

Deterministic under a seed: the same corpus, seed and step count give the same
weights (data order from numpy's seeded generator, XLA CPU's reductions are fixed).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from deepinfer.config import SCORE_MOE, ModelConfig
from deepinfer.models.deepseek_v4 import model_spec
from deepinfer.models.deepseek_v4.model import (
    default_positions,
    forward_with_intermediates,
)
from deepinfer.models.deepseek_v4.moe import route
from deepinfer.models.deepseek_v4.mtp import mtp_forward
from deepinfer.params import flatten_dotted, init_params, unflatten_dotted

MTP_WEIGHT = 0.3
BIAS_RATE = 1e-3


def split_trainable(params: dict) -> tuple[dict, dict]:
    """Float leaves (trained) and integer leaves (the hash-routing tables, fixed)."""
    flat = flatten_dotted(params)
    train = {k: v for k, v in flat.items() if jnp.issubdtype(v.dtype, jnp.floating)}
    fixed = {k: v for k, v in flat.items() if k not in train}
    return train, fixed


def _cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]


def model_outputs(cfg: ModelConfig, like: dict, train: dict, fixed: dict, rows: jax.Array):
    """rows [B, S+1] -> (main logits [B, S, V], MTP logits [B, S-1, V], per-layer intermediates)."""
    params = unflatten_dotted(like, {**train, **fixed})
    inputs = rows[:, :-1]
    logits, streams, aux = forward_with_intermediates(cfg, params, inputs)
    positions = default_positions(inputs)
    # MTP at t reads the streams at t and the true token t+1 (= rows[:, t+1]); predicts rows[:, t+2].
    mtp_logits, _ = mtp_forward(cfg, params, 0, streams[:, :-1], rows[:, 1:-1], positions[:, :-1])
    return logits, mtp_logits, aux, params


def expert_loads(cfg: ModelConfig, params: dict, aux: list[dict], rows: jax.Array) -> dict[int, jax.Array]:
    """Tokens routed to each expert, per score-routed layer (selection only: no gradient)."""
    loads = {}
    for i, mlp_type in enumerate(cfg.mlp_layer_types):
        if mlp_type != SCORE_MOE:
            continue
        x = jax.lax.stop_gradient(aux[i]["ffn_in"]).reshape(-1, cfg.hidden_size)
        _, experts = route(cfg, params["layers"][i]["ffn"]["gate"], mlp_type, x, rows[:, :-1].reshape(-1))
        loads[i] = jnp.bincount(experts.reshape(-1), length=cfg.n_routed_experts)
    return loads


def loss_fn(cfg, like, train, fixed, rows):
    logits, mtp_logits, aux, params = model_outputs(cfg, like, train, fixed, rows)
    main = _cross_entropy(logits, rows[:, 1:]).mean()
    mtp = _cross_entropy(mtp_logits, rows[:, 2:]).mean()
    return main + MTP_WEIGHT * mtp, (main, mtp, expert_loads(cfg, params, aux, rows))


def make_optimizer(peak_lr: float, warmup: int, total: int, weight_decay: float):
    schedule = optax.warmup_cosine_decay_schedule(0.0, peak_lr, warmup, total, end_value=peak_lr * 0.1)
    # decay matrices only: norms, sinks, hc bases/scales, positional biases and router biases keep their values
    decay_mask = lambda tree: {k: v.ndim >= 2 for k, v in tree.items()}  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(schedule, b1=0.9, b2=0.95, eps=1e-8, weight_decay=weight_decay, mask=decay_mask),
    ), schedule


def make_train_step(cfg: ModelConfig, like: dict, optimizer):
    def step(train, opt_state, fixed, rows):
        (loss, (main, mtp, loads)), grads = jax.value_and_grad(
            functools.partial(loss_fn, cfg, like), has_aux=True)(train, fixed, rows)
        updates, opt_state = optimizer.update(grads, opt_state, train)
        train = optax.apply_updates(train, updates)
        for i, load in loads.items():  # auxiliary-loss-free balancing
            key = f"layers.{i}.ffn.gate.bias"
            train[key] = train[key] + BIAS_RATE * jnp.sign(load.mean() - load).astype(jnp.float32)
        return train, opt_state, {"loss": loss, "main": main, "mtp": mtp, "grad_norm": optax.tree.norm(grads)}

    return jax.jit(step, donate_argnums=(0, 1))


def make_eval_step(cfg: ModelConfig, like: dict):
    """Sums over a batch: main CE, MTP CE, MTP top-1 == true t+2, MTP top-1 == the main model's top-1 at t+1."""

    def evaluate(train, fixed, rows):
        logits, mtp_logits, _, _ = model_outputs(cfg, like, train, fixed, rows)
        main = _cross_entropy(logits, rows[:, 1:])
        mtp = _cross_entropy(mtp_logits, rows[:, 2:])
        mtp_top = jnp.argmax(mtp_logits, -1)
        return {
            "main_sum": main.sum(), "main_n": main.size, "mtp_sum": mtp.sum(), "mtp_n": mtp.size,
            "main_top1_hits": (jnp.argmax(logits, -1) == rows[:, 1:]).sum(),
            "mtp_top1_hits": (mtp_top == rows[:, 2:]).sum(),
            "mtp_agree_hits": (mtp_top == jnp.argmax(logits[:, 1:], -1)).sum(),
        }

    return jax.jit(evaluate)


def evaluate(eval_step, train, fixed, val_rows: np.ndarray, batch: int) -> dict:
    totals: dict[str, float] = {}
    for start in range(0, len(val_rows) - batch + 1, batch):
        out = eval_step(train, fixed, jnp.asarray(val_rows[start : start + batch]))
        for k, v in out.items():
            totals[k] = totals.get(k, 0.0) + float(v)
    main, mtp = totals["main_sum"] / totals["main_n"], totals["mtp_sum"] / totals["mtp_n"]
    return {
        "val_loss": main, "val_ppl": float(np.exp(main)), "val_mtp_loss": mtp,
        "val_top1": totals["main_top1_hits"] / totals["main_n"],
        "mtp_top1": totals["mtp_top1_hits"] / totals["mtp_n"],
        "mtp_agreement": totals["mtp_agree_hits"] / totals["mtp_n"],
        "val_tokens": int(totals["main_n"]),
    }


def init_model(cfg: ModelConfig, seed: int) -> dict:
    return init_params(model_spec(cfg, include_mtp=True), jax.random.key(seed), "float32")


def train(cfg: ModelConfig, train_stream: np.ndarray, val_rows: np.ndarray, *, seed: int, steps: int, batch: int,
          seq_len: int, peak_lr: float, warmup: int, weight_decay: float, eval_every: int, eval_batch: int,
          log=print) -> tuple[dict, list[dict]]:
    from scripts.tiny_model.data import shuffled_rows

    params = init_model(cfg, seed)
    like = jax.tree.map(lambda x: 0, params)
    train_p, fixed = split_trainable(params)
    optimizer, schedule = make_optimizer(peak_lr, warmup, steps, weight_decay)
    opt_state = optimizer.init(train_p)
    step_fn = make_train_step(cfg, like, optimizer)
    eval_fn = make_eval_step(cfg, like)
    history: list[dict] = []
    epoch, rows, cursor = 0, shuffled_rows(train_stream, seq_len + 1, 0, seed), 0
    t0 = time.perf_counter()
    recent: list[dict] = []
    for step in range(1, steps + 1):
        if cursor + batch > len(rows):
            epoch += 1
            rows, cursor = shuffled_rows(train_stream, seq_len + 1, epoch, seed), 0
        train_p, opt_state, metrics = step_fn(train_p, opt_state, fixed, jnp.asarray(rows[cursor : cursor + batch]))
        cursor += batch
        recent.append(metrics)
        if step % 10 == 0 or step == steps:
            m = {k: float(np.mean([float(r[k]) for r in recent])) for k in recent[0]}
            recent = []
            entry = {"step": step, "epoch": epoch, "tokens": step * batch * seq_len, "lr": float(schedule(step)),
                     "wall_s": time.perf_counter() - t0, "train_loss": m["main"], "train_mtp_loss": m["mtp"],
                     "grad_norm": m["grad_norm"]}
            if step % eval_every == 0 or step == steps:
                entry.update(evaluate(eval_fn, train_p, fixed, val_rows, eval_batch))
            history.append(entry)
            log(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in entry.items()))
    return unflatten_dotted(like, {**train_p, **fixed}), history
