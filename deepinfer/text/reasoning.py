"""DeepSeek's thinking output: the reasoning before ``</think>``, the answer after it.

With thinking on, DeepSeek's chat prompt ends with ``<think>`` (the template opens the
reasoning), so the output starts inside it: everything up to the end marker is
``reasoning_content``, everything after it is ``content`` (vLLM's DeepSeek reasoning
parsers return them the same way). An output that never writes the end marker was all
reasoning. The streaming parser holds back text that may be the start of the marker,
so a marker split across deltas never leaks into either part.
"""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"


def opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves the model inside a reasoning block."""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_START)


def split_reasoning(text: str) -> tuple[str, str | None]:
    """(reasoning, content) of a whole output; content None when the reasoning never ended."""
    reasoning, marker, content = text.partition(THINK_END)
    return reasoning, (content if marker else None)


class ReasoningStream:
    """Feeds output text deltas; each ``feed`` returns (reasoning delta, content delta)."""

    def __init__(self):
        self.in_reasoning = True
        self._held = ""  # a possible start of the end marker, not shown yet

    def feed(self, text: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", text
        buf = self._held + text
        reasoning, marker, content = buf.partition(THINK_END)
        if marker:
            self.in_reasoning, self._held = False, ""
            return reasoning, content
        keep = _marker_prefix_len(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], ""

    def flush(self) -> tuple[str, str]:
        """The output ended: held text was reasoning after all."""
        held, self._held = self._held, ""
        return (held, "") if self.in_reasoning else ("", held)


def _marker_prefix_len(text: str) -> int:
    """The longest suffix of text that is a proper prefix of the end marker."""
    for n in range(min(len(THINK_END) - 1, len(text)), 0, -1):
        if THINK_END.startswith(text[-n:]):
            return n
    return 0
