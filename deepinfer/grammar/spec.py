"""What a request constrains its output to, shaped like vLLM's ``StructuredOutputsParams``.

Exactly one of json / regex / choice / grammar / json_object / structural_tag is set. This
module needs no xgrammar: requests are validated (and refused, naming the field) before
anything compiles, and ``key()`` is the compile cache's key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

MAX_CHOICES = 256
MAX_SOURCE_CHARS = 1 << 20  # a schema / grammar / regex of more than a MiB is refused before compiling
_OPTIONS = ("disable_any_whitespace", "reasoning_end")  # fields that modify the constraint, not choose it


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema (dict or its text)
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar's GBNF dialect)
    json_object: bool | None = None  # any JSON object
    structural_tag: str | dict | None = None  # xgrammar's structural tag, as JSON
    # JSON: no free whitespace between tokens (compact output; a model cannot loop on spaces)
    disable_any_whitespace: bool = True
    # thinking: the output starts inside a reasoning block that this text ends (DeepSeek's "</think>");
    # the reasoning is free text (without the markers) and the constraint applies after it
    reasoning_end: str | None = None

    def __post_init__(self):
        set_ = [f.name for f in fields(self) if f.name not in _OPTIONS and getattr(self, f.name) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object, "
                f"structural_tag; got {set_ or 'none'}"
            )
        kind = set_[0]
        value = getattr(self, kind)
        if kind in ("json", "structural_tag"):
            if isinstance(value, str):
                try:
                    parsed = json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.{kind} is not valid JSON: {exc}") from None
            else:
                parsed = value
            if not isinstance(parsed, dict):
                raise ValueError(f"structured_outputs.{kind} must be a JSON object, got {type(parsed).__name__}")
        elif kind == "choice":
            if not isinstance(value, (list, tuple)) or not value or not all(isinstance(c, str) and c for c in value):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, got {value!r}")
            if len(value) > MAX_CHOICES:
                raise ValueError(f"structured_outputs.choice may hold at most {MAX_CHOICES} strings, got {len(value)}")
            object.__setattr__(self, "choice", tuple(value))
        elif kind in ("regex", "grammar"):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
        elif value is not True:
            raise ValueError(f"structured_outputs.json_object must be true, got {value!r}")
        if len(self.source()) > MAX_SOURCE_CHARS:
            raise ValueError(f"structured_outputs.{kind} is longer than {MAX_SOURCE_CHARS} characters")

    @property
    def kind(self) -> str:
        return next(f.name for f in fields(self) if f.name not in _OPTIONS and getattr(self, f.name) not in (None, False))

    def source(self) -> str:
        """The constraint as text (JSON re-serialised, so equal schemas share a cache entry)."""
        value = getattr(self, self.kind)
        if self.kind in ("json", "structural_tag"):
            return json.dumps(json.loads(value) if isinstance(value, str) else value)  # property order kept: it is the output order
        if self.kind == "choice":
            return json.dumps(list(value))
        return "" if value is True else value

    def schema(self) -> Any:
        """The JSON schema (kind "json") as a Python object."""
        return json.loads(self.source())

    def key(self) -> tuple[str, str, bool, str | None]:
        return self.kind, self.source(), self.disable_any_whitespace, self.reasoning_end

    @classmethod
    def from_dict(cls, d: dict) -> "StructuredOutputsParams":
        """From a request's ``structured_outputs`` object; unknown keys are refused by name."""
        if not isinstance(d, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"structured_outputs: unknown keys {unknown} (known: {sorted(known)})")
        return cls(**d)
