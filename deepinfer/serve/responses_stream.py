"""The SSE stream of ``POST /v1/responses`` with ``stream: true``, in OpenAI's event order:

response.created, response.in_progress, response.output_item.added, response.content_part.added,
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
    response_usage,
)
from deepinfer.serve.streaming import cached_tokens, run


def event(kind: str, number: int, fields: dict) -> str:
    """One SSE event: the ``event:`` line names the type, as OpenAI writes them."""
    body = {"type": kind, "sequence_number": number, **fields}
    return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


async def stream_response(state, seqs, arrival: float, shell: dict):
    numbers = itertools.count()

    def emit(kind: str, **fields) -> str:
        return event(kind, next(numbers), fields)

    item_id = message_id(shell["id"])
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    yield emit("response.created", response=shell)
    yield emit("response.in_progress", response=shell)
    yield emit("response.output_item.added", output_index=0,
               item={"type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []})
    yield emit("response.content_part.added", **where,
               part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
    pieces, n_out, reason = [], 0, None
    async for _, delta, error in run(state, seqs, arrival):
        if error is not None:
            yield emit("response.failed", response={
                **shell, "status": "failed", "error": {"code": "server_error", "message": f"generation failed: {error}"}})
            return
        n_out += len(delta.token_ids)
        reason = delta.finish_reason or reason
        if delta.text:  # nothing yet (e.g. half a UTF-8 character) sends no event
            pieces.append(delta.text)
            yield emit("response.output_text.delta", **where, delta=delta.text, logprobs=[])
    text = "".join(pieces)
    message = output_message(item_id, text, reason)
    yield emit("response.output_text.done", **where, text=text, logprobs=[])
    yield emit("response.content_part.done", **where, part=message["content"][0])
    yield emit("response.output_item.done", output_index=0, item=message)
    usage = response_usage(len(seqs[0].prompt_ids), n_out, cached_tokens(seqs))
    yield emit("response.completed", response=finished(shell, message, usage, reason))
