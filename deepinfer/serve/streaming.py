"""Running a request's sequences and writing its response: the merge of several sequences'
outputs, the non-streaming collect, and the SSE streams.

Every path ends: a sequence whose pump raises ends with an error item, a stream whose
formatting raises ends with an error event and ``[DONE]``, and a client that goes away
is one INFO line (ClientGone), not a traceback.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import StreamingResponse

from deepinfer.scheduler.sampling_params import SamplingParams
from deepinfer.serve.errors import APIError, ClientGone
from deepinfer.serve.formatting import (
    SSE_DONE,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_listing,
    sse,
    usage,
)
from deepinfer.serve.scoring import echo_logprobs, join_logprobs
from deepinfer.text.output import ChoiceDelta, ChoiceOutput
from deepinfer.text.reasoning import ReasoningStream
from deepinfer.text.tool_format import ToolCallStream

log = logging.getLogger("deepinfer.serve")


@dataclass
class Sequence:
    index: int  # choice index in the response
    request_id: str
    prompt_ids: list[int]
    sp: SamplingParams
    grammar: object = None  # the compiled grammar of a structured request (shared by its choices)
    prompt_index: int = 0
    cache_salt: str | None = None
    num_cached_tokens: int = 0  # filled in from the engine's first update
    priority: int = 0  # --scheduling-policy priority: lower is scheduled first


def cached_tokens(seqs: list[Sequence]) -> int:
    """usage.prompt_tokens_details.cached_tokens: per prompt, the most any of its choices reused."""
    best: dict[int, int] = {}
    for s in seqs:
        best[s.prompt_index] = max(best.get(s.prompt_index, 0), s.num_cached_tokens)
    return sum(best.values())


def sequences(prefix: str, prompts: list[list[int]], sps: list[SamplingParams], grammars=None,
              cache_salt: str | None = None, priority: int = 0) -> list[Sequence]:
    """One engine sequence per (prompt, choice); prompt i's choices get indices i*n .. i*n + n - 1."""
    out = []
    grammars = grammars or [None] * len(prompts)
    for i, (ids, sp, grammar) in enumerate(zip(prompts, sps, grammars)):
        for j, choice in enumerate(sp.choices()):
            out.append(Sequence(i * sp.n + j, f"{prefix}-{i}-{j}", ids, choice, grammar, i, cache_salt,
                                priority=priority))
    return out


