"""Incremental detokenization and stop strings, per request, on the host.

Text is decoded a few tokens at a time (``prefix`` .. end) so a multi-byte
character split across tokens is only emitted once it is whole, and decoding
stays O(new tokens) per step. Stop strings are searched in the text as it
grows, so they match across token boundaries; the text is cut before the stop
string. While streaming, the last ``len(longest stop) - 1`` characters are held
back (they might be the start of a stop string) and released at the end.

The tokenizer is a ``tokenizers.Tokenizer``; nothing here imports JAX.
"""

from __future__ import annotations

from dataclasses import dataclass

REPLACEMENT = "\ufffd"  # what decoding yields for an incomplete UTF-8 sequence


@dataclass
class TextDelta:
    text: str  # new text that may be shown now
    num_tokens: int  # output tokens covered so far (through the one that completed a stop string)
    stop: str | None = None  # the stop string that ended the output, if one did


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str] = (), skip_special_tokens: bool = True, min_tokens: int = 0,
                 include_stop: bool = False, spaces_between_special_tokens: bool | None = None):
        self.tokenizer = tokenizer
        # special token ids to set apart with spaces (vLLM's spaces_between_special_tokens), when kept
        self._spaced = special_ids(tokenizer) if spaces_between_special_tokens and not skip_special_tokens else None
        self.include_stop = include_stop  # keep the stop string at the end of the text (vLLM's include_stop_str_in_output)
        self.min_tokens = min_tokens  # stop strings count only once this many tokens exist (vLLM)
        self.stop = list(stop)
        self.skip_special_tokens = skip_special_tokens
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # decoded output so far (cut at a stop string once one is seen)
        self.emitted = 0  # characters of self.text already handed out
        self._prefix = 0  # ids[_prefix:_read] decode to text already counted
        self._read = 0
        self.stopped: str | None = None

    def _decode(self, ids: list[int]) -> str:
        if self._spaced:
            return decode_spaced(self.tokenizer, ids, self._spaced)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> TextDelta:
        """Feed new output tokens; returns the text that can be shown now."""
        if self.stopped is not None:
            return TextDelta("", len(self.ids), self.stopped)
        for token in new_ids:
            self.ids.append(token)
            before = self._decode(self.ids[self._prefix : self._read])
            after = self._decode(self.ids[self._prefix :])
            if after.endswith(REPLACEMENT):
                continue  # an unfinished character: wait for its next bytes
            grown = len(self.text)
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
            if self._find_stop(grown):
                return self._flush(len(self.ids))
        visible = max(self.emitted, len(self.text) - self.holdback)
        delta, self.emitted = self.text[self.emitted : visible], visible
        return TextDelta(delta, len(self.ids))

    def finish(self) -> TextDelta:
        """The output ended (length, EOS, ...): release held-back text and any unfinished character."""
        if self.stopped is not None:
            return TextDelta("", len(self.ids), self.stopped)
        tail = self._decode(self.ids[self._prefix :])
        before = self._decode(self.ids[self._prefix : self._read])
        grown = len(self.text)
        self.text += tail[len(before) :]
        self._read = len(self.ids)
        self._find_stop(grown)
        return self._flush(len(self.ids))

    def _find_stop(self, grown: int) -> bool:
        """Search for a stop string in text that reaches into what was just added."""
        if len(self.ids) <= self.min_tokens:
            return False
        best = None
        for s in self.stop:
            j = self.text.find(s, max(0, grown - len(s) + 1))
            if j >= 0 and (best is None or j < best[0]):
                best = (j, s)
        if best is None:
            return False
        self.text = self.text[: best[0] + (len(best[1]) if self.include_stop else 0)]
        self.stopped = best[1]
        return True

    def _flush(self, num_tokens: int) -> TextDelta:
        delta, self.emitted = self.text[self.emitted :], len(self.text)
        return TextDelta(delta, num_tokens, self.stopped)


def special_ids(tokenizer) -> frozenset[int]:
    """The ids of a ``tokenizers.Tokenizer``'s special added tokens."""
    return frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)


def decode_spaced(tokenizer, ids: list[int], special: frozenset[int]) -> str:
    """Runs of ordinary tokens decoded on their own, joined to each special token by one space
    (the slow tokenizers' join). Decoding a window that starts one token back, as the
    incremental detokenizer does, yields the same spaces as decoding everything."""
    parts, run = [], []
    for t in ids:
        if t in special:
            if run:
                parts.append(tokenizer.decode(run, skip_special_tokens=False))
                run = []
            parts.append(tokenizer.decode([t], skip_special_tokens=False))
        else:
            run.append(t)
    if run:
        parts.append(tokenizer.decode(run, skip_special_tokens=False))
    return " ".join(parts)


def byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet (GPT-2 style): printable stand-in character -> byte."""
    visible = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in visible:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


def token_bytes(tokenizer, token_id: int, decoder: dict[str, int]) -> bytes:
    """The bytes a token stands for (byte-level vocabularies), else its UTF-8 text."""
    piece = tokenizer.id_to_token(token_id)
    if piece is None:
        return b""
    if all(c in decoder for c in piece):
        return bytes(decoder[c] for c in piece)
    return piece.encode("utf-8")
