"""Structured outputs through xgrammar: grammar specs (host, no xgrammar needed), the schema
features check, the compiler with its bounded cache, and per-request matchers that fill the
packed token bitmask the jitted step applies. xgrammar (the `structured` extra) is imported
only when a grammar is compiled."""