async def run(
    state, seqs: list[Sequence], arrival: float, choices: dict[int, ChoiceOutput] | None = None
) -> AsyncIterator[tuple[Sequence, ChoiceDelta | None, str | None]]:
    """Merge the outputs of several sequences: yields (sequence, delta, error) as they arrive.
    ``choices``, when given, receives each sequence's accumulated ChoiceOutput by choice index."""
    out: asyncio.Queue = asyncio.Queue()
    tok = state.tokenizer.tokenizer if state.tokenizer else None
    m = state.metrics

    async def pump(seq: Sequence):
        choice = gen = None
        last, ended = None, False
        try:
            choice = ChoiceOutput(seq.index, seq.sp, tok)
            if choices is not None:
                choices[seq.index] = choice
            gen = state.engine.generate(seq.request_id, seq.prompt_ids, seq.sp, seq.grammar, seq.cache_salt,
                                        seq.priority)
            m.prompt_tokens.inc(len(seq.prompt_ids))
            async for upd in gen:
                seq.num_cached_tokens = max(seq.num_cached_tokens, upd.num_cached_tokens)
                if upd.error is not None:
                    ended = True
                    m.finished("error")
                    out.put_nowait((seq, None, upd.error))
                    return
                if upd.token_ids:
                    if last is None:  # the first tokens: queue time and time to first token
                        if upd.first_scheduled_time is not None:
                            m.request_queue_time.observe(max(0.0, upd.first_scheduled_time - arrival))
                        m.time_to_first_token.observe(upd.time - arrival)
                    else:  # tokens that arrived together share the gap since the last ones
                        for _ in upd.token_ids:
                            m.inter_token_latency.observe((upd.time - last) / len(upd.token_ids))
                    last = upd.time
                delta = choice.add(upd.token_ids, upd.logprobs, upd.finish_reason)
                if upd.prompt_logprobs is not None:
                    delta.prompt_logprobs = choice.prompt_logprobs = upd.prompt_logprobs
                m.generation_tokens.inc(len(delta.token_ids))
                if delta.finish_reason is not None:
                    m.e2e_request_latency.observe(time.monotonic() - arrival)
                    m.finished(delta.finish_reason)
                out.put_nowait((seq, delta, None))
                if choice.finished:
                    ended = True
                    return  # a stop string ends it early: closing gen aborts the engine request
        except Exception as e:  # noqa: BLE001 - whatever raises, this sequence ends with an error
            log.exception("request %s failed", seq.request_id)
            ended = True
            m.finished("error")
            out.put_nowait((seq, None, f"{type(e).__name__}: {e}"))
        finally:
            if not ended:
                m.finished("abort")  # the client went away (or the server is stopping)
            if gen is not None:
                await gen.aclose()
            out.put_nowait(None)  # the end marker, on every path

    tasks = [asyncio.create_task(pump(s)) for s in seqs]
    remaining = len(tasks)
    try:
        while remaining:
            item = await out.get()
            if item is None:
                remaining -= 1
                continue
            yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def collect(state, rid: str, seqs: list[Sequence], arrival: float, request: Request) -> dict[int, ChoiceOutput]:
    """Run to completion (non-streaming): each choice's output by index. A client that goes
    away cancels its sequences."""
    results: dict[int, ChoiceOutput] = {}

    async def gather():
        async for _, _, error in run(state, seqs, arrival, results):
            if error is not None:
                raise APIError(500, f"generation failed: {error}")

    task = asyncio.create_task(gather())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                task.result()
                return results
            if await request.is_disconnected():
                raise ClientGone(rid)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


def event_stream(rid: str, chunks) -> StreamingResponse:
    """An SSE response over an async iterator of ``data: ...`` lines. Whatever raises while
    the stream is written, the client still gets an error event and ``[DONE]``."""

    async def guarded():
        ended = False
        try:
            async for chunk in chunks:
                yield chunk
            ended = True
        except Exception as e:  # noqa: BLE001 - the stream must end with an event the client can read
            ended = True
            log.exception("request %s: stream failed", rid)
            yield sse(APIError(500, f"internal error: {type(e).__name__}: {e}").body())
            yield SSE_DONE
        finally:
            if not ended:  # closed or cancelled before the end: the client went away
                log.info("request %s: client disconnected mid-stream", rid)

    return StreamingResponse(guarded(), media_type="text/event-stream")


