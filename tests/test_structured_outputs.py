"""Structured outputs on the bundled model: every JSON-schema output validates (jsonschema),
regex outputs fully match, EBNF outputs parse (the test's own parser), choices are one of the
choices; with the overlapped loop on and off, with MTP speculation, with n > 1. Bad
constraints are refused by name; a constraint longer than max_tokens ends with "length"."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from deepinfer.default_model import default_model_dir
from deepinfer.engine_config import EngineConfig
from deepinfer.grammar.backend import (
    GrammarBackend,
    GrammarError,
    StructuredOutputsUnavailable,
)
from deepinfer.grammar.schema_check import (
    HONOURED_FORMATS,
    IGNORED_KEYWORDS,
    unsupported_features,
)
from deepinfer.grammar.spec import StructuredOutputsParams
from deepinfer.models.deepseek_v4.loader import load_checkpoint
from deepinfer.runtime.engine import LLMEngine
from deepinfer.scheduler.sampling_params import SamplingParams
from deepinfer.text.tokenizer import TextTokenizer
from tests.bi_subprocess import run_batch_invariant
from tests.structured_cases import (
    ARITHMETIC,
    CHOICES,
    REGEXES,
    SCHEMAS,
    parses_arithmetic,
)

pytest.importorskip("xgrammar")

MAX_TOKENS = 96


@pytest.fixture(scope="module")
def bundled():
    cfg, params = load_checkpoint(default_model_dir(), mtp="require")
    tok = TextTokenizer.from_dir(default_model_dir())
    backend = GrammarBackend(default_model_dir(), cfg.vocab_size, cfg.eos_token_ids)
    return cfg, params, tok, backend


def cases():
    """(spec, check(text) -> bool) for every constraint the suite runs."""
    out = [(StructuredOutputsParams(json=s), lambda t, s=s: _valid(t, s)) for s in SCHEMAS]
    out += [(StructuredOutputsParams(regex=r), lambda t, r=r: re.fullmatch(r, t) is not None) for r in REGEXES]
    out.append((StructuredOutputsParams(grammar=ARITHMETIC), parses_arithmetic))
    out += [(StructuredOutputsParams(choice=c), lambda t, c=c: t in c) for c in CHOICES]
    return out


def _valid(text: str, schema: dict) -> bool:
    """jsonschema's validation (formats as annotations, its default; the grammar enforces them by
    syntax: a "date" is YYYY-MM-DD with a day of 01-31 whatever the month, which the date check
    here asserts)."""
    try:
        value = json.loads(text)
        jsonschema.validate(value, schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    day = value.get("day") if isinstance(value, dict) and schema["properties"].get("day") else None
    return day is None or re.fullmatch(r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])", day) is not None


def _engine(bundled, **kw) -> LLMEngine:
    cfg, params, _, backend = bundled
    ec = EngineConfig(**{"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 256, **kw})
    return LLMEngine(cfg, params, ec, grammar=backend)


def _prompts(tok, n):
    return [tok.encode(f"<｜User｜>Reply in the requested format, please ({i}).<｜Assistant｜>") for i in range(n)]


def _run(engine, prompts, sps):
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, sps)]
    while engine.has_unfinished:
        engine.step()
    engine.check_all_free()
    return reqs


def _text(tok, req) -> str:
    ids = [t for t in req.output_token_ids if t not in (1,)]
    return tok.tokenizer.decode(ids, skip_special_tokens=False)


def _sampling(i, spec, n_choices=1):
    """Alternate greedy and seeded sampled requests."""
    if i % 2:
        return SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=MAX_TOKENS, structured_outputs=spec)
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, structured_outputs=spec)


def _check_outputs(tok, reqs, checks):
    special = {i for i, t in tok.tokenizer.get_added_tokens_decoder().items() if t.special} - {1}
    leaked = [r.output_token_ids for r in reqs if special & set(r.output_token_ids)]
    assert not leaked, f"special tokens inside constrained outputs: {leaked[:3]}"
    bad = [(r.finish_reason, _text(tok, r)) for r, check in zip(reqs, checks)
           if r.finish_reason != "stop" or not check(_text(tok, r))]
    assert not bad, f"{len(bad)} of {len(reqs)} outputs break their constraint: {bad[:5]}"


MODES = {
    "overlap": {},
    "no_overlap": {"overlap": False},
    "mtp": {"speculative_config": {"method": "mtp", "num_speculative_tokens": 3}},
}


def _thinking(tok):
    """Thinking requests: the prompt opens <think>; a budget forces </think> (grammar/thinking_budget.py),
    one with a JSON schema after the reasoning, one seeded without a constraint."""
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "A list as JSON?"}], thinking=True),
                        add_special_tokens=False)
    end = tuple(tok.encode("</think>", add_special_tokens=False))
    after = StructuredOutputsParams(json=SCHEMAS[0], reasoning_end="</think>")
    sps = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, thinking_token_budget=4, reasoning_end_token_ids=end,
                          structured_outputs=after),
           SamplingParams(temperature=0.8, seed=3, max_tokens=24, min_tokens=12, thinking_token_budget=6,
                          reasoning_end_token_ids=end)]
    return [prompt, prompt], sps, end


def _check_thinking(tok, reqs, sps, end):
    for req, sp in zip(reqs, sps):
        out, k = req.output_token_ids, sp.thinking_token_budget
        assert tuple(out[k:k + len(end)]) == end and end[0] not in out[:k], out  # the budget, then the marker
        if sp.structured_outputs is not None:
            assert req.finish_reason == "stop" and _valid(_text(tok, req).split("</think>", 1)[1], SCHEMAS[0])


# without overlap with `pytest -m slow` (103 s of the suite on 2026-12-07; the loops differ only in the steps
# before a constrained request runs, and tests/test_overlap.py compares them on unconstrained requests)
@pytest.mark.parametrize("mode", [m if m != "no_overlap" else pytest.param(m, marks=pytest.mark.slow) for m in MODES])
def test_every_output_follows_its_constraint(bundled, mode):
    """All constraints in one batch with unconstrained requests and thinking-budget requests beside them
    (without overlap: every other one, as the loops differ only in the steps before a constrained
    request runs)."""
    _, _, tok, _ = bundled
    specs = cases() if mode != "no_overlap" else cases()[::2]
    prompts = _prompts(tok, len(specs) + 3)
    sps = [_sampling(i, s) for i, (s, _) in enumerate(specs)]
    sps += [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)] * 3
    think_prompts, think_sps, end = _thinking(tok)
    engine = _engine(bundled, **MODES[mode])
    reqs = _run(engine, prompts + think_prompts, sps + think_sps)
    _check_outputs(tok, reqs[: len(specs)], [c for _, c in specs])
    assert all(len(r.output_token_ids) == 20 for r in reqs[len(specs):len(sps)])
    _check_thinking(tok, reqs[len(sps):], think_sps, end)
    if mode == "mtp":
        constrained = reqs[: len(specs)]
        assert sum(r.num_accepted_tokens for r in constrained) > 0
        assert sum(r.num_draft_tokens - r.num_accepted_tokens for r in constrained) > 0  # rejections rolled back
        assert all(r.num_draft_tokens > 0 for r in reqs[len(sps):])  # the budget's matcher rolled back drafts too


def test_json_object_mode_gives_an_object(bundled):
    """json_object: any object (its keys are free strings, so a tiny model needs room to close them)."""
    _, _, tok, _ = bundled
    spec = StructuredOutputsParams(json_object=True)
    sps = [SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=spec)]
    reqs = _run(_engine(bundled), _prompts(tok, 1), sps)
    _check_outputs(tok, reqs, [lambda t: isinstance(json.loads(t), dict)])


def test_n_choices_each_follow_the_constraint(bundled):
    _, _, tok, _ = bundled
    specs = cases()[:: 3]
    prompts, sps, checks = [], [], []
    for i, (spec, check) in enumerate(specs):
        sp = SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=MAX_TOKENS, structured_outputs=spec)
        for choice in sp.choices():
            prompts.append(_prompts(tok, 1)[0])
            sps.append(choice)
            checks.append(check)
    reqs = _run(_engine(bundled), prompts, sps)
    _check_outputs(tok, reqs, checks)
    texts = [_text(tok, r) for r in reqs]
    assert len(set(texts)) > len(specs)  # choices differ (they sample with different seeds)


def test_a_constraint_longer_than_max_tokens_ends_with_length(bundled):
    _, _, tok, _ = bundled
    sp = SamplingParams(temperature=0.0, max_tokens=6, structured_outputs=StructuredOutputsParams(regex="[0-9]{40}x"))
    (req,) = _run(_engine(bundled), _prompts(tok, 1), [sp])
    assert req.finish_reason == "length" and len(req.output_token_ids) == 6
    assert re.fullmatch("[0-9]+", _text(tok, req))  # a prefix of the regex's language


@pytest.mark.parametrize("spec, message", [
    ({"regex": "(a"}, "invalid regex constraint: Regex parsing error at position 3: The parenthesis is not closed"),
    ({"grammar": 'root ::= "a" | '}, "invalid grammar constraint: EBNF parser error at line 1"),
    ({"grammar": "root ::= foo"}, 'Rule "foo" is not defined'),
    ({"json": {"type": "foo"}}, 'invalid json constraint: Unsupported type "foo"'),
    ({"json": {"$ref": "#/$defs/missing"}}, "Cannot find field $defs"),
    ({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
     "features structured outputs cannot enforce: 'uniqueItems' (unique array items) at #"),
    ({"json": {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}}, "'not' (negation) at #/properties/a"),
    ({"json": {"type": "string", "format": "iri"}}, "'format': 'iri' at #"),
    ({"json": {"type": "number", "multipleOf": 0.5}}, "'multipleOf' on a non-integer at #"),
    ({"json": {"oneOf": [{"type": "integer"}, {"minimum": 0}]}}, "'oneOf' without a discriminator at # (use anyOf)"),
    ({"structural_tag": {"type": "nonsense"}}, "invalid structural_tag constraint"),
])
def test_bad_constraints_are_refused_by_name(bundled, spec, message):
    backend = bundled[3]
    with pytest.raises(GrammarError) as err:
        backend.compile(StructuredOutputsParams(**spec))
    assert message in str(err.value)


@pytest.mark.parametrize("kwargs, message", [
    ({}, "must set exactly one of json, regex, choice, grammar, json_object, structural_tag; got none"),
    ({"regex": "a", "choice": ["a"]}, "got ['regex', 'choice']"),
    ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
    ({"json": "[1]"}, "structured_outputs.json must be a JSON object, got list"),
    ({"choice": []}, "structured_outputs.choice must be a non-empty list of non-empty strings"),
    ({"regex": "  "}, "structured_outputs.regex must be a non-empty string"),
    ({"json_object": "yes"}, "structured_outputs.json_object must be true"),
])
def test_malformed_specs_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError) as err:
        StructuredOutputsParams(**kwargs)
    assert message in str(err.value)


def test_sampling_params_refuse_what_contradicts_a_grammar():
    with pytest.raises(ValueError, match="unknown keys \\['jsn'\\]"):
        SamplingParams(structured_outputs={"jsn": {}})
    with pytest.raises(ValueError, match="cannot be combined with ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs={"regex": "a"})
    with pytest.raises(ValueError, match="cannot be combined with min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs={"regex": "a"})
    assert SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs.choice == ("a", "b")


def test_refused_keywords_are_exactly_ones_the_grammar_ignores(bundled):
    """Keeps schema_check honest: with the check bypassed, each refused keyword compiles into a
    grammar that accepts an instance breaking it; the enforced formats reject a non-instance."""
    backend = bundled[3]
    compiler = backend._ensure_compiler()
    xgr = backend.xgrammar

    def accepts(schema, text):
        return xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)).accept_string(text)

    breaking = {
        "not": ({"not": {"type": "string"}}, '"x"'),
        "if": ({"if": {"type": "integer"}, "then": {"minimum": 5}}, "1"),
        "dependentRequired": ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                               "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
        "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),
        "multipleOf": ({"type": "number", "multipleOf": 0.5}, "0.3"),
        "oneOf": ({"oneOf": [{"type": "integer"}, {"minimum": 0}]}, "1"),
        "allOf": ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "1"),
        "format": ({"type": "string", "format": "iri"}, '"~~ not it ~~"'),
    }
    for key, (schema, text) in breaking.items():
        assert unsupported_features(schema), key
        assert accepts(schema, text), f"xgrammar now enforces {key!r}: stop refusing it"
    assert {"not", "if", "dependentRequired", "uniqueItems"} <= set(IGNORED_KEYWORDS)
    for fmt in HONOURED_FORMATS:
        schema = {"type": "string", "format": fmt}
        assert not unsupported_features(schema) and not accepts(schema, '"~~ not it ~~"'), fmt


def test_compiles_are_cached_bounded_and_time_limited(bundled):
    cfg = bundled[0]
    backend = GrammarBackend(default_model_dir(), cfg.vocab_size, cfg.eos_token_ids, cache_bytes=1)
    a, b = StructuredOutputsParams(regex="[a-c]{2}"), StructuredOutputsParams(regex="[d-f]{2}")
    first = backend.compile(a)
    assert backend.compile(a) is first and backend.stats.cache_hits == 1 and backend.stats.compiles == 1
    backend.compile(b)  # over the byte bound: the older grammar is evicted, the newest kept
    assert backend.compile(a) is not first and backend.stats.compiles == 3
    slow = StructuredOutputsParams(json={"type": "object", "properties": {f"k{i}": {"type": "string", "pattern": "^[a-z]{1,20}$"}
                                                                         for i in range(200)}})
    with pytest.raises(GrammarError, match="compiling the json constraint took longer than 1e-06 s"):
        backend.compile(slow, timeout_s=1e-6)
    assert backend.stats.timeouts == 1
    assert backend.compile(slow).memory_size_bytes > 0  # the compile went on; the next request gets it


def test_without_xgrammar_or_a_tokenizer_requests_are_refused(bundled, monkeypatch):
    import builtins

    cfg = bundled[0]
    real_import = builtins.__import__

    def no_xgrammar(name, *a, **kw):
        if name == "xgrammar":
            raise ImportError("No module named 'xgrammar'")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_xgrammar)
    backend = GrammarBackend(default_model_dir(), cfg.vocab_size, cfg.eos_token_ids)
    with pytest.raises(StructuredOutputsUnavailable, match="pip install 'deepinfer\\[structured\\]'"):
        backend.compile(StructuredOutputsParams(regex="a"))
    monkeypatch.undo()
    with pytest.raises(StructuredOutputsUnavailable, match="need the model's tokenizer"):
        GrammarBackend(None, cfg.vocab_size, (1,)).compile(StructuredOutputsParams(regex="a"))
    engine = LLMEngine(cfg, bundled[1], EngineConfig(max_num_seqs=2, max_model_len=64))  # no grammar backend
    with pytest.raises(StructuredOutputsUnavailable, match="this engine has none"):
        engine.add_request([3, 4], SamplingParams(structured_outputs={"regex": "a"}))
    assert not engine.has_unfinished


def _batch_invariant_check() -> None:
    """Run in a fresh process with DEEPINFER_BATCH_INVARIANT=1 (the XLA flag must precede JAX):
    unconstrained requests give bitwise the same tokens and logits with constrained neighbours
    as without them, and the neighbours follow their constraints."""
    cfg, params = load_checkpoint(default_model_dir())
    tok = TextTokenizer.from_dir(default_model_dir())
    bundled = (cfg, params, tok, GrammarBackend(default_model_dir(), cfg.vocab_size, cfg.eos_token_ids))
    free = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=9, max_tokens=24, ignore_eos=True)]
    specs = cases()[::4]
    prompts = _prompts(tok, len(free) + len(specs))
    alone = _run(_engine(bundled, keep_logits=True), prompts[: len(free)], free)
    mixed = _run(_engine(bundled, keep_logits=True), prompts, free + [_sampling(i, s) for i, (s, _) in enumerate(specs)])
    for a, m in zip(alone, mixed):
        assert a.output_token_ids == m.output_token_ids
        assert all(np.array_equal(x, y) for x, y in zip(a.logits, m.logits)) and len(a.logits) == len(m.logits)
    _check_outputs(tok, mixed[len(free):], [c for _, c in specs])
    # overlapped, constrained steps run as two programs (model half, then sampling half once the
    # masks are filled); without overlap as one: the same bits either way
    fused = _run(_engine(bundled, keep_logits=True, overlap=False), prompts,
                 free + [_sampling(i, s) for i, (s, _) in enumerate(specs)])
    for a, m in zip(fused, mixed):
        assert a.output_token_ids == m.output_token_ids and all(np.array_equal(x, y) for x, y in zip(a.logits, m.logits))
    print("BITWISE OK")


@pytest.mark.slow  # 108 s (a batch-invariant subprocess compiling four engines); suite time
def test_batch_invariant_mode_unconstrained_neighbours_are_bitwise_unchanged():
    """And the split (overlapped) constrained step gives the fused step's bits."""
    run_batch_invariant("tests.test_structured_outputs", "_batch_invariant_check")


def test_warm_structured_compiles_the_split_step_so_nothing_compiles_later(bundled):
    _, _, tok, _ = bundled
    engine = _engine(bundled, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128, warm_structured=True)
    engine.warmup()
    compiled = engine.num_compiles
    specs = cases()[:3]
    sps = [_sampling(i, s) for i, (s, _) in enumerate(specs)] + [SamplingParams(temperature=0.0, max_tokens=8)]
    reqs = _run(engine, _prompts(tok, 4), sps)
    assert engine.num_compiles == compiled
    _check_outputs(tok, reqs[:3], [c for _, c in specs])
