"""The request fields that constrain an output, read into one StructuredOutputsParams, and the
grammar compile awaited off the engine thread.

Accepted spellings: OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``),
vLLM's ``structured_outputs`` object, and vLLM's older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``. At most one of them per request.
"""

from __future__ import annotations

import asyncio

from deepinfer.grammar.backend import GrammarError, StructuredOutputsUnavailable
from deepinfer.grammar.spec import StructuredOutputsParams
from deepinfer.serve.errors import bad_request

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_spec(req) -> StructuredOutputsParams | None:
    """The request's constraint (None: free text); a 400 naming the field when it is malformed."""
    given = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.get("type") != "text":
        given.append(("response_format", _from_response_format(rf)))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", _build("structured_outputs", lambda: StructuredOutputsParams.from_dict(
            req.structured_outputs))))
    for field, kind in GUIDED.items():
        value = getattr(req, field)
        if value is not None:
            given.append((field, _build(field, lambda: StructuredOutputsParams(**{kind: value}))))
    if req.guided_decoding_backend not in (None, "xgrammar", "auto"):
        raise bad_request(f"guided_decoding_backend must be 'xgrammar' (the only backend), got "
                          f"{req.guided_decoding_backend!r}", "guided_decoding_backend")
    if len(given) > 1:
        raise bad_request(f"send one output constraint, got {', '.join(f for f, _ in given)}", given[1][0])
    return given[0][1] if given else None


def constraint_field(req) -> str:
    """The field the request's constraint came in (named by errors about it)."""
    for name in ("response_format", "structured_outputs", *GUIDED):
        value = getattr(req, name, None)
        if value is not None and not (name == "response_format" and value.get("type") == "text"):
            return name
    return "response_format"


def _from_response_format(rf: dict) -> StructuredOutputsParams:
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
            raise bad_request("response_format json_schema needs {'json_schema': {'name': ..., 'schema': {...}}}",
                              "response_format.json_schema.schema")
        return _build("response_format", lambda: StructuredOutputsParams(json=js["schema"]))
    if kind == "structural_tag":
        tag = {k: v for k, v in rf.items() if k != "type"}
        return _build("response_format", lambda: StructuredOutputsParams(structural_tag=tag.get("format", tag)))
    raise bad_request(f"response_format.type must be 'text', 'json_object', 'json_schema' or 'structural_tag', "
                      f"got {kind!r}", "response_format.type")


def _build(field: str, make) -> StructuredOutputsParams:
    try:
        return make()
    except ValueError as exc:
        text = str(exc)
        raise bad_request(text if text.startswith(field) else f"{field}: {text}", field) from None


async def compile_grammar(state, spec: StructuredOutputsParams | None, field: str = "response_format"):
    """The compiled grammar of spec (None for None), compiled on the backend's threads while
    the engine keeps stepping; a 400 when it is invalid, unsupported or too slow to compile."""
    if spec is None:
        return None
    if state.grammar is None:
        raise bad_request("structured outputs need the model's tokenizer: this model has none", field)
    m = state.metrics
    try:
        future = state.grammar.submit(spec)
        hit = future.done()
        compiled = await asyncio.wait_for(asyncio.wrap_future(future), state.grammar.compile_timeout_s)
    except asyncio.TimeoutError:
        raise bad_request(str(state.grammar.timed_out(spec, state.grammar.compile_timeout_s)), field) from None
    except (GrammarError, StructuredOutputsUnavailable) as exc:
        raise bad_request(str(exc), field) from None
    if hit:
        m.grammar_cache_hits.inc()
    else:
        m.grammar_compile_time.observe(state.grammar.stats.last_compile_seconds)
    return compiled
