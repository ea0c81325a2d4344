"""The SSE stream of ``POST /v1/responses`` with ``stream: true``, in OpenAI's event order:

response.created, response.in_progress, [with thinking: the reasoning item's output_item.added,
response.reasoning_text.delta ..., response.reasoning_text.done, output_item.done,]
response.output_item.added, response.content_part.added,
response.output_text.delta (one per piece of text), response.output_text.done,
response.content_part.done, response.output_item.done, response.completed;

each event numbered by ``sequence_number`` from 0. As vLLM does, the last event is
response.completed even when the response is incomplete (its ``status`` and
``incomplete_details`` say so): the openai client's stream helper finishes only on it. A
generation that fails ends with response.failed. There is no ``[DONE]`` line (OpenAI sends none).
"""

from __future__ import annotations

import itertools
import json

from deepinfer.serve.responses_format import (
    finished,
    message_id,
    output_message,
    reasoning_id,
    reasoning_item,
    reasoning_tokens,
    response_usage,
)
from deepinfer.serve.streaming import cached_tokens, run
from deepinfer.text.reasoning import ReasoningStream


def event(kind: str, number: int, fields: dict) -> str:
    """One SSE event: the ``event:`` line names the type, as OpenAI writes them."""
    body = {"type": kind, "sequence_number": number, **fields}
    return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


async def stream_response(state, seqs, arrival: float, shell: dict, thinking: bool = False, end_ids=()):
    """With ``thinking``, the reasoning item streams first (output index 0, response.reasoning_text
    events); the message item opens when the reasoning ends (text/reasoning.py)."""
    numbers = itertools.count()

    def emit(kind: str, **fields) -> str:
        return event(kind, next(numbers), fields)

    rid = shell["id"]
    yield emit("response.created", response=shell)
    yield emit("response.in_progress", response=shell)
    parser = ReasoningStream() if thinking else None
    thought, pieces, ids, output, reason = [], [], [], [], None
    message_at = None  # the message item's output index, once it is open
    rs_where = {"item_id": reasoning_id(rid), "output_index": 0, "content_index": 0}

    def open_message():
        nonlocal message_at
        message_at = len(output)  # after the reasoning item, when there is one
        where = {"item_id": message_id(rid), "output_index": message_at, "content_index": 0}
        yield emit("response.output_item.added", output_index=message_at,
                   item={"type": "message", "id": message_id(rid), "status": "in_progress", "role": "assistant",
                         "content": []})
        yield emit("response.content_part.added", **where,
                   part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def close_reasoning(ended: bool):
        item = reasoning_item(reasoning_id(rid), "".join(thought), ended)
        output.append(item)
        yield emit("response.reasoning_text.done", **rs_where, text=item["content"][0]["text"])
        yield emit("response.output_item.done", output_index=0, item=item)

    if thinking:
        yield emit("response.output_item.added", output_index=0,
                   item={"type": "reasoning", "id": reasoning_id(rid), "summary": [], "status": "in_progress",
                         "content": []})
    else:
        for e in open_message():
            yield e
    async for _, delta, error in run(state, seqs, arrival):
        if error is not None:
            yield emit("response.failed", response={
                **shell, "status": "failed", "error": {"code": "server_error", "message": f"generation failed: {error}"}})
            return
        ids += delta.token_ids
        reason = delta.finish_reason or reason
        text = delta.text
        if parser is not None and not output:  # still in the reasoning
            r, text = parser.feed(text)
            if reason is not None and parser.in_reasoning:
                r += parser.flush()[0]
            if r:
                thought.append(r)
                yield emit("response.reasoning_text.delta", **rs_where, delta=r)
            if not parser.in_reasoning:
                for e in close_reasoning(True):
                    yield e
                for e in open_message():
                    yield e
        if text and message_at is not None:  # nothing yet (e.g. half a UTF-8 character) sends no event
            pieces.append(text)
            yield emit("response.output_text.delta", item_id=message_id(rid), output_index=message_at,
                       content_index=0, delta=text, logprobs=[])
    if thinking and not output:  # the output ended inside the reasoning: no message
        for e in close_reasoning(False):
            yield e
    if message_at is not None:
        where = {"item_id": message_id(rid), "output_index": message_at, "content_index": 0}
        message = output_message(message_id(rid), "".join(pieces), reason)
        yield emit("response.output_text.done", **where, text=message["content"][0]["text"], logprobs=[])
        yield emit("response.content_part.done", **where, part=message["content"][0])
        yield emit("response.output_item.done", output_index=message_at, item=message)
        output.append(message)
    usage = response_usage(len(seqs[0].prompt_ids), len(ids), cached_tokens(seqs),
                           reasoning_tokens(ids, list(end_ids)) if thinking else 0)
    yield emit("response.completed", response=finished(shell, output, usage, reason))