async def stream_completion(state, rid, seqs, arrival, n_prompt, include_usage, want_logprobs, text_of=None,
                            echoes=None, score_only=False, show_prompt_logprobs=True):
    """Completion chunks. ``echoes``: per prompt, the text sent first (echo); with logprobs the
    prompt's listing comes with it. ``score_only`` (max_tokens 0): nothing generated is sent."""
    text_of = text_of or state.text_of
    created, n_out = int(time.time()), 0
    offsets = {s.index: 0 for s in seqs}
    echoing = {s.index for s in seqs} if echoes else set()  # choices whose echo is still to send
    async for seq, delta, error in run(state, seqs, arrival):
        if error is not None:
            yield sse(APIError(500, f"generation failed: {error}").body())
            break
        if score_only:
            delta.text, delta.token_ids, delta.logprobs = "", [], []
            delta.finish_reason = delta.finish_reason and "length"
            delta.stop_reason = None
        n_out += len(delta.token_ids)
        head = echoes[seq.prompt_index] if seq.index in echoing else ""
        if not delta.text and delta.finish_reason is None and not (want_logprobs and delta.token_ids) \
                and delta.prompt_logprobs is None and seq.index not in echoing:
            continue  # nothing to show yet (e.g. half a UTF-8 character)
        lp = None
        if want_logprobs:
            prompt_part = None
            if seq.index in echoing:
                prompt_part, offsets[seq.index] = echo_logprobs(seq.prompt_ids, delta.prompt_logprobs or {}, text_of)
            lp = completion_logprobs(delta.token_ids, delta.logprobs, text_of, offsets[seq.index])
            offsets[seq.index] += sum(len(t) for t in lp["tokens"])
            if prompt_part is not None:
                lp = join_logprobs(prompt_part, lp)
        echoing.discard(seq.index)
        choice = {"index": seq.index, "text": head + delta.text, "logprobs": lp,
                  "finish_reason": delta.finish_reason, "stop_reason": delta.stop_reason}
        if delta.prompt_logprobs is not None and show_prompt_logprobs:
            choice["prompt_logprobs"] = prompt_logprobs_listing(seq.prompt_ids, delta.prompt_logprobs, text_of)
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                   "choices": [choice]})
    if include_usage:
        yield sse({"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                   "choices": [], "usage": usage(n_prompt, n_out, cached_tokens(seqs))})
    yield SSE_DONE


async def stream_chat(state, rid, seqs, arrival, n_prompt, include_usage, want_logprobs, parse_tools=False,
                      thinking=False, text_of=None):
    """Chat chunks; with ``thinking``, text before the reasoning's end goes out as
    ``reasoning_content`` deltas (text/reasoning.py); with ``parse_tools``, tool calls in the
    answer go out as ``tool_calls`` deltas (each call whole, once its block closes) and text
    that may open a call block is held until it is known."""
    text_of = text_of or state.text_of
    created, n_out = int(time.time()), 0
    parsers = {s.index: ToolCallStream() for s in seqs} if parse_tools else {}
    reasoners = {s.index: ReasoningStream() for s in seqs} if thinking else {}

    def chunk(choices):
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.model_name, "choices": choices}

    for s in seqs:
        yield sse(chunk([{"index": s.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]))
    async for seq, delta, error in run(state, seqs, arrival):
        if error is not None:
            yield sse(APIError(500, f"generation failed: {error}").body())
            break
        n_out += len(delta.token_ids)
        text, calls, reason, reasoning = delta.text, [], delta.finish_reason, ""
        reasoner = reasoners.get(seq.index)
        if reasoner is not None:
            reasoning, text = reasoner.feed(text)
            if reason is not None:
                more_reasoning, more_text = reasoner.flush()
                reasoning, text = reasoning + more_reasoning, text + more_text
        parser = parsers.get(seq.index)
        if parser is not None:
            text, calls = parser.feed(text)
            if reason is not None:
                text += parser.flush()
                if parser.num_calls and reason == "stop":
                    reason = "tool_calls"
        if not text and not reasoning and not calls and reason is None and not (want_logprobs and delta.token_ids):
            continue  # nothing to show yet (e.g. half a UTF-8 character, or a call block being written)
        body = {"content": text} if text or (reason is None and not calls and not reasoning) else {}
        if reasoning:
            body["reasoning_content"] = reasoning
        if calls:
            first = parser.num_calls - len(calls)
            body["tool_calls"] = [c.openai(first + i) for i, c in enumerate(calls)]
        yield sse(chunk([{
            "index": seq.index, "delta": body,
            "logprobs": chat_logprobs(delta.token_ids, delta.logprobs, text_of) if want_logprobs else None,
            "finish_reason": reason, "stop_reason": delta.stop_reason,
        }]))
    if include_usage:
        yield sse({**chunk([]), "usage": usage(n_prompt, n_out, cached_tokens(seqs))})
    yield SSE_DONE
