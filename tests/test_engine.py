"""The engine: continuous batching with chunked prefill equals each request run alone; preemption;
allocator invariants; no compiles after warm-up; the offline LLM API."""


import jax
import numpy as np
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.engine_config import EngineConfig
from deepinfer.models.deepseek_v4 import forward
from deepinfer.runtime.compile_guard import CompileCounter
from deepinfer.runtime.engine import LLMEngine
from tests.engine_cases import ENGINE_KW, MAX_TOKENS, alone, drain, workload
from tests.reference import load_case

TOLERANCE = 1e-4
@pytest.mark.parametrize("budget", [8, 13, 32])
def test_engine_equals_each_request_alone(budget, reference_streams):
    case = load_case("mixed")
    prompts, expected = reference_streams
    engine = LLMEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=budget, keep_logits=True, **ENGINE_KW))
    reqs = drain(engine, prompts, lambda i: SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i]))
    fwd = jax.jit(forward, static_argnums=0)
    for i, prompt in enumerate(prompts):
        req = reqs[f"r{i}"]
        assert req.output_token_ids == expected[i], (i, req.output_token_ids, expected[i])
        # logits of every generated token against the whole-sequence forward
        seq = np.zeros((1, 96), np.int32)
        full = prompt + req.output_token_ids
        seq[0, : len(full)] = full
        ref = np.asarray(fwd(case.cfg, case.params, seq))[0, len(prompt) - 1 : len(full) - 1]
        got = np.stack(req.logits)
        assert np.max(np.abs(got - ref)) <= TOLERANCE * np.max(np.abs(ref)), i


def test_preemption_keeps_outputs_exact(reference_streams):
    case = load_case("mixed")
    prompts, expected = reference_streams
    small = EngineConfig(max_num_batched_tokens=32, num_pages=(("csa", 6), ("hca", 3)), **ENGINE_KW)
    engine = LLMEngine(case.cfg, case.params, small)
    reqs = drain(engine, prompts, lambda i: SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i]), first=8)
    assert engine.scheduler.num_preemptions > 0
    assert any(r.num_preemptions for r in reqs.values())
    for i in range(len(prompts)):
        assert reqs[f"r{i}"].output_token_ids == expected[i], i

    # seeded sampling too: the same tokens with and without preemption
    def sampled(i):
        return SamplingParams(temperature=1.0, top_p=0.9, seed=100 + i, max_tokens=MAX_TOKENS[i])

    roomy = drain(LLMEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=32, **ENGINE_KW)), prompts, sampled)
    tight_engine = LLMEngine(case.cfg, case.params, small)
    tight = drain(tight_engine, prompts, sampled, first=8)
    assert tight_engine.scheduler.num_preemptions > 0
    for rid, req in roomy.items():
        assert tight[rid].output_token_ids == req.output_token_ids, rid
    # and equal to the jitted generate() with the same seed: sampling depends on (seed, position) only
    assert roomy["r3"].output_token_ids == alone(case, prompts[3], MAX_TOKENS[3], temperature=1.0, top_p=0.9, seeds=103)


def test_nothing_compiles_after_warmup():
    case = load_case("mixed")
    engine = LLMEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=32, **ENGINE_KW))
    programs = engine.warmup()
    assert programs == 2  # token buckets (8, 32) x row bucket 8
    before = engine.num_compiles
    with CompileCounter() as counter:
        drain(engine, workload(case.cfg.vocab_size, seed=4), lambda i: SamplingParams(temperature=0.7, seed=i, max_tokens=MAX_TOKENS[i]))
    assert counter.count == 0 and engine.num_compiles == before
    assert len(engine.compiled_shapes) == programs


