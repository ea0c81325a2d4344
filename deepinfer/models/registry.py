"""Which ModelFamily serves a config: the one place that names model packages, so the
runtime is handed a family without importing any family's internals."""

from __future__ import annotations

from deepinfer.config import ModelConfig
from deepinfer.models.deepseek_v4.family import DeepSeekV4
from deepinfer.models.interface import ModelFamily


def family_for(cfg: ModelConfig) -> ModelFamily:
    """The family implementing ``cfg`` (every ModelConfig today is DeepSeek-V4's; a second
    family adds its config type and a branch here)."""
    del cfg
    return DeepSeekV4()
