"""A small SSE client for the hostile-client tests: reads one completions stream over httpx and
reports exactly what arrived (text, finish reason, error events, whether [DONE] came)."""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field

import httpx


@dataclass
class StreamResult:
    status: int = 0
    text: str = ""
    finish_reason: str | None = None
    errors: list[dict] = field(default_factory=list)
    done: bool = False  # "data: [DONE]" arrived
    chunks: int = 0
    completion_tokens: int | None = None


def stream_completion(base: str, body: dict, key: str | None = None, timeout: float = 300, stop_after: int | None = None,
                      on_first=None) -> StreamResult:
    """POST a streaming completion; ``stop_after``: close the connection after that many chunks (a client
    that goes away). ``on_first``: called once the first chunk is in."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    out = StreamResult()
    with httpx.stream("POST", base + "/v1/completions", json=body, headers=headers, timeout=timeout) as r:
        out.status = r.status_code
        if r.status_code != 200:
            r.read()
            out.errors.append(r.json())
            return out
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                out.done = True
                break
            event = json.loads(data)
            if "error" in event:
                out.errors.append(event)
                continue
            out.chunks += 1
            if out.chunks == 1 and on_first is not None:
                on_first()
            if event.get("usage"):
                out.completion_tokens = event["usage"]["completion_tokens"]
            for c in event["choices"]:
                out.text += c["text"]
                out.finish_reason = c["finish_reason"] or out.finish_reason
            if stop_after is not None and out.chunks >= stop_after:
                break  # leaving the with-block closes the connection mid-stream
    return out


def raw_request(port: int, head: bytes, body: bytes, hold_s: float = 0.0, read: bool = True) -> bytes:
    """Send bytes as they are (half a body, say) on a fresh loopback connection; read the answer
    unless ``read`` is False (then close after ``hold_s``: a client that gives up)."""
    import time

    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head + body)
        if not read:
            time.sleep(hold_s)
            return b""
        data = b""
        while True:
            part = s.recv(65536)
            if not part:
                return data
            data += part
