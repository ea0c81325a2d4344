"""DeepSeek-V4 in pure JAX: parameter tree, forward pass, MTP block, checkpoint names."""

from deepinfer.models.deepseek_v4.model import forward, forward_with_intermediates
from deepinfer.models.deepseek_v4.mtp import mtp_forward
from deepinfer.models.deepseek_v4.param_tree import model_spec

__all__ = ["forward", "forward_with_intermediates", "mtp_forward", "model_spec"]