def test_warm_structured_covers_thinking_budgets_without_a_grammar_backend():
    """A thinking budget forces its end marker through the grammar bitmask, so with overlap its steps
    run as the two-program split even when no grammar backend is installed: ``warm_structured`` must
    compile those halves too (it once skipped them without a backend: 5 compiles mid-serving)."""
    case = load_case("mixed")
    engine = LLMEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=32, warm_structured=True,
                                                           **ENGINE_KW))
    assert engine.grammar is None
    engine.warmup()
    end = (7, 8)
    sampling = lambda i: SamplingParams(temperature=0.7, seed=i, max_tokens=MAX_TOKENS[i], ignore_eos=True,  # noqa: E731
                                        thinking_token_budget=3 if i % 2 == 0 else None, reasoning_end_token_ids=end)
    with CompileCounter(all_threads=True) as counter:
        reqs = drain(engine, workload(case.cfg.vocab_size, seed=4), sampling)
    assert counter.count == 0
    for i, req in enumerate(reqs[f"r{i}"] for i in range(len(reqs))):
        if i % 2 == 0 and len(req.output_token_ids) >= 5:  # the budget, then the marker
            assert tuple(req.output_token_ids[3:5]) == end and 7 not in req.output_token_ids[:3], (i, req.output_token_ids)


def test_requests_are_served_while_programs_compile_in_the_background(reference_streams):
    """The server's warm-up: one program compiled, serving starts with it (the token budget capped
    at its size), the others compile on a worker thread and are used once ready; the tokens are
    those of each request alone, and once warm nothing compiles on any thread."""
    case = load_case("mixed")
    prompts, expected = reference_streams
    # token buckets 2, 8, 32 (each with its own row bucket: 2, 8, 8) and a ring size no other test
    # uses, so that the worker compiles for real while the first requests run
    kw = dict(ENGINE_KW, token_buckets=(2, 8, 32), row_buckets=None, max_backtrack=13)
    engine = LLMEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=32, **kw))
    assert engine.warmup(background=True) == 1
    assert engine.warming is not None and engine.scheduler.token_budget == 8  # (8 tokens, 8 rows) first
    assert engine.stats().programs_compiling == (2, 32)  # what /debug/engine reports as still compiling
    steps = []
    schedule = engine.scheduler.schedule

    def recording():
        plan = schedule()
        steps.append((engine.scheduler.token_budget, plan.num_tokens, engine.warming is not None))
        return plan

    engine.scheduler.schedule = recording
    greedy = lambda i: SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i])  # noqa: E731
    reqs = drain(engine, prompts, greedy)
    assert any(warming and budget < 32 for budget, _, warming in steps), steps  # served while compiling
    assert all(n <= budget for budget, n, _ in steps)
    for i in range(len(prompts)):
        assert reqs[f"r{i}"].output_token_ids == expected[i], i
    assert engine.wait_warm(timeout=600)
    assert engine.warming is None and engine.scheduler.token_budget == 32
    steps.clear()
    with CompileCounter(all_threads=True) as counter:
        reqs = drain(engine, prompts, greedy)
    assert counter.count == 0
    assert max(n for _, n, _ in steps) > 8  # the larger programs are in use
    assert min(n for _, n, _ in steps) <= 2  # and the small decode one
    for i in range(len(prompts)):
        assert reqs[f"r{i}"].output_token_ids == expected[i], i


def test_compile_counter_sees_compiles():
    with CompileCounter() as counter:
        jax.jit(lambda x: x * 3 + 1)(np.arange(7.0))
    assert counter.count >= 1


def test_capacity_from_memory_budget(caplog):
    case = load_case("mixed")
    small = LLMEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=32, kv_memory_bytes=215_000, **ENGINE_KW))
    big = LLMEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=32, kv_memory_bytes=400_000, **ENGINE_KW))
    assert 0 < small.capacity.tokens < big.capacity.tokens
    assert small.capacity.bytes_total <= 215_000 and big.capacity.bytes_total <= 400_000
    with pytest.raises(ValueError, match="cannot hold the slots"):
        LLMEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=32, kv_memory_bytes=1000, **ENGINE_KW))


def test_engine_rejects_bad_requests_and_keeps_serving():
    case = load_case("mixed")
    engine = LLMEngine(case.cfg, case.params, EngineConfig(max_num_batched_tokens=32, **ENGINE_KW))
    with pytest.raises(ValueError, match=r"prompt token ids \[500\] are outside the vocabulary \(size 96\)"):
        engine.add_request([1, 500])
    with pytest.raises(ValueError, match="leaves no room to generate within max_model_len 96"):
        engine.add_request(list(range(96)))
    ok = engine.add_request([3, 4, 5], SamplingParams(temperature=0, max_tokens=3))
    engine.run_until_done()
    assert len(ok.output_token_ids) == 3
    engine.check_all_free()


