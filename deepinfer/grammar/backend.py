"""The grammar compiler: a checkpoint's tokenizer, xgrammar's compiler, a byte-bounded cache,
and compiles on worker threads with a time limit.

xgrammar (and the torch / transformers its wheel requires) is imported on the first
compile, never at engine start, so the core runtime runs without the `structured` extra;
without it a structured request is refused naming the extra. Compiles run on the backend's
own threads: the server awaits them off the engine thread (a slow compile delays only its
own request), and one that exceeds ``compile_timeout_s`` is refused (it finishes in the
background and its grammar is cached for the next request that asks).
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from deepinfer.grammar.schema_check import unsupported_features
from deepinfer.grammar.spec import StructuredOutputsParams

log = logging.getLogger("deepinfer.grammar")
INSTALL_HINT = "pip install 'deepinfer[structured]'"


class StructuredOutputsUnavailable(ValueError):
    """Structured outputs cannot run here (no xgrammar, or a model without a tokenizer)."""


class GrammarError(ValueError):
    """The constraint is invalid, uses a feature the grammar cannot honour, or took too long to compile."""


@dataclass
class GrammarStats:
    compiles: int = 0  # grammars compiled (cache misses)
    cache_hits: int = 0
    compile_seconds: float = 0.0  # all compiles together
    last_compile_seconds: float = 0.0
    timeouts: int = 0


def import_xgrammar():
    try:
        import xgrammar
    except ImportError as exc:
        raise StructuredOutputsUnavailable(
            f"structured outputs need xgrammar, which is not installed ({exc}): {INSTALL_HINT}"
        ) from None
    return xgrammar


class GrammarBackend:
    """Compiles StructuredOutputsParams for one tokenizer; thread-safe."""

    def __init__(self, tokenizer_dir: str | None, vocab_size: int, stop_token_ids: tuple[int, ...],
                 cache_bytes: int = 256 << 20, compile_timeout_s: float = 30.0, threads: int = 2):
        self.tokenizer_dir, self.vocab_size, self.stop_token_ids = tokenizer_dir, vocab_size, tuple(stop_token_ids)
        self.cache_bytes, self.compile_timeout_s = cache_bytes, compile_timeout_s
        self.stats = GrammarStats()
        self._cache: collections.OrderedDict[tuple, Any] = collections.OrderedDict()
        self._cached_bytes = 0
        self._inflight: dict[tuple, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="grammar-compile")
        self._xgr = self._compiler = None

    # -- set-up (first compile) ----------------------------------------------------

    def _ensure_compiler(self):
        with self._lock:
            if self._compiler is None:
                if self.tokenizer_dir is None or not os.path.exists(os.path.join(self.tokenizer_dir, "tokenizer.json")):
                    raise StructuredOutputsUnavailable("structured outputs need the model's tokenizer (tokenizer.json)")
                xgr = import_xgrammar()
                from transformers import PreTrainedTokenizerFast

                path = os.path.join(self.tokenizer_dir, "tokenizer.json")
                tokenizer = PreTrainedTokenizerFast(tokenizer_file=path)
                detected = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                              stop_token_ids=list(self.stop_token_ids))
                # Special tokens (<｜User｜>, ...) are text to xgrammar unless their entry is empty: blank
                # them, so no grammar ever lets one into a string (the stop tokens are kept apart by id).
                with open(path, encoding="utf-8") as f:
                    special = {t["id"] for t in json.load(f).get("added_tokens", []) if t.get("special")}
                encoded = [""] * self.vocab_size
                for token, idx in tokenizer.get_vocab().items():
                    if idx < self.vocab_size and idx not in special:
                        encoded[idx] = token
                info = xgr.TokenizerInfo(encoded, detected.vocab_type, vocab_size=self.vocab_size,
                                         stop_token_ids=list(self.stop_token_ids),
                                         add_prefix_space=detected.add_prefix_space)
                # our cache, not xgrammar's: it is bounded in bytes and counts its hits
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
                self._xgr = xgr
        return self._compiler

    def warm_in_background(self) -> None:
        """Load xgrammar and scan the vocabulary on a thread now (seconds), not on the first request."""
        def warm():
            try:
                self._ensure_compiler()
            except StructuredOutputsUnavailable as exc:
                log.info("structured outputs unavailable: %s", exc)
            except Exception:  # noqa: BLE001 - the first structured request reports it
                log.exception("loading the grammar backend failed")

        threading.Thread(target=warm, name="grammar-warm", daemon=True).start()

    @property
    def xgrammar(self):
        self._ensure_compiler()
        return self._xgr

    # -- compiling -------------------------------------------------------------------

    def submit(self, spec: StructuredOutputsParams) -> concurrent.futures.Future:
        """A future of the compiled grammar (done at once on a cache hit); raises GrammarError /
        StructuredOutputsUnavailable from ``result()``."""
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                self.stats.cache_hits += 1
                done = concurrent.futures.Future()
                done.set_result(self._cache[key])
                return done
            if key in self._inflight:  # the same grammar is compiling for another request
                self.stats.cache_hits += 1
                return self._inflight[key]
            future = self._pool.submit(self._compile_and_cache, spec, key)
            self._inflight[key] = future
            return future

    def compile(self, spec: StructuredOutputsParams, timeout_s: float | None = None):
        """The compiled grammar, waiting at most ``timeout_s`` (default: the backend's limit)."""
        future = self.submit(spec)
        limit = self.compile_timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            raise self.timed_out(spec, limit) from None

    def timed_out(self, spec: StructuredOutputsParams, limit: float) -> GrammarError:
        """Count a compile that outlived its wait and say so (the compile itself goes on)."""
        self.stats.timeouts += 1
        return GrammarError(f"compiling the {spec.kind} constraint took longer than {limit:g} s")

    def _compile_and_cache(self, spec: StructuredOutputsParams, key: tuple):
        try:
            compiler = self._ensure_compiler()
            t0 = time.perf_counter()
            compiled = self._compile(compiler, spec)
            seconds = time.perf_counter() - t0
            with self._lock:
                self.stats.compiles += 1
                self.stats.compile_seconds += seconds
                self.stats.last_compile_seconds = seconds
                self._store(key, compiled)
            return compiled
        finally:
            with self._lock:
                self._inflight.pop(key, None)

    def _store(self, key: tuple, compiled) -> None:
        size = int(compiled.memory_size_bytes)
        self._cache[key] = compiled
        self._cached_bytes += size
        while self._cached_bytes > self.cache_bytes and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_bytes -= int(old.memory_size_bytes)

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    def _compile(self, compiler, spec: StructuredOutputsParams):
        """One xgrammar Grammar per kind; with ``reasoning_end``, free reasoning text up to it
        (neither think marker inside) comes first, so one matcher runs from the first token."""
        xgr, kind = self._xgr, spec.kind
        try:
            if kind == "json":
                schema = spec.schema()
                problems = unsupported_features(schema)
                if problems:
                    raise GrammarError("the JSON schema uses features structured outputs cannot enforce: "
                                       + "; ".join(problems[:8]))
                grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=not spec.disable_any_whitespace,
                                                       strict_mode=True)
            elif kind == "json_object":  # any object (OpenAI's json_object mode)
                grammar = xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=not spec.disable_any_whitespace,
                                                       strict_mode=False)
            elif kind == "regex":
                grammar = xgr.Grammar.from_regex(spec.regex)
            elif kind in ("choice", "grammar"):
                grammar = xgr.Grammar.from_ebnf(choice_grammar(spec.choice) if kind == "choice" else spec.grammar)
            else:
                grammar = xgr.Grammar.from_structural_tag(spec.source())
            if spec.reasoning_end is not None:
                reasoning = xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": {
                    "type": "tag", "begin": "", "end": spec.reasoning_end,
                    "content": {"type": "any_text", "excludes": ["<think>", spec.reasoning_end]}}}))
                grammar = xgr.Grammar.concat(reasoning, grammar)
            return compiler.compile_grammar(grammar)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's parse / convert errors
            raise GrammarError(f"invalid {kind} constraint: {_clean(exc)}") from None

    # -- matching --------------------------------------------------------------------

    def matcher(self, compiled):
        """A fresh matcher of one request (it rolls back any number of tokens: speculation)."""
        return self.xgrammar.GrammarMatcher(compiled)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def choice_grammar(choices) -> str:
    """EBNF accepting exactly one of the strings (JSON string escapes are EBNF literal escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _clean(exc: Exception) -> str:
    """xgrammar's message without its '[time] file.cc:line: ' prefix."""
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        parts = text.split(": ", 1)
        if ".cc:" in parts[0]:
            text = parts[1]
    return text.splitlines()[0] if text else type(exc).__name__
