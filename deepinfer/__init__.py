"""deepinfer: a JAX/XLA inference engine for the DeepSeek-V4 family.

``deepinfer.generate`` (the jitted on-device generation loop) and
``deepinfer.ModelConfig`` are imported lazily, so host-only modules (the
scheduler) can import the package without importing JAX.
"""

from deepinfer.runtime import batch_invariance as _batch_invariance
from deepinfer.runtime import xla_defaults as _xla_defaults

__all__ = ["generate", "GenerateOutput", "ModelConfig", "LLM", "SamplingParams", "StructuredOutputsParams"]

# DEEPINFER_BATCH_INVARIANT=1 needs an XLA flag before JAX starts its backend (see
# runtime/batch_invariance.py); importing deepinfer first is how it gets there in time.
if _batch_invariance.requested_by_env():
    _batch_invariance.configure_xla()
# XLA options that make the engine's step faster (runtime/xla_defaults.py); also before JAX starts
_xla_defaults.add_default_flags()


def __getattr__(name):
    if name in ("generate", "GenerateOutput"):
        from deepinfer.runtime import generate as module

        return getattr(module, name)
    if name == "LLM":
        from deepinfer.llm import LLM

        return LLM
    if name == "SamplingParams":
        from deepinfer.scheduler.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from deepinfer.grammar.spec import StructuredOutputsParams

        return StructuredOutputsParams
    if name == "ModelConfig":
        from deepinfer.config import ModelConfig

        return ModelConfig
    raise AttributeError(f"module 'deepinfer' has no attribute {name!r}")