@pytest.fixture(scope="module")
def checkpoint_with_tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    case = load_case("mixed")
    path = tmp_path_factory.mktemp("llm_ckpt")
    case.model.save_pretrained(path)
    vocab = {f"w{i}": i for i in range(96)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    return path


def test_llm_offline_api(checkpoint_with_tokenizer, reference_streams):
    prompts, expected = reference_streams
    llm = LLM(str(checkpoint_with_tokenizer), max_num_batched_tokens=32, **ENGINE_KW)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts[:4]] + ["w5 w17 w3"],
        [SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i]) for i in range(4)] + [SamplingParams(temperature=0, max_tokens=4)],
    )
    for i in range(4):
        assert outs[i].outputs[0].token_ids == expected[i]
        assert outs[i].outputs[0].finish_reason in ("length", "stop")
    text_out = outs[4]
    assert text_out.prompt == "w5 w17 w3" and text_out.prompt_token_ids == [5, 17, 3]
    ids = text_out.outputs[0].token_ids
    assert text_out.outputs[0].text == " ".join(f"w{t}" for t in ids)
    # the prefix cache: the same 60-token prompt again reuses all but its last token, unless salted apart
    # (requests admitted in the same step cannot reuse each other: what a step computes is cached after it)
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[9])
    (first,) = llm.generate([{"prompt_token_ids": prompts[9]}], sp)
    again, salted, text = llm.generate([{"prompt_token_ids": prompts[9]}, {"prompt_token_ids": prompts[9],
                                        "cache_salt": "tenant-2"}, {"prompt": "w5 w17 w3"}], [sp] * 3)
    assert [o.num_cached_tokens for o in (first, again, salted)] == [0, 59, 0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == salted.outputs[0].token_ids == expected[9]
    assert text.prompt_token_ids == [5, 17, 3]
    llm.engine.check_all_free()


def test_llm_bad_prompts(tmp_path):
    case = load_case("mixed")
    case.model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), warmup=False, max_num_batched_tokens=32, **ENGINE_KW)
    with pytest.raises(ValueError, match=r"no tokenizer \(tokenizer.json\): pass \{'prompt_token_ids'"):
        llm.generate("hello")
    with pytest.raises(ValueError, match="a dict prompt needs one of 'prompt_token_ids' or 'prompt'"):
        llm.generate({"prompt_token_ids": [1], "prompt": "x"})
    with pytest.raises(ValueError, match=r"got keys \['prompt_token_ids', 'salt'\]"):
        llm.generate({"prompt_token_ids": [1], "salt": "x"})
    with pytest.raises(TypeError, match="a prompt is a string or"):
        llm.generate({"prompt": [1]})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([{"prompt_token_ids": [1, 2]}, {"prompt_token_ids": [999]}])
    assert not llm.engine.has_unfinished  # the good prompt before the bad one was not left behind
    llm.engine.check_all_free()


def test_llm_n_choices_and_stop_strings(checkpoint_with_tokenizer):
    llm = LLM(str(checkpoint_with_tokenizer), max_num_batched_tokens=32, **ENGINE_KW)
    sp = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True, logprobs=2)
    first, again = llm.generate("w5 w17 w3", sp), llm.generate("w5 w17 w3", sp)
    outs = first[0].outputs
    assert [c.index for c in outs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in outs}) == 3  # each choice samples with its own seed
    assert [c.token_ids for c in outs] == [c.token_ids for c in again[0].outputs]  # and reproducibly
    for c in outs:
        assert len(c.logprobs) == 8 and all(len(lp[1]) == 2 for lp in c.logprobs)
        assert c.cumulative_logprob == pytest.approx(sum(lp[0] for lp in c.logprobs))
    greedy = llm.generate("w5 w17 w3", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    text = greedy.text
    cut = text.index(" ", 4)
    stop = text[cut - 1 : cut + 2]  # spans a token boundary ("7 w"-like)
    got = llm.generate("w5 w17 w3", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert got.text == text[: text.index(stop)]
    assert got.finish_reason == "stop" and got.stop_reason == stop
    assert got.token_ids == greedy.token_ids[: len(got.token_ids)] and len(got.token_ids) < 12
    llm.engine.check_all_free()
