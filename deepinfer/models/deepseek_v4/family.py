"""DeepSeek-V4 as a ModelFamily (models/interface.py): what the runtime is handed."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.models.deepseek_v4 import kernel_setup, paged_mtp, state, weight_layout
from deepinfer.models.deepseek_v4.model import forward
from deepinfer.models.deepseek_v4.paged_forward import logits, paged_forward
from deepinfer.models.deepseek_v4.param_tree import model_spec


@dataclass(frozen=True)
class DeepSeekV4:
    """No fields: hashable and equal to every other instance, so it is a cheap static jit argument."""

    def param_specs(self, cfg):
        return model_spec(cfg)

    def pools(self, cfg):
        return state.pools(cfg)

    def init_state(self, cfg, layout, dtype):
        return state.init_state(cfg, layout, dtype)

    def state_axes(self, cfg, layout):
        return state.state_axes(cfg, layout)

    def forward(self, cfg, params, tokens):
        return forward(cfg, params, tokens)

    def paged_forward(self, cfg, params, model_state, tokens, batch, page_size):
        return paged_forward(cfg, params, model_state, tokens, batch, page_size)

    def logits(self, cfg, params, hidden):
        return logits(cfg, params, hidden)

    def draft_forward(self, cfg, params, model_state, hidden, next_tokens, batch, page_size, draft_from, draft_valid,
                      num_drafts, depth=None):
        """The MTP block (paged_mtp.py); needs params with "mtp" and a state built with layout.draft."""
        return paged_mtp.draft_forward(cfg, params, model_state, hidden, next_tokens, batch, page_size, draft_from,
                                       draft_valid, num_drafts, depth)

    def with_kernels(self, cfg, layout, max_pages, dtype, platform):
        """cfg with each op's Pallas kernel or reference chosen for the platform (kernel_setup.py)."""
        return kernel_setup.kernels_for(cfg, layout, max_pages, dtype, platform)

    def compute_layout(self, params, platform):
        """params with the dense projections stored as the platform's dot wants them (weight_layout.py)."""
        return weight_layout.for_platform(params, platform)

    def checkpoint_layout(self, params):
        """compute_layout's inverse: the tree as loaded ([out, in] everywhere)."""
        return weight_layout.checkpoint_layout(params)

    def replay_horizon(self, cfg, layout):
        return state.replay_horizon(cfg, layout)

    def check_draft(self, cfg, params):
        if not cfg.num_nextn_predict_layers:
            raise ValueError("speculative decoding needs an MTP block: the config has num_nextn_predict_layers = 0")
        if "mtp" not in params:
            raise ValueError("speculative decoding needs the MTP weights: these params have none (a checkpoint "
                             "without mtp.* tensors, or loaded with mtp='skip'); load with mtp='require'")
