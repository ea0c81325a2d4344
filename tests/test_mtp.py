"""The MTP block against an independent torch reference written from the description.

transformers does not implement MTP, so the reference here is assembled in torch
from the published description: e = enorm(embed(t+1)), h = hnorm(streams) per
stream, x = e_proj(e) broadcast over streams + h_proj(h), one full decoder block
(transformers' DeepseekV4DecoderLayer, sliding-window attention, score-routed
MoE), then the MTP's own hyper-connection head, its norm, and the shared lm head.
"""

import copy

import jax
import numpy as np
import torch

from deepinfer.models.deepseek_v4 import forward_with_intermediates, mtp_forward
from deepinfer.models.deepseek_v4.loader import params_from_named_arrays
from deepinfer.params import flatten_dotted, unflatten_dotted
from tests.reference import TINY_CONFIGS, load_case, randomize_

TOLERANCE = 1e-4


class TorchMTP(torch.nn.Module):
    def __init__(self, name: str, seed: int):
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

        super().__init__()
        raw = copy.deepcopy(TINY_CONFIGS[name])
        raw.update(num_hidden_layers=1, layer_types=["sliding_attention"], mlp_layer_types=["moe"])
        from transformers import DeepseekV4Config

        self.config = DeepseekV4Config(**raw, attn_implementation="eager")
        d = self.config.hidden_size
        self.enorm = m.DeepseekV4RMSNorm(d, eps=self.config.rms_norm_eps)
        self.hnorm = m.DeepseekV4RMSNorm(d, eps=self.config.rms_norm_eps)
        self.e_proj = torch.nn.Linear(d, d, bias=False)
        self.h_proj = torch.nn.Linear(d, d, bias=False)
        self.block = m.DeepseekV4DecoderLayer(self.config, 0)
        self.hc_head = m.DeepseekV4HyperHead(self.config)
        self.norm = m.DeepseekV4RMSNorm(d, eps=self.config.rms_norm_eps)
        self.rotary = m.DeepseekV4RotaryEmbedding(self.config)
        self.n_routed_experts = self.config.n_routed_experts
        randomize_(self, seed)

    @torch.no_grad()
    def forward(self, streams, next_tokens, embed, head):
        b, s = next_tokens.shape
        e = self.enorm(embed[next_tokens])
        x = self.e_proj(e)[:, :, None, :] + self.h_proj(self.hnorm(streams))
        positions = torch.arange(s)[None].expand(b, s)
        rope = {k: self.rotary(x, positions, layer_type=k) for k in ("main", "compress")}
        q, k = torch.arange(s)[:, None], torch.arange(s)[None, :]
        allowed = (k <= q) & (k > q - self.config.sliding_window)
        mask = torch.where(allowed, 0.0, float("-inf"))[None, None].expand(b, 1, s, s)
        x = self.block(x, input_ids=next_tokens, position_embeddings=rope, position_ids=positions, attention_mask=mask)
        return self.norm(self.hc_head(x)) @ head.T


def _mtp_named_tensors(ref: TorchMTP) -> dict:
    named = {}
    for k, v in ref.state_dict().items():
        if "inv_freq" in k or k.startswith("rotary"):
            continue
        top, rest = k.split(".", 1)
        if top == "block":
            named[f"mtp.0.{rest}"] = v.numpy()
        elif top == "hc_head":
            named[f"mtp.0.hc_head.{rest}"] = v.numpy()
        else:
            named[f"mtp.0.{k}"] = v.numpy()
    return named


def _setup():
    case = load_case("mixed")
    ref = TorchMTP("mixed", seed=7)
    main_named = {k: v.numpy() for k, v in case.model.state_dict().items()}
    params = params_from_named_arrays(case.cfg, {**main_named, **_mtp_named_tensors(ref)}, mtp="require")
    return case, ref, params


def test_mtp_matches_independent_reference():
    case, ref, params = _setup()
    tokens = case.tokens
    # Main model streams from the torch reference (hook on the last layer) feed the torch MTP;
    # deepinfer's own streams feed deepinfer's MTP: the whole pipeline is compared.
    captured = {}
    hook = case.model.model.layers[-1].register_forward_hook(lambda m, i, o: captured.update(streams=o))
    with torch.no_grad():
        case.model(input_ids=torch.as_tensor(tokens), use_cache=False)
    hook.remove()
    next_tokens = np.roll(tokens, -1, axis=1)  # token t+1 at position t (the last one wraps; unused in training)
    expected = ref(
        captured["streams"], torch.as_tensor(next_tokens), case.model.model.embed_tokens.weight, case.model.lm_head.weight
    ).numpy()

    _, streams, _ = jax.jit(forward_with_intermediates, static_argnums=0)(case.cfg, params, tokens)
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    logits, out_streams = jax.jit(mtp_forward, static_argnums=(0, 2))(case.cfg, params, 0, streams, next_tokens, positions)
    logits = np.asarray(logits)
    assert out_streams.shape == streams.shape
    assert np.max(np.abs(logits - expected)) <= TOLERANCE * np.max(np.abs(expected)), np.max(np.abs(logits - expected))
    assert np.std(expected) > 0.1


def test_every_mtp_tensor_is_used():
    case, _, params = _setup()
    tokens = case.tokens
    next_tokens = np.roll(tokens, -1, axis=1)
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    _, streams, _ = jax.jit(forward_with_intermediates, static_argnums=0)(case.cfg, params, tokens)
    run = jax.jit(lambda p: mtp_forward(case.cfg, p, 0, streams, next_tokens, positions)[0])
    base = np.asarray(run(params))
    flat = flatten_dotted(params)
    rng = np.random.default_rng(1)
    unused = []
    for path, value in flat.items():
        if not path.startswith("mtp."):
            continue
        arr = np.asarray(value)
        if path.endswith("gate.bias"):
            new = arr + rng.normal(0, 5.0, arr.shape).astype(arr.dtype)
        else:
            new = arr + rng.normal(0, max(float(arr.std()), 0.3), arr.shape).astype(arr.dtype)
        out = np.asarray(run(unflatten_dotted(params, {**flat, path: new})))
        if np.max(np.abs(out - base)) <= TOLERANCE * np.max(np.abs(base)):
            unused.append(path)
    assert not unused, unused
