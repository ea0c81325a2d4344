"""DeepSeek-V4 as a ModelFamily (models/interface.py): what the runtime is handed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from deepinfer.models.deepseek_v4 import state
from deepinfer.models.deepseek_v4.model import forward
from deepinfer.models.deepseek_v4.paged_forward import logits, paged_forward
from deepinfer.models.deepseek_v4.param_tree import model_spec


@dataclass(frozen=True)
class DeepSeekV4:
    """No fields: hashable and equal to every other instance, so it is a cheap static jit argument."""

    # The MTP drafter comes with speculative decoding (issue 14); until then no draft forward.
    draft_forward: Optional[Callable] = None

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
