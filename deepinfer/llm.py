"""The offline API, shaped like vLLM's:

    from deepinfer import LLM, SamplingParams
    llm = LLM(model="path/to/checkpoint")        # or a config.json (random weights), or a ModelConfig
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32))
    outs[0].outputs[0].text, outs[0].outputs[0].token_ids, outs[0].outputs[0].finish_reason

Prompts are strings (when the checkpoint has a tokenizer.json) or
``{"prompt_token_ids": [...]}``. Long batches show a progress bar.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import jax

from deepinfer.config import ModelConfig
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.models.deepseek_v4 import model_spec
from deepinfer.models.deepseek_v4.loader import load_checkpoint
from deepinfer.params import init_params
from deepinfer.runtime.engine import EngineConfig, LLMEngine

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny_mixed.json")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


def _load_tokenizer(directory: str):
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(path)


class LLM:
    def __init__(
        self,
        model: str | ModelConfig | None = None,
        *,
        params: dict | None = None,
        dtype: str = "float32",
        seed: int = 0,
        warmup: bool = True,
        **engine_kwargs: Any,
    ):
        """model: a checkpoint directory, a config.json (random weights from ``seed``), or a
        ModelConfig (with ``params`` or random weights). ``engine_kwargs`` go to EngineConfig
        (max_num_seqs, max_num_batched_tokens, max_model_len, kv_memory_bytes, ...)."""
        model = DEFAULT_MODEL if model is None else model
        self.tokenizer = None
        if isinstance(model, ModelConfig):
            cfg = model
        elif os.path.isdir(model):
            cfg, params = load_checkpoint(model, dtype=dtype, mtp="skip")
            self.tokenizer = _load_tokenizer(model)
        else:
            cfg = ModelConfig.from_json_file(model)
        if params is None:
            params = init_params(model_spec(cfg, include_mtp=False), jax.random.key(seed), dtype)
        self.cfg = cfg
        self.engine = LLMEngine(cfg, params, EngineConfig(**engine_kwargs))
        if warmup:
            self.engine.warmup()

    def _encode(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt:
                raise ValueError(f"a dict prompt needs 'prompt_token_ids', got keys {sorted(prompt)}")
            return None, list(prompt["prompt_token_ids"])
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (tokenizer.json): pass {'prompt_token_ids': [...]} instead")
            return prompt, self.tokenizer.encode(prompt).ids
        raise TypeError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        encoded = [self._encode(p) for p in prompts]
        reqs = []
        try:  # every prompt is checked before any runs: a bad one leaves nothing behind
            for (_, ids), sp in zip(encoded, sampling_params):
                reqs.append(self.engine.add_request(ids, sp))
        except Exception:
            for r in reqs:
                self.engine.abort(r)
            raise
        bar = None
        if use_tqdm and len(reqs) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(reqs), desc="Processed prompts", unit="req")
        try:
            self.engine.run_until_done(progress=bar.update if bar else None)
        finally:
            if bar:
                bar.close()
        return [
            RequestOutput(
                r.request_id, text, r.prompt_token_ids,
                [CompletionOutput(0, self._decode(r.output_token_ids), list(r.output_token_ids), r.finish_reason)],
            )
            for (text, _), r in zip(encoded, reqs)
        ]
