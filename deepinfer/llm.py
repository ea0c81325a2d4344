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
from deepinfer.default_model import default_model_dir
from deepinfer.engine_config import EngineConfig
from deepinfer.grammar.backend import GrammarBackend
from deepinfer.load_progress import LoadProgress
from deepinfer.model_loading import load_model
from deepinfer.models.deepseek_v4 import model_spec
from deepinfer.params import init_params
from deepinfer.runtime.engine import LLMEngine
from deepinfer.runtime.mesh_setup import load_shardings
from deepinfer.runtime.platform import select_platform
from deepinfer.scheduler.sampling_params import SamplingParams
from deepinfer.text.output import ChoiceOutput, take_new
from deepinfer.text.tokenizer import TextTokenizer


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None
    logprobs: list | None = None  # per token: (logprob, top ids, top logprobs), when asked for
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True
    # when asked for: None for the first prompt token, then (logprob, top ids, top logprobs) per token
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache let the engine skip (vLLM's name)


class LLM:
    def __init__(
        self,
        model: str | ModelConfig | None = None,
        *,
        params: dict | None = None,
        dtype: str = "float32",
        seed: int = 0,
        warmup: bool | str = True,
        quantized_weights: str = "dequantize",
        show_progress: bool = True,
        platform: str | None = None,
        pjrt_plugin: str | None = None,
        **engine_kwargs: Any,
    ):
        """model: a checkpoint directory, a config.json (random weights from ``seed``), or a
        ModelConfig (with ``params`` or random weights); None: the default model
        (deepinfer-tiny-v4, bundled: deepinfer.default_model). A checkpoint directory is
        safetensors (HF or official naming, FP8 / FP4 included) or orbax (deepinfer.convert);
        ``quantized_weights``: "dequantize" FP8 / FP4 weights to ``dtype`` at load, or "keep"
        them quantized in memory (dequantized inside each matmul). ``show_progress``: a
        loading bar (bytes and tensors). ``warmup``: True compiles every step program before
        returning; "background" compiles one and the rest on a worker thread while it serves
        (``self.engine.wait_warm()`` waits for them); False compiles each on first use.
        ``engine_kwargs`` go to EngineConfig
        (max_num_seqs, max_num_batched_tokens, max_model_len, kv_memory_bytes, speculative_config, ...).
        ``platform``: the devices to run on ("cpu", "gpu", or a PJRT plugin platform such as "npu";
        default DEEPINFER_PLATFORM, else JAX's choice), with ``pjrt_plugin`` the plugin's library
        (default DEEPINFER_PJRT_PLUGIN); chosen before anything loads (runtime/platform.py)."""
        model = default_model_dir() if model is None else model
        config = EngineConfig(**engine_kwargs)  # bad settings are refused before anything loads
        select_platform(platform or os.environ.get("DEEPINFER_PLATFORM"),
                        pjrt_plugin or os.environ.get("DEEPINFER_PJRT_PLUGIN"))
        speculating = config.num_speculative_tokens() > 0  # the MTP block is loaded only to draft
        self.tokenizer: TextTokenizer | None = None
        model_dir = None
        if isinstance(model, ModelConfig):
            cfg = model
        elif os.path.isdir(model):
            # refused clearly when speculating and the checkpoint lacks the MTP block
            progress = LoadProgress(bar=True) if show_progress else None
            try:
                cfg, params = load_model(model, dtype=dtype, mtp="require" if speculating else "skip",
                                         quantized_weights=quantized_weights, progress=progress,
                                         shardings_for=load_shardings(config))  # straight onto the mesh
            finally:
                if progress is not None:
                    progress.close()
            self.tokenizer = TextTokenizer.from_dir(model)
            model_dir = model
        else:
            cfg = ModelConfig.from_json_file(model)
        if params is None:
            params = init_params(model_spec(cfg, include_mtp=speculating), jax.random.key(seed), dtype)
        self.cfg = cfg
        # structured outputs compile against the checkpoint's tokenizer (xgrammar loads on first use)
        grammar = GrammarBackend(model_dir, cfg.vocab_size, cfg.eos_token_ids) if self.tokenizer is not None else None
        self.engine = LLMEngine(cfg, params, config, grammar=grammar)
        if warmup:
            self.engine.warmup(background=warmup == "background")

    def _encode(self, prompt: Any) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):  # vLLM's TokensPrompt / TextPrompt (cache_salt is read by generate)
            unknown = set(prompt) - {"prompt_token_ids", "prompt", "cache_salt"}
            if unknown or ("prompt_token_ids" in prompt) == ("prompt" in prompt):
                raise ValueError(f"a dict prompt needs one of 'prompt_token_ids' or 'prompt' (and optionally "
                                 f"'cache_salt'), got keys {sorted(prompt)}")
            if "prompt" in prompt:
                return self._encode(prompt["prompt"])
            return None, list(prompt["prompt_token_ids"])
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer (tokenizer.json): pass {'prompt_token_ids': [...]} instead")
            return prompt, self.tokenizer.encode(prompt)
        raise TypeError(f"a prompt is a string or {{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order, n choices each.
        ``priority`` (vLLM's): one per prompt, lower first, with ``scheduling_policy="priority"``."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling params for {len(prompts)} prompts")
        priority = [0] * len(prompts) if priority is None else list(priority)
        if len(priority) != len(prompts):
            raise ValueError(f"{len(priority)} priorities for {len(prompts)} prompts")
        encoded = [self._encode(p) for p in prompts]
        tok = self.tokenizer.tokenizer if self.tokenizer is not None else None
        tracked: dict[str, tuple[Any, ChoiceOutput]] = {}
        results = [RequestOutput(f"{i}", text, ids) for i, (text, ids) in enumerate(encoded)]
        first_choice_reqs = []  # per prompt: the engine request of choice 0 (it holds the prompt logprobs)
        try:  # every prompt is checked before any runs: a bad one leaves nothing behind
            for prompt, (_, ids), sp, result, prio in zip(prompts, encoded, sampling_params, results, priority):
                salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
                for i, choice_sp in enumerate(sp.choices()):
                    choice = ChoiceOutput(i, choice_sp, tok)
                    req = self.engine.add_request(ids, choice_sp, cache_salt=salt, priority=prio)
                    tracked[req.request_id] = (req, choice)
                    result.outputs.append(choice)
                    if i == 0:
                        first_choice_reqs.append(req)
        except Exception:
            for req, _ in tracked.values():
                self.engine.abort(req)
            raise
        bar = None
        if use_tqdm and len(tracked) > 1:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(tracked), desc="Processed prompts", unit="req")
        try:
            while self.engine.has_unfinished:
                self.engine.step()
                for req in self.engine.updated:  # includes the requests that finished
                    self._feed(req, tracked[req.request_id][1], bar)
        finally:
            if bar:
                bar.close()
        for result, req in zip(results, first_choice_reqs):
            result.num_cached_tokens = req.num_cached_tokens
            if req.sampling_params.prompt_logprobs is not None:
                result.prompt_logprobs = [None] + [req.prompt_logprobs.get(p) for p in range(1, len(req.prompt_token_ids))]
            result.outputs = [_completion(c) for c in result.outputs]
        return results

    def _feed(self, req, choice: ChoiceOutput, bar) -> None:
        if choice.finished:
            return  # ended by a stop string; later tokens of steps in flight are dropped
        ids, lps, reason = take_new(req, len(choice.token_ids))
        choice.add(ids, lps, reason)
        if choice.finished:
            if not req.is_finished:
                self.engine.abort(req, "stop")  # a stop string: the engine only sees tokens
            if bar:
                bar.update(1)


    def save_prefix_cache(self, directory: str) -> dict:
        """Write the prefix cache (blocks, their KV pages, snapshots) to ``directory`` with orbax; a later
        ``LLM`` of the same model and settings continues from it (``load_prefix_cache``)."""
        from deepinfer.runtime.prefix_persistence import save_prefix_cache

        return save_prefix_cache(self.engine, directory)

    def load_prefix_cache(self, directory: str) -> dict:
        """Load a cache ``save_prefix_cache`` wrote; refused, naming the difference, for other weights or settings."""
        from deepinfer.runtime.prefix_persistence import load_prefix_cache

        return load_prefix_cache(self.engine, directory)


def _completion(c: ChoiceOutput) -> CompletionOutput:
    lps = c.logprobs if c.sampling_params.logprobs is not None else None
    cumulative = sum(lp[0] for lp in lps) if lps else None
    return CompletionOutput(c.index, c.text, list(c.token_ids), c.finish_reason, cumulative, lps, c.stop_reason)
