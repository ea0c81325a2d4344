"""Text handling, host only: the checkpoint's tokenizer, incremental detokenizing, stop strings and
the per-choice output they make (what the server streams and LLM.generate returns)."""
