"""The whole engine with the attention and indexer kernels in Pallas interpret mode: the same greedy
tokens as the references, on a config with sliding, CSA and HCA layers, over a mixed workload
(chunked prefill: a 32-token budget; requests arriving while others decode)."""

from __future__ import annotations

import pytest

from deepinfer.engine_config import EngineConfig
from deepinfer.runtime.engine import LLMEngine
from deepinfer.scheduler.sampling_params import SamplingParams
from pallas_kernels.selection import KernelChoice, KernelChoiceError, choose_kernels
from tests.engine_cases import ENGINE_KW, MAX_TOKENS, drain, workload
from tests.reference import load_case


def _streams(case, monkeypatch, spec):
    monkeypatch.setenv("DEEPINFER_KERNELS", spec)
    engine = LLMEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=32, **ENGINE_KW))
    assert engine.cfg.kernels == choose_kernels("cpu", spec)
    prompts = workload(case.cfg.vocab_size)[:6]
    done = drain(engine, prompts, lambda i: SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0))
    return {rid: list(r.output_token_ids) for rid, r in done.items()}


def test_engine_greedy_tokens_equal_with_kernels(monkeypatch):
    case = load_case("mixed")
    assert {"compressed_sparse_attention", "heavily_compressed_attention"} <= set(case.cfg.layer_types)
    ref = _streams(case, monkeypatch, "ref")
    ker = _streams(case, monkeypatch, "pallas")
    assert ker == ref


def test_switch_defaults_and_refusals():
    assert choose_kernels("cpu") == KernelChoice(interpret=True)  # references on a CPU
    assert choose_kernels("gpu") == KernelChoice("pallas", "pallas", "pallas")
    assert choose_kernels("npu") == KernelChoice()
    assert choose_kernels("gpu", "moe=ref").moe == "ref"
    with pytest.raises(KernelChoiceError, match="cannot lower"):
        choose_kernels("npu", "pallas")
    with pytest.raises(KernelChoiceError, match="'attn=pallas' is not one"):
        choose_kernels("cpu", "attn=pallas")
